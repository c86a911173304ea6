"""A scripted engine and a one-character-per-token codec: the seam the HTTP layer's unit tests drive it through.

The real engine over real nodes is exercised in tests/integration/; this fake never stands in for it there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from gateway.generation import ChatTemplateMissing, EngineEvent, GeneratedToken, GenerationRequest

ALPHABET = "<abcdefghijklmnopqrstuvwxyz "  # token i is character i; token 0 ("<") is EOS


def content_of(message: dict[str, Any]) -> str:
    return str(message["content"])


class CharCodec:
    """One token per character of ``ALPHABET``. Chat: none unless a subclass sets ``chat_message`` (how one message is
    spelled; ``chat_sep`` joins them), a trivial template that lets chat requests reach the engine."""

    vocab_size = len(ALPHABET)
    chat_message: Callable[[dict[str, Any]], str] | None = None
    chat_sep = ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) for c in text if c in ALPHABET]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(ALPHABET[t] for t in token_ids if t != 0)

    def token_bytes(self, token_id: int) -> bytes:
        return ALPHABET[token_id].encode()

    def chat_template(self) -> str | None:
        return None

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = None, template_kwargs: Any = None) -> str:
        if self.chat_message is None:
            raise ChatTemplateMissing("this model's tokenizer has no chat template")
        return self.chat_sep.join(self.chat_message(message) for message in messages)

    def fim_ids(self) -> tuple[int, int, int] | None:
        return None


class WholeSwarm:
    """What a fake engine answers about its swarm: every block served, no adapters, itself the only model."""

    model_name: str

    embedding_pooling = "last"
    embedding_width = 4

    async def embed(self, inputs: Sequence[Sequence[int]], adapter: str | None = None) -> list[list[float]]:
        """A unit vector per input from its token ids (a bag of ids mod 4): enough for the HTTP layer's tests."""
        vectors = []
        for ids in inputs:
            counts = [float(sum(1 for token in ids if token % 4 == axis)) for axis in range(4)]
            length = sum(c * c for c in counts) ** 0.5 or 1.0
            vectors.append([c / length for c in counts])
        return vectors

    async def missing_blocks(self) -> list[int]:
        return []

    async def served_adapters(self) -> list[str]:
        return []

    async def announced_models(self) -> list[str]:
        return [self.model_name]

    async def swarm_report(self) -> dict[str, Any]:
        return {}


@dataclass
class ScriptedEngine(WholeSwarm):
    """Generates ``script`` (as text) for every request; ``fail_at`` raises ``failure`` before that token. A ``<``
    in the script is an EOS token, which ends the generation unless the request says ``ignore_eos`` (as the real
    engine does). ``stall_seconds`` > 0: the engine produces nothing for that long before token ``stall_at`` (a
    frozen node, a failover waiting for a replacement); ``token_seconds`` before every other token."""

    script: str = "hello world"
    failure: Exception | None = None
    fail_at: int = 0
    stall_at: int = 0
    stall_seconds: float = 0.0
    token_seconds: float = 0.001  # others get turns
    model_name: str = "scripted"
    context_length: int = 64
    codec: CharCodec = field(default_factory=CharCodec)
    active: int = 0
    most_active: int = 0
    closed_early: int = 0

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        produced = 0
        try:
            for produced, char in enumerate(self.script[: request.max_new_tokens]):
                if self.failure is not None and produced == self.fail_at:
                    raise self.failure
                await asyncio.sleep(self.stall_seconds if produced == self.stall_at else self.token_seconds)
                token = ALPHABET.index(char)
                yield GeneratedToken(token, token == 0, -0.1)
                if token == 0 and not request.ignore_eos:
                    break
        finally:
            self.active -= 1
            if produced + 1 < min(len(self.script), request.max_new_tokens):
                self.closed_early += 1


def client_for(engine: ScriptedEngine) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def completion(**fields: object) -> dict[str, object]:
    return {"model": "scripted", "prompt": "ab", "max_tokens": 20, **fields}


def sse_data(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
