"""The HTTP edge alone: per-token time of one stream through the real app, with nothing else in the way.

The app (``create_app``, sessions in a private redis-server) serves an engine that yields its tokens at once, under
uvicorn on 127.0.0.1; ``bench/http_latency.py`` streams from it. What it measures is what the gateway adds per token
(serving, SSE, the session's event log) — no model, no nodes. Run from the repository root:

    PYTHONPATH=$PWD .venv/bin/python -m bench.http_edge [--max-tokens 1000] [--runs 7]

With ``PYTHONPATH`` at another checkout, it measures that checkout's edge (a before/after comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path

import uvicorn

from gateway.api.serving.common import ServingConfig
from gateway.api.serving.live_sessions import SessionTracker
from gateway.app import create_app
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from gateway.state.redis_link import RedisLink
from gateway.state.store import SessionStore
from tests.helpers.redis_server import RedisServer
from tests.helpers.scripted_engine import ALPHABET, ScriptedEngine

LATENCY = Path(__file__).with_name("http_latency.py")


class InstantEngine(ScriptedEngine):
    """Its script, repeated, as fast as the event loop takes it (one yield to the loop per token)."""

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        for char in (self.script * (request.max_new_tokens // len(self.script) + 1))[: request.max_new_tokens]:
            await asyncio.sleep(0)
            yield GeneratedToken(ALPHABET.index(char), False, -0.1)


async def measure(max_tokens: int, runs: int) -> int:
    redis = RedisServer(Path(tempfile.mkdtemp())).start()
    link = RedisLink(redis.url)
    engine = InstantEngine(script="the quick brown fox jumps over the lazy dog ", context_length=max_tokens + 16)
    tracker = SessionTracker(SessionStore(link, "bench"), None, engine.model_name, 0.0)
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, ServingConfig(engine.model_name), tracker), log_config=None)
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        args = ["--url", url, "--prompt", "ab", "--max-tokens", str(max_tokens), "--runs", str(runs)]
        client = await asyncio.create_subprocess_exec(sys.executable, str(LATENCY), *args)
        return await client.wait()
    finally:
        server.should_exit = True
        await serving
        await link.close()
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=1000, help="tokens per run (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=7, help="measured runs (default: %(default)s)")
    options = parser.parse_args()
    sys.exit(asyncio.run(measure(options.max_tokens, options.runs)))


if __name__ == "__main__":
    main()
