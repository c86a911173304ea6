"""The model list, tokenize/detokenize, and readiness: small answers about the served model and the swarm."""

from __future__ import annotations

import asyncio
import logging

from gateway.api.errors import InvalidRequest, ServiceUnavailable
from gateway.api.protocol.chat import TokenizeRequest
from gateway.api.protocol.common import DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from gateway.api.serving.chat import ChatServing
from gateway.api.serving.common import ServingBase
from shared.errors import format_block_ranges

logger = logging.getLogger(__name__)


class ModelServing(ServingBase):
    _coverage_note: str | None = None  # the last gap logged, so each change is logged once

    def card(self, adapter: str | None = None) -> ModelCard:
        length = self.engine.context_length
        if adapter is None:
            return ModelCard(id=self.config.model_name, context_length=length, max_model_len=length)
        base = self.config.model_name
        return ModelCard(id=adapter, root=adapter, parent=base, context_length=length, max_model_len=length)

    async def models(self) -> ModelList:
        """The base model, then each LoRA adapter some live node serves for every block (parent: the base model)."""
        adapters = await self.engine.served_adapters()
        return ModelList(data=[self.card(), *(self.card(adapter) for adapter in adapters)])

    async def model(self, model_id: str) -> ModelCard:
        return self.card(await self.resolve_model(model_id))

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        if body.model is not None:
            self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("Give exactly one of 'prompt' and 'messages'.", "invalid_value", "prompt")
        if body.messages is not None:
            ids = await ChatServing(self.engine, self.config, self.sessions).prompt_ids(body.messages)
        else:
            ids = await self.encode(body.prompt or "", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.context_length, tokens=ids)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            self.check_model(body.model)
        if any(not 0 <= token < self.codec_vocab for token in body.tokens):
            raise InvalidRequest(f"Token ids must lie in [0, {self.codec_vocab}).", "invalid_value", "tokens")
        text = await asyncio.to_thread(self.engine.codec.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    async def swarm(self) -> dict[str, object]:
        return await self.engine.swarm_report()

    async def ready(self, require_swarm: bool = False) -> dict[str, object]:
        """Ready while this process can answer (a swarm gap it answers itself, 503 ``missing_blocks``); the body
        says whether the swarm covers every block. ``require_swarm``: also ``ServiceUnavailable`` while it doesn't."""
        if self.sessions.draining:
            raise ServiceUnavailable("This gateway is shutting down.", "draining")
        swarm = await self.swarm_coverage()
        if require_swarm and not swarm["complete"]:
            raise ServiceUnavailable(str(swarm["message"]), "missing_blocks")
        return {
            "status": "ready",
            "model": self.config.model_name,
            "redis": self.sessions.store.link.state,
            "swarm": swarm,
        }

    async def swarm_coverage(self) -> dict[str, object]:
        """Whether live nodes cover every block; if not, which are missing and, when no node serves this model at
        all but nodes serve others, which (logged once per change: a model name that differs from the nodes')."""
        missing = await self.engine.missing_blocks()
        if not missing:
            self._coverage_note = None
            return {"complete": True, "missing_blocks": None, "message": None}
        message = f"No live node serves blocks {format_block_ranges(missing)} of {self.config.model_name} yet."
        announced = await self.engine.announced_models()
        if announced and self.engine.model_name not in announced:
            message = f"no node announces model {self.engine.model_name}; nodes announce {', '.join(announced)}"
        if message != self._coverage_note:
            self._coverage_note = message
            logger.warning("%s", message)
        return {"complete": False, "missing_blocks": format_block_ranges(missing), "message": message}
