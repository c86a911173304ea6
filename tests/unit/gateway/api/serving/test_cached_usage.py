"""How reused prompt tokens reach the client: the engine's ``PromptCached`` through a choice to OpenAI's usage."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from gateway.api.protocol.common import Usage
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec, run_choice
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest, PromptCached
from gateway.text.assembler import Piece
from tests.helpers.scripted_engine import CharCodec, WholeSwarm, content_of

ALPHABET = "<abc"  # token 0 is EOS


class Codec(CharCodec):
    """The scripted codec over a four-token alphabet; a chat is its contents."""

    vocab_size = len(ALPHABET)
    chat_message = staticmethod(content_of)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(ALPHABET[t] for t in token_ids if t)

    def token_bytes(self, token_id: int) -> bytes:
        return ALPHABET[token_id].encode()


@dataclass
class ReusingEngine(WholeSwarm):
    """Says the nodes held ``cached`` prompt tokens, then generates ``tokens``; records how its stream ended."""

    tokens: list[int]
    cached: int = 0
    ended: str = ""
    model_name: str = "reusing"
    context_length: int = 64
    codec: Codec = field(default_factory=Codec)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        try:
            if self.cached:
                yield PromptCached(self.cached)
            for token in self.tokens:
                yield GeneratedToken(token, token == 0)
                if token == 0 and not request.ignore_eos:
                    break
            self.ended = "by itself"
        except GeneratorExit:
            self.ended = "closed"
            raise


async def events(engine: ReusingEngine, stops: tuple[str, ...] = ()) -> list[ChoiceEvent]:
    request = GenerationRequest([1, 2], 10, reuse_scope="key")
    return [event async for event in run_choice(engine, ChoiceSpec(0, request, stops))]


async def test_the_cached_count_rides_on_the_choices_last_event() -> None:
    engine = ReusingEngine([1, 2, 3, 0], cached=7)
    got = await events(engine)
    assert [e.cached_tokens for e in got] == [0] * (len(got) - 1) + [7]
    pieces = [e.payload for e in got if isinstance(e.payload, Piece)]
    assert "".join(p.text for p in pieces) == "abc" and pieces[-1].finish_reason == "stop" and got[-1].generated == 4


async def test_an_eos_lets_the_engine_end_by_itself_and_a_stop_string_closes_it() -> None:
    by_eos = ReusingEngine([1, 2, 0])
    await events(by_eos)
    assert by_eos.ended == "by itself"  # a natural end: the engine may keep the chat's node caches
    by_stop = ReusingEngine([1, 2, 3, 1, 0])
    got = await events(by_stop, stops=("b",))
    assert by_stop.ended == "closed" and isinstance(got[-1].payload, Piece) and got[-1].payload.finish_reason == "stop"


def test_usage_reports_cached_tokens_only_where_given() -> None:
    chat = json.loads(Usage.of(40, 5, 33).model_dump_json())
    assert chat == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                    "prompt_tokens_details": {"cached_tokens": 33}}  # fmt: skip
    assert Usage.of(40, 5, 0).model_dump()["prompt_tokens_details"] == {"cached_tokens": 0}
    assert json.loads(Usage.of(2, 5).model_dump_json()) == {
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "total_tokens": 7,
    }
