"""bench/request_variants.py and bench.wan_tokens' sustained run: the requests a sustained window sends are all
different (a repeated greedy request would measure the suffix store replaying its last answer), and the run counts
what its clients received in the window and compares only the streams it finished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from bench import request_variants, wan_tokens


def test_every_workload_has_its_pool_of_distinct_requests() -> None:
    assert set(request_variants.VARIANTS) == set(wan_tokens.WORKLOADS)
    for name, vary in request_variants.VARIANTS.items():
        chats = [repr(vary(index)) for index in range(request_variants.DISTINCT[name])]
        assert len(set(chats)) == len(chats) >= 12, name


def test_structured_requests_state_every_field_the_schema_asks_for() -> None:
    for index in range(request_variants.DISTINCT["structured"]):
        text = request_variants.structured(index)[0]["content"]
        assert "@example.com" in text and "+" in text and "VIP" in text and " is " in text


class _Tokens:
    """An engine that streams ``prompt_ids[0]``, counting up, a token every 10 ms, up to ``max_new_tokens``; it
    counts the tokens it has handed out."""

    def __init__(self) -> None:
        self.handed_out = 0

    def generate(self, request: Any) -> AsyncIterator[int]:
        async def stream() -> AsyncIterator[int]:
            for step in range(request.max_new_tokens):
                await asyncio.sleep(0.01)
                self.handed_out += 1
                yield request.prompt_ids[0] + step

        return stream()


def test_sustained_run_counts_the_window_and_compares_finished_streams_only() -> None:
    variants = {name: [[100 * index] for index in range(4)] for name in wan_tokens.WORKLOADS}
    engine = _Tokens()
    run = asyncio.run(wan_tokens._sustained(engine, variants, window=0.37, new_tokens=5))  # type: ignore[arg-type]
    # each client finishes a 5-token request every ~50 ms: 7 or so in 0.37 s, and is cut off mid-way through the
    # next (a window off the requests' 50 ms grid)
    assert 8 * 4 <= len(run.finished) <= 8 * 8
    assert run.begun == len(run.finished) + 8
    # every token handed out in the window counts once (the cut-off streams' too), and none after it: the clients
    # stop taking tokens when the window ends
    assert run.emitted == engine.handed_out >= 5 * len(run.finished)
    assert run.speed == run.emitted / 0.37
    for label, tokens in run.finished.items():
        name, index = label.rsplit(" ", 1)
        assert tokens == [100 * (int(index) % 4) + step for step in range(5)], label
    # the two clients of a workload take turns through its pool: client 0 the even variants, client 1 the odd
    assert {"novel 0", "novel 1", "novel 2", "novel 3"} <= set(run.finished)
