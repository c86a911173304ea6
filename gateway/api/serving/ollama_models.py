"""Ollama's model endpoints (/api/tags, /api/show, /api/ps, /api/version) and embeddings (/api/embed, /api/embeddings).

The served model (and each LoRA adapter live nodes serve) is one Ollama model named ``name:latest``. It is always
"running" while the swarm serves it: /api/ps lists it with no expiry, since ``keep_alive`` cannot unload a swarm's
blocks (docs/ollama.md). Its digest is a stable id of the name, size and date, not a hash of the file (hashing a
large GGUF for every listing would cost seconds).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.ollama import (
    OLLAMA_VERSION,
    EmbedRequest,
    LegacyEmbeddingsRequest,
    ListedModel,
    ModelDetails,
    RunningModel,
    ShowRequest,
)
from gateway.api.serving.common import RequestContext
from gateway.api.serving.embeddings import EmbeddingServing
from gateway.api.serving.ollama_output import Clock
from gateway.api.serving.ollama_translate import check_options, model_tag, ollama_not_found, untagged
from gateway.generation import Engine, ModelFacts
from gateway.text.reasoning import reasoning_enabled

NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at for a model nothing unloads


class OllamaModels:
    def __init__(self, embeddings: EmbeddingServing) -> None:
        self.embeddings = embeddings  # its engine, config and sessions are what every endpoint here needs

    @property
    def engine(self) -> Engine:
        return self.embeddings.engine

    async def names(self) -> list[str]:
        return [self.embeddings.config.model_name, *await self.engine.served_adapters()]

    async def tags(self) -> dict[str, Any]:
        facts = await self.engine.model_facts()
        return {"models": [self._listed(name, facts).model_dump() for name in await self.names()]}

    async def ps(self) -> dict[str, Any]:
        facts = await self.engine.model_facts()
        running = []
        if not await self.engine.missing_blocks():
            for name in await self.names():
                listed = self._listed(name, facts).model_dump()
                running.append(
                    RunningModel(
                        **listed, expires_at=NEVER, size_vram=0, context_length=self.engine.context_length
                    ).model_dump()
                )
        return {"models": running}

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION}

    async def show(self, body: ShowRequest) -> dict[str, Any]:
        name = body.model or body.name
        if not name:
            raise InvalidRequest("model is required", "missing_required_parameter", "model")
        if untagged(name) not in await self.names():
            raise ollama_not_found(name)
        facts = await self.engine.model_facts()
        template = self.engine.codec.chat_template() or ""
        capabilities = ["completion", "tools", "embedding"]
        if reasoning_enabled("auto", template):
            capabilities.append("thinking")
        defaults = self.embeddings.config.sampling_defaults
        return {
            "modelfile": f"# served by swarmgate from a swarm of nodes\nFROM {untagged(name)}\n",
            "parameters": "\n".join(f"{key} {value}" for key, value in sorted(defaults.items())),
            "template": template,  # the model's Jinja chat template (Ollama's own are Go templates)
            "details": _details(facts).model_dump(),
            "model_info": self._model_info(facts),
            "capabilities": capabilities,
            "modified_at": _iso(facts.modified),
        }

    async def embed(self, body: EmbedRequest, context: RequestContext) -> dict[str, Any]:
        clock = Clock()
        adapter = await self._resolve(body.model)
        check_options(body.options, self.engine.context_length)
        if body.dimensions is not None:
            self.embeddings.check_dimensions(body.dimensions)
        inputs = await self.embeddings.token_inputs(body.input, "input", truncate=body.truncate)
        clock.start()
        vectors = await self.embeddings.compute(inputs, adapter, context)
        tokens = sum(len(ids) for ids in inputs)
        timings = clock.timings(tokens, 0)
        return {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": timings.total_duration,
            "load_duration": timings.load_duration,
            "prompt_eval_count": tokens,
        }

    async def legacy_embeddings(self, body: LegacyEmbeddingsRequest, context: RequestContext) -> dict[str, Any]:
        adapter = await self._resolve(body.model)
        check_options(body.options, self.engine.context_length)
        if not body.prompt:
            return {"embedding": []}  # what Ollama answers for an empty prompt
        inputs = await self.embeddings.token_inputs(body.prompt, "prompt", truncate=True)
        return {"embedding": (await self.embeddings.compute(inputs, adapter, context))[0]}

    async def _resolve(self, name: str) -> str | None:
        base = untagged(name)
        if base == self.embeddings.config.model_name:
            return None
        if base in await self.engine.served_adapters():
            return base
        raise ollama_not_found(name)

    def _listed(self, name: str, facts: ModelFacts) -> ListedModel:
        tagged = model_tag(name)
        identity = f"{tagged}\0{facts.size_bytes}\0{facts.modified}".encode()
        return ListedModel(
            name=tagged,
            model=tagged,
            modified_at=_iso(facts.modified),
            size=facts.size_bytes,
            digest=hashlib.sha256(identity).hexdigest(),
            details=_details(facts),
        )

    def _model_info(self, facts: ModelFacts) -> dict[str, Any]:
        """Ollama's GGUF-style keys for what clients read (context length, width, blocks), then the config."""
        arch = facts.family
        config = facts.architecture
        info: dict[str, Any] = {
            "general.architecture": arch,
            "general.parameter_count": facts.parameters,
            f"{arch}.context_length": self.engine.context_length,
            f"{arch}.embedding_length": self.engine.embedding_width,
        }
        if "num_hidden_layers" in config:
            info[f"{arch}.block_count"] = config["num_hidden_layers"]
        if "num_attention_heads" in config:
            info[f"{arch}.attention.head_count"] = config["num_attention_heads"]
        return info


def _details(facts: ModelFacts) -> ModelDetails:
    return ModelDetails(
        format=facts.file_format,
        family=facts.family,
        families=[facts.family],
        parameter_size=_size(facts.parameters),
        quantization_level=facts.quantization,
    )


def _size(parameters: int) -> str:
    """135_000_000 -> "135M", as Ollama writes parameter sizes."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{unit}".replace(".0" + unit, unit)
    return str(parameters)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")
