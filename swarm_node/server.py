"""A node's life: join the DHT, load its span, serve, announce; on stop, announce OFFLINE and leave.

Processes, threads and loops of one node:

    main process
    ├── asyncio loop (main thread): P2P handlers, the announcer; never runs torch
    ├── "span-compute" thread: every torch call on the span (SpanBackend)
    └── hivemind DHT child process, with its p2pd daemon (the node's peer identity)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import torch
from hivemind import DHT
from hivemind.p2p import P2P

import shared
from shared.dht_records import ModelRecord, NodeState, ServerRecord, announce
from shared.families import family_of
from shared.model_source import ModelSource, load_config, resolve_model
from shared.protocol import PROTOCOL_VERSION
from shared.span import build_span
from shared.weights import open_weights
from swarm_node.backend import SpanBackend
from swarm_node.cache_pool import CachePool
from swarm_node.handlers import NodeStatus, SpanHandlers
from swarm_node.settings import ServeSettings

logger = logging.getLogger(__name__)

OFFLINE_RECORD_TTL = 30.0  # how long an OFFLINE record lingers so readers see the node left rather than vanished


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


class SpanServer:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.source: ModelSource = resolve_model(settings.model, settings.revision)
        self.config = load_config(self.source)
        span = settings.span()
        if span is None:
            raise ValueError("give --blocks START:END (span choice with --num-blocks arrives with the router)")
        self.start, self.end = span
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.dht: DHT | None = None
        self.p2p: P2P | None = None
        self.handlers: SpanHandlers | None = None
        self.throughput = 0.0

    @property
    def model_record(self) -> ModelRecord:
        return ModelRecord(
            name=self.source.name,
            num_blocks=self.config.num_hidden_layers,
            family=family_of(self.config).name,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    async def run(self, stop: asyncio.Event) -> None:
        # The DHT forks its own process: start it before torch spins up thread pools, which a fork must not copy.
        self.dht = DHT(start=True, **self.settings.dht_kwargs())
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        logger.info("loading blocks %d:%d of %s", self.start, self.end, self.source.name)
        span = await asyncio.to_thread(
            build_span,
            self.config,
            open_weights(self.source, self.config),
            self.start,
            self.end,
            self.dtype,
            self.device,
        )
        backend = SpanBackend(span)
        max_length = self.settings.max_session_length or int(self.config.max_position_embeddings)
        status = NodeStatus(self.source.name, shared.__version__, max_length)
        self.handlers = SpanHandlers(backend, CachePool(self.settings.cache_tokens), status)
        try:
            self.p2p = await self.dht.replicate_p2p()
            await self.handlers.register(self.p2p)
            self.throughput = await self._measure_throughput(backend)
            status.state = NodeState.ONLINE
            logger.info("serving blocks %d:%d as %s", self.start, self.end, self.dht.peer_id)
            await self._announce_until(stop)
        finally:
            status.state = NodeState.OFFLINE
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._announce(OFFLINE_RECORD_TTL), timeout=5)
            backend.shutdown()
            self.dht.shutdown()
            logger.info("node stopped")

    async def _announce_until(self, stop: asyncio.Event) -> None:
        period = self.settings.announce_period
        while not stop.is_set():
            try:
                await self._announce(expiration=2 * period + 5)
            except Exception:
                logger.warning("DHT announcement failed; retrying in %.0fs", period, exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=period)

    async def _announce(self, expiration: float) -> None:
        assert self.dht is not None and self.handlers is not None  # set in run() before any announcement
        record = ServerRecord(
            peer_id=self.dht.peer_id.to_base58(),
            start=self.start,
            end=self.end,
            state=self.handlers.status.state,
            throughput=self.throughput,
            cache_tokens_left=self.handlers.pool.tokens_left,
            version=shared.__version__,
            protocol=PROTOCOL_VERSION,
        )
        await announce(self.dht, self.model_record, record, expiration)

    async def _measure_throughput(self, backend: SpanBackend) -> float:
        """Decode tokens/s through the whole span for one session (a first estimate; the router refines it)."""
        kv = await backend.new_session_kv(range(self.start, self.end), 16)
        hidden = torch.zeros(1, 1, backend.span.hidden_size)
        await backend.step(kv, hidden, 0)  # warm-up
        steps = 8
        began = time.perf_counter()
        for position in range(1, steps + 1):
            await backend.step(kv, hidden, position)
        return steps / (time.perf_counter() - began)


def serve(settings: ServeSettings) -> None:
    asyncio.run(_serve(settings))


async def _serve(settings: ServeSettings) -> None:
    server = SpanServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.run(stop)
