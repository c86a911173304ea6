"""A scripted engine over printable ASCII (token i is chr(i), 0 is EOS) that writes one script for every request and
remembers each request: the Responses tests read the prompt it was sent back as text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from tests.helpers.scripted_engine import CharCodec, WholeSwarm


class AsciiCodec(CharCodec):
    """Token i is chr(i) for printable ASCII; token 0 is EOS. A chat is its messages' contents."""

    vocab_size = 128

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text if 32 <= ord(c) < 127 or c == "\n"]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids if t)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def render_chat(self, messages: list[dict[str, Any]], *args: Any) -> str:
        return "".join(message.get("content") or "" for message in messages)


@dataclass
class AsciiEngine(WholeSwarm):
    """Writes ``script`` (at most the request's budget of it) then EOS; remembers each request."""

    script: str
    requests: list[GenerationRequest] = field(default_factory=list)
    model_name: str = "scripted"
    context_length: int = 4096
    codec: AsciiCodec = field(default_factory=AsciiCodec)
    gate: asyncio.Event | None = None  # set: writes its first token, then waits for it before the rest
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        self.requests.append(request)
        self.started.set()
        for count, char in enumerate(self.script[: request.max_new_tokens]):
            await asyncio.sleep(0)
            if self.gate is not None and count == 1:
                await self.gate.wait()
            yield GeneratedToken(ord(char), False, -0.1)
        if len(self.script) < request.max_new_tokens:  # cut by the budget otherwise: the engine's caller ends it
            yield GeneratedToken(0, True)
