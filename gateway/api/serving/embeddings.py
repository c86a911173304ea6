"""/v1/embeddings: inputs as token ids, one vector each from the engine (a prefill through the swarm), OpenAI's shape.

Shared with Ollama's /api/embed and /api/embeddings (``gateway.api.serving.ollama_embed``): the checks on the inputs
and the run as a session (quota admission, drain, cancel, the client leaving) are here once.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Sequence

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.common import reject_unsupported
from gateway.api.protocol.embeddings import (
    MAX_INPUTS,
    Embedding,
    EmbeddingInput,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from gateway.api.request_log import RequestRecord
from gateway.api.serving.common import RequestContext, ServingBase, new_id
from gateway.api.serving.stop_signals import race


class EmbeddingServing(ServingBase):
    async def create(self, body: EmbeddingRequest, context: RequestContext) -> EmbeddingResponse:
        adapter = await self.resolve_model(body.model)
        reject_unsupported(body)
        self.check_dimensions(body.dimensions)
        inputs = await self.token_inputs(body.input, "input")
        vectors = await self.compute(inputs, adapter, context)
        fmt = body.encoding_format or "float"
        data = [Embedding(embedding=encoded(vector, fmt), index=i) for i, vector in enumerate(vectors)]
        tokens = sum(len(ids) for ids in inputs)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=body.model, usage=usage)

    def check_dimensions(self, dimensions: int | None) -> None:
        """Only the model's own width: truncating a vector means something only for a model trained for it."""
        if dimensions is None:
            return
        width = self.engine.embedding_width
        if dimensions != width:
            raise InvalidRequest(
                f"This model's embeddings have {width} dimensions and cannot be shortened to {dimensions} "
                "(it was not trained for truncated embeddings); leave 'dimensions' out.",
                "unsupported_value",
                "dimensions",
            )

    async def token_inputs(self, raw: EmbeddingInput, param: str, truncate: bool = False) -> list[list[int]]:
        """Every input as token ids, checked: non-empty, within the vocabulary and (or cut to, with ``truncate``)
        the context length."""
        items = _items(raw)
        if not items:
            raise InvalidRequest(f"'{param}' must not be empty.", "invalid_value", param)
        if len(items) > MAX_INPUTS:
            raise InvalidRequest(f"'{param}' takes at most {MAX_INPUTS} inputs.", "invalid_value", param)
        texts = [item for item in items if isinstance(item, str)]
        encoded_texts = iter(await asyncio.to_thread(self._encode_all, texts))
        inputs = [next(encoded_texts) if isinstance(item, str) else list(item) for item in items]
        limit = self.engine.context_length
        for index, ids in enumerate(inputs):
            self.check_token_ids(ids, param)
            if len(ids) > limit and not truncate:
                raise InvalidRequest(
                    f"This model's maximum context length is {limit} tokens, but {param}[{index}] has {len(ids)} "
                    "tokens. Please shorten it.",
                    "context_length_exceeded",
                    param,
                )
        return [ids[:limit] for ids in inputs]

    def _encode_all(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.engine.codec.encode(text) for text in texts]

    async def compute(self, inputs: list[list[int]], adapter: str | None, context: RequestContext) -> list[list[float]]:
        """The engine's vectors, run as a session: admitted under the caller's quota, stopped by a cancel or the
        client leaving (which closes the inputs' node sessions)."""
        tokens = sum(len(ids) for ids in inputs)
        record = RequestRecord(new_id("embd"), "embeddings", len(inputs), tokens)
        live = await self.sessions.open(record, context.caller, tokens)

        async def work() -> list[list[float]]:
            async with record.tracking():
                return await self.engine.embed(inputs, adapter)

        return await live.finish_after(race(work(), context.client_left, live.cancelled))


def _items(raw: EmbeddingInput) -> list[str | list[int]]:
    """One string, a list of strings, one list of token ids, or a list of them -> the list of inputs."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(token, int) for token in raw):
        return [[int(token) for token in raw]]  # type: ignore[arg-type]  # ints, checked just above
    return list(raw)  # type: ignore[arg-type]  # strings or lists of ids


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """``base64``: the little-endian float32 bytes, base64-encoded (what the ``openai`` client decodes)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
