"""A node's life: join the DHT, choose and load a span, serve, announce; drain and announce OFFLINE on stop.

Processes, threads and loops of one node:

    main process
    ├── asyncio loop (main thread): P2P handlers, the announcer, the balancer; never runs torch
    ├── "span-compute" thread: every torch call on the span (SpanBackend)
    ├── with --metrics-port: prometheus-client's HTTP exporter thread (reads gauges, never runs torch)
    └── hivemind DHT child process, with its p2pd daemon (the node's peer identity)

States announced: JOINING (span chosen, loading) → ONLINE → DRAINING (no new sessions; before a move or a stop)
→ ONLINE again after a move, or OFFLINE when the node leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.p2p import P2P

import shared
from shared.background import Periodic
from shared.dht_process import replicate_p2p, start_dht, stop_dht, until_dht_lost
from shared.dht_records import ModelRecord, NodeState, ServerRecord, announce, fetch_servers
from shared.errors import DhtLost, SwarmError
from shared.exit import drop_cancelled_stream_handler_alarms
from shared.families import context_length, family_of
from shared.membership import CallAuth, ReplayGuard
from shared.model_source import ModelSource, load_config, resolve_model
from shared.reachability import DialBackService, Reachability, open_paths
from shared.rpc_client import fetch_info
from shared.weights import WeightReader, open_weights
from shared.wire import PROTOCOL_VERSION
from swarm_node.adapters import load_span_adapters
from swarm_node.backend import SpanBackend
from swarm_node.block_count import auto_num_blocks
from swarm_node.cache_pool import CachePool
from swarm_node.capacity import default_cache_tokens
from swarm_node.faults import computed_quant, receipt_keys, wrong_weights
from swarm_node.handlers import NodeStatus, SpanHandlers
from swarm_node.layer_api import cache_keyword
from swarm_node.metrics import NodeGauges, NodeMetrics
from swarm_node.next_hops import next_hops
from swarm_node.quantize import block_transform, resolve_quant
from swarm_node.reachability_probe import Reach, settle_reachability
from swarm_node.self_test import SelfTestFailed, run_self_test
from swarm_node.settings import NodeSettings
from swarm_node.span import build_span
from swarm_node.span_choice import GAP_CHECK_PERIOD, block_throughputs, choose_new_start, choose_start, fills_a_gap
from swarm_node.throughput import BlockSpeed, block_speed, load_cached, speed_key

logger = logging.getLogger(__name__)

OFFLINE_RECORD_TTL = 30.0  # how long an OFFLINE record lingers so readers see the node left rather than vanished
PROBE_TIMEOUT = 2.0
# A DHT store on the way out (DRAINING, then OFFLINE) waits for peers that may be gone or for a stuck p2pd: each is
# bounded so that a node exits within its drain timeout + 10 s of SIGTERM, whoever else is gone (two of these and
# the DHT's stop grace, shared.dht_process, fit in that).
STOP_ANNOUNCE_TIMEOUT = 2.0


@dataclass(frozen=True)
class _Move:
    """A move being made: the new span, and the records it was chosen from."""

    start: int
    num_blocks: int
    servers: list[ServerRecord]


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype: torch.dtype = getattr(torch, setting)
    return dtype


class SpanServer:
    def __init__(self, settings: NodeSettings) -> None:
        """Raises ``ModelLoadError`` or ``ValueError`` (bad span, too little memory) before anything starts."""
        self.settings = settings
        self.source: ModelSource = resolve_model(settings.model, settings.revision)
        self.config = load_config(self.source, Path(settings.config_cache).expanduser())
        self.num_model_blocks = int(self.config.num_hidden_layers)
        self.device = resolve_device(settings.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA device torch can use (try --device cpu)")
        self.dtype = resolve_dtype(settings.dtype, self.device)
        family = family_of(self.config)
        cache_keyword(family.decoder_layer, family.layer_call)  # refuse a transformers whose layers we cannot drive
        self.quant = resolve_quant(settings.quant, self.device)
        span = settings.span()
        self.num_blocks = self._checked_num_blocks(span)
        threads = settings.num_threads or torch.get_num_threads()  # what _join sets torch to
        self.speed_key = speed_key(self.source.name, self.device, self.dtype, self.quant, threads)
        self.cache_path = Path(settings.throughput_cache).expanduser()
        self.speed: BlockSpeed | None = load_cached(self.cache_path, self.speed_key)
        self.status = self._new_status()
        cache_tokens = settings.cache_tokens or default_cache_tokens(
            self.config, self.num_blocks, self.device, self.dtype, self.quant
        )
        self.pool = CachePool(cache_tokens)
        self.start, self.end = span or (0, 0)
        self.moving_to: int | None = None  # the new span's start while a move drains and loads (announced)
        self.announced: NodeState | None = None  # the state of the last announcement that reached the DHT
        self.announced_until = 0.0  # time.monotonic() when that announcement's records expire
        self.dht_answers = True  # False once a bounded announcement on the way out timed out or failed
        self.dht_lost: DhtLost | None = None  # why, once our DHT child or its p2pd died under us
        self.next_rtts: dict[str, float] = {}
        self.reachability = Reachability.DIRECT
        self.relay_addrs: list[str] = []
        self.auth = CallAuth(None, "")
        self.dht: DHT | None = None
        self._reader: WeightReader | None = None  # opened once: the load, the self-test and every move read it
        self.handlers: SpanHandlers | None = None
        self.metrics = NodeMetrics(self._gauges()) if settings.metrics_port is not None else None

    def _checked_num_blocks(self, span: tuple[int, int] | None) -> int:
        """The blocks this node hosts: --blocks, --num-blocks, or (neither) as many as its memory holds."""
        if span is not None and span[1] > self.num_model_blocks:
            raise ValueError(f"--blocks {self.settings.blocks} lies beyond the model's {self.num_model_blocks} blocks")
        num_blocks = span[1] - span[0] if span else self.settings.num_blocks or self._auto_num_blocks()
        if num_blocks > self.num_model_blocks:
            raise ValueError(f"--num-blocks {num_blocks} exceeds the model's {self.num_model_blocks} blocks")
        return num_blocks

    def _new_status(self) -> NodeStatus:
        settings = self.settings
        return NodeStatus(
            self.source.name,
            shared.__version__,
            self._max_session_length(),
            added_latency=settings.added_latency,
            faulty_outputs=settings.faulty_outputs,
            session_idle_timeout=settings.session_idle_timeout,
            share_limits=settings.share_limits(),
        )

    def _auto_num_blocks(self) -> int:
        count = auto_num_blocks(self.config, self.device, self.dtype, self.quant, self.settings.cache_tokens)
        logger.info(
            "neither --blocks nor --num-blocks: %d of %d blocks fit in the memory free on %s",
            count,
            self.num_model_blocks,
            self.device,
        )
        return count

    def readiness(self) -> tuple[bool, str]:
        """Ready while the span is loaded and announced ONLINE in records that have not expired (the node's
        readiness probe): a node whose DHT stopped taking its announcements is found by nobody."""
        if self.status.state is NodeState.ONLINE and self.announced is NodeState.ONLINE:
            late = time.monotonic() - self.announced_until
            if late < 0:
                return True, f"online: blocks {self.start}:{self.end}"
            return False, f"online but unannounced: the DHT took no announcement; its records expired {late:.0f}s ago"
        return False, f"{self.status.state.value}: blocks {self.start}:{self.end} not served yet"

    def _gauges(self) -> NodeGauges:
        return NodeGauges(
            cache_tokens_total=lambda: self.pool.total_tokens,
            cache_tokens_left=lambda: self.pool.tokens_left,
            sessions_open=lambda: self.pool.sessions,
            queue_depth=lambda: self.handlers.backend.queue_depth if self.handlers else 0,
            state=lambda: self.status.state,
            span=lambda: (self.start, self.end),
        )

    def _max_session_length(self) -> int:
        return self.settings.max_session_length or context_length(self.config)

    @property
    def model_record(self) -> ModelRecord:
        return ModelRecord(
            name=self.source.name,
            num_blocks=self.num_model_blocks,
            family=family_of(self.config).name,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    async def run(self, stop: asyncio.Event) -> None:
        # The DHT forks its own process (twice when the node turns relay client): start it, and settle how peers
        # reach us, before torch spins up thread pools and before any thread starts, which a fork must not copy.
        dht_kwargs = self.settings.dht_kwargs()
        self.dht = start_dht(**dht_kwargs)
        self._backend: SpanBackend | None = None
        self._exporter: Any = None
        try:
            try:
                # The first DHT is watched while the node joins (a relay client's, replacing it, is watched from
                # its start in ``settle_reachability``); the one that stays, from here on.
                reach, p2p = await until_dht_lost(self.dht, self._join(self.dht, dht_kwargs))
                dht = reach.dht
                reach = await until_dht_lost(dht, self._start_serving(p2p, reach))
            except DhtLost as lost:
                logger.error("%s while the node started; stopping", lost)
                raise
            self.reachability, self.relay_addrs = reach.verdict, reach.relay_addrs
            self.status.state = NodeState.ONLINE
            logger.info("serving blocks %d:%d as %s", self.start, self.end, self.status.peer_id)
            jobs = self._jobs(p2p, reach)
            for job in jobs:
                job.start()
            try:
                await until_dht_lost(dht, stop.wait())
            except DhtLost as lost:
                # Unannounced, a node serves only the sessions it has: let them finish, then exit for a restart.
                logger.error("%s: this node can no longer be found; stopping", lost)
                self.dht_lost = lost
            logger.info("stopping: draining open sessions")
            self.moving_to = None  # leaving, not moving
            await self._drain()
            await asyncio.gather(*(job.stop() for job in jobs))
            if self.dht_lost is not None:
                raise self.dht_lost
        finally:
            await self._shut_down()

    async def _join(self, dht: DHT, dht_kwargs: dict[str, Any]) -> tuple[Reach, P2P]:
        """How peers reach us (settling on in the background when a relay is involved), our P2P and identity."""
        reach = await settle_reachability(dht, self.settings, dht_kwargs)
        self.dht, self.reachability = reach.dht, reach.verdict
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        if self.metrics is not None and self.settings.metrics_port is not None:
            self._exporter = self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port, self.readiness)
        p2p = await replicate_p2p(self.dht)
        if self.reachability is Reachability.DIRECT:
            await DialBackService(p2p).register()  # we can tell joining nodes whether they can be dialled
        self.status.peer_id = self.dht.peer_id.to_base58()
        self.status.step_key, self.status.signer = receipt_keys(self.settings.faulty_outputs, self.status.peer_id)
        secret = self.settings.secret()
        if secret is not None:
            self.status.guard = ReplayGuard(secret)
        self.auth = CallAuth(secret, self.status.peer_id)
        return reach, p2p

    async def _start_serving(self, p2p: P2P, reach: Reach) -> Reach:
        """Choose the span, load and self-test it, announce it (JOINING), answer RPCs, measure our speed; then
        wait until how peers reach us is settled."""
        if self.settings.span() is None:
            self.start = await self._choose_start(self.num_blocks)
            self.end = self.start + self.num_blocks
        backend = self._backend = await self._load(self.start, self.end)
        await self._self_test(backend)  # before the first record: a span that fails it is never announced
        await self._announce()  # JOINING: others joining now see this span as taken
        self.handlers = SpanHandlers(backend, self.pool, self.status)
        await self.handlers.register(p2p)
        self.speed = await block_speed(backend, self.cache_path, self.speed_key)
        return await reach.settled()

    def _jobs(self, p2p: P2P, reach: Reach) -> list[Periodic]:
        refresh = functools.partial(self._refresh, p2p)
        jobs = [Periodic("announce", self.settings.announce_period, refresh, "DHT announcement failed", True)]
        jobs += reach.renewals  # already running: start() leaves them be, stop() ends them with the rest
        if self.settings.span() is None:
            jobs.append(Periodic("rebalance", self.settings.balance_period, self._maybe_move, "rebalancing failed"))
        return jobs

    async def _shut_down(self) -> None:
        self.status.state = NodeState.OFFLINE
        # A node that never announced leaves no record behind; a DHT that did not take the DRAINING record will
        # not take this one either.
        if self.announced is not None and self.dht_answers:
            await self._announce_leaving(OFFLINE_RECORD_TTL)
        if self.handlers is not None:
            self.handlers.shutdown()
        elif self._backend is not None:
            self._backend.shutdown()
        stop_dht(self.dht)
        if self._exporter is not None:
            self._exporter.shutdown()
        logger.info("node stopped")

    async def _load(self, start: int, end: int) -> SpanBackend:
        logger.info("loading blocks %d:%d of %s", start, end, self.source.name)
        reader = await self._weights()
        fault = self.settings.faulty_outputs
        quant = computed_quant(fault, self.quant)  # what the span computes (self.quant is what is announced)
        transform = await asyncio.to_thread(
            block_transform, quant, self.dtype, self.device, self.settings.cpu_batched_copy
        )
        if fault == "wrong-weights":
            transform = wrong_weights(transform)
        prefixes = [family_of(self.config).layout.block_prefix(block) for block in range(start, end)]
        adapters = await asyncio.to_thread(load_span_adapters, self.settings.adapter_folders(), prefixes)
        span = await asyncio.to_thread(
            build_span, self.config, reader, start, end, self.dtype, self.device, transform, adapters
        )
        span.forget_kv = fault == "stale-cache"
        return SpanBackend(span, self.settings.batch_policy(), self.metrics, fault)

    async def _weights(self) -> WeightReader:
        """The checkpoint's reader, opened on first use (a GGUF file's header, a folder's or hub repo's index)."""
        if self._reader is None:
            self._reader = await asyncio.to_thread(open_weights, self.source, self.config)
        return self._reader

    async def _self_test(self, backend: SpanBackend) -> None:
        """The known-answer test of the loaded span (swarm_node.self_test); raises ``SelfTestFailed``."""
        if self.settings.skip_self_test:
            logger.warning("--skip-self-test: serving a span whose known-answer test did not run (for tests only)")
            return
        reader = await self._weights()
        await backend.call(lambda: run_self_test(backend.span, self.config, reader, self.quant))

    async def _choose_start(self, num_blocks: int) -> int:
        assert self.dht is not None  # started in run()
        servers = await fetch_servers(self.dht, self.source.name, self.num_model_blocks)
        start = choose_start(block_throughputs(servers.values(), self.num_model_blocks), num_blocks)
        logger.info("chose blocks %d:%d where the swarm is weakest", start, start + num_blocks)
        return start

    async def _stay(self) -> None:
        """A move given up: online on the old span again (its backend was never shut down), no longer moving."""
        self.status.state, self.moving_to = NodeState.ONLINE, None
        await self._announce()

    async def _drain(self, move: _Move | None = None) -> None:
        """Refuse new sessions (announced) and let open ones finish, up to the drain timeout; for a ``move``, only
        while its new span holds no block that nobody serves (``fills_a_gap``: no session of the swarm can go on
        then, so waiting would only delay the fix)."""
        self.status.state = NodeState.DRAINING
        await self._announce_leaving()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout):
                if move is None:
                    await self.pool.wait_until_empty()
                else:
                    await self._wait_until_empty_or_gap(move)
        if self.pool.sessions:
            logger.warning("drained: leaving %d open sessions behind", self.pool.sessions)

    async def _wait_until_empty_or_gap(self, move: _Move) -> None:
        """Until the pool is empty or the new span holds a block nobody serves: checked first on the records the
        move was chosen from, then on the DHT every ``GAP_CHECK_PERIOD``."""
        assert self.dht is not None  # started in run()
        empty = asyncio.ensure_future(self.pool.wait_until_empty())
        servers: Iterable[ServerRecord] | None = move.servers
        try:
            while not empty.done():
                if servers is None:
                    try:
                        servers = (await fetch_servers(self.dht, self.source.name, self.num_model_blocks)).values()
                    except Exception as error:  # a failed read leaves the drain to its timeout, as any drain
                        logger.debug("reading the swarm while draining failed: %r", error)
                if servers is not None and fills_a_gap(servers, move.start, move.num_blocks, self.num_model_blocks):
                    logger.info("blocks %d:%d hold one nobody serves: not waiting for open sessions", move.start,
                                move.start + move.num_blocks)  # fmt: skip
                    return
                servers = None
                await asyncio.wait({empty}, timeout=GAP_CHECK_PERIOD)
        finally:
            empty.cancel()

    async def _announce_leaving(self, expiration: float | None = None) -> None:
        """Announce on the way out, bounded (``dht_answers`` says whether it went through)."""
        if self.dht_lost is not None:
            self.dht_answers = False
            return
        try:
            async with asyncio.timeout(STOP_ANNOUNCE_TIMEOUT):
                await self._announce(expiration)
        except Exception as exc:  # a timeout, or whatever the DHT raised: either way we are leaving
            logger.warning("the DHT did not take our %s record: %r", self.status.state.value, exc)
            self.dht_answers = False
        else:
            self.dht_answers = True

    async def _refresh(self, p2p: P2P) -> None:
        """The periodic announcement: round trips to the next hops measured, then our record."""
        await self._probe_next_hops(p2p)
        await self._announce()

    async def _announce(self, expiration: float | None = None) -> None:
        assert self.dht is not None  # started in run()
        decode, prefill = self.speed.throughputs(self.end - self.start) if self.speed else (0.0, 0.0)
        record = ServerRecord(
            peer_id=self.dht.peer_id.to_base58(),
            start=self.start,
            end=self.end,
            state=self.status.state,
            throughput=decode,
            prefill_throughput=prefill,
            cache_tokens_left=self.pool.tokens_left,
            cache_tokens_total=self.pool.total_tokens,
            queue_depth=self.handlers.backend.queue_depth if self.handlers else 0,
            next_rtts=self.next_rtts,
            reachability=self.reachability,
            relay_addrs=self.relay_addrs,
            adapters=sorted(self.settings.adapter_folders()),
            precision=f"{self.quant}/{str(self.dtype).removeprefix('torch.')}/{self.device.type}",
            moving_to=self.moving_to,  # None unless a move drains or loads (_maybe_move, _stay)
            version=shared.__version__,
            protocol=PROTOCOL_VERSION,
        )
        ttl = expiration if expiration is not None else self._record_ttl()
        async with asyncio.timeout(ttl):  # an answer later than the record lives is none (a DHT hung, not failed)
            await announce(self.dht, self.model_record, record, ttl)
        self.announced, self.announced_until = record.state, time.monotonic() + ttl

    def _record_ttl(self) -> float:
        return 2 * self.settings.announce_period + 5

    async def _probe_next_hops(self, p2p: P2P) -> None:
        """Measure round trips to the nodes a session is likely to go to after us (they serve our end block)."""
        assert self.dht is not None  # started in run()
        if self.end >= self.num_model_blocks:
            return
        async with asyncio.timeout(self._record_ttl()):  # bounded as the announcement that follows
            nexts = await next_hops(self.dht, self.source.name, self.end, self.dht.peer_id.to_base58())
        await open_paths(p2p, {s.peer_id: s.relay_addrs for s in nexts})
        rtts: dict[str, float] = {}
        for peer in (s.peer_id for s in nexts):
            with contextlib.suppress(SwarmError):
                rtts[peer] = (await fetch_info(p2p, peer, PROBE_TIMEOUT, self.auth))[1]
        self.next_rtts = rtts

    async def _maybe_move(self) -> None:
        assert self.dht is not None and self.handlers is not None  # set in run()
        servers = await fetch_servers(self.dht, self.source.name, self.num_model_blocks)
        me = servers.get(self.dht.peer_id.to_base58())
        if me is None or me.state is not NodeState.ONLINE:
            return
        new_start = choose_new_start(servers.values(), me, self.num_model_blocks, self.settings.balance_quality)
        if new_start is None:
            return
        num_blocks = self.end - self.start
        logger.info("moving from %d:%d to %d:%d", self.start, self.end, new_start, new_start + num_blocks)
        self.moving_to = new_start  # others choosing spans count us there from the first DRAINING record on
        await self._drain(_Move(new_start, num_blocks, list(servers.values())))
        try:
            backend = await self._load(new_start, new_start + num_blocks)
        except Exception:  # out of memory, a shard gone: whatever it was, the old span is still loaded and served
            logger.exception("not moving: loading blocks %d:%d failed", new_start, new_start + num_blocks)
            await self._stay()
            return
        try:
            await self._self_test(backend)
        except SelfTestFailed as error:
            logger.error(
                "not moving: the self-test of blocks %d:%d failed: %s", new_start, new_start + num_blocks, error
            )
            backend.shutdown()
            await self._stay()
            return
        old = self.handlers.backend
        self.start, self.end = new_start, new_start + num_blocks
        self.handlers.use_backend(backend)
        old.shutdown()
        self.status.state, self.moving_to = NodeState.ONLINE, None
        await self._announce()


def serve(server: SpanServer) -> None:
    asyncio.run(_serve(server))


async def _serve(server: SpanServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    drop_cancelled_stream_handler_alarms(loop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.run(stop)
