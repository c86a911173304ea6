"""`gateway serve`: the FastAPI app over a generation engine, served by uvicorn on one event loop.

    uvicorn (event loop) ── routes ── serving classes ── Engine ── ChainSession ── nodes (hivemind P2P)
                                                            └── torch (embed, LM head, sampling) in worker threads

``create_app`` takes any ``Engine`` (the interface in ``gateway.generation``); ``serve`` builds the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import uvicorn
from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from gateway.api.auth import Authenticator, authenticate
from gateway.api.body_limit import BodyLimitMiddleware
from gateway.api.dependencies import Services
from gateway.api.error_shapes import ErrorShapeMiddleware
from gateway.api.errors import install_error_handlers
from gateway.api.metrics_http import install_metrics
from gateway.api.openapi_docs import install_openapi
from gateway.api.request_log import install_request_ids
from gateway.api.routes import (
    chat,
    completions,
    conversations,
    embeddings,
    health,
    messages,
    metrics,
    models,
    ollama,
    page,
    responses,
    responses_socket,
    tokenize,
)
from gateway.api.routes import sessions as session_routes
from gateway.api.serving.chat import ChatServing
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.completions import CompletionServing
from gateway.api.serving.conversations import ConversationServing
from gateway.api.serving.embeddings import EmbeddingServing
from gateway.api.serving.live_sessions import SessionTracker
from gateway.api.serving.models import ModelServing
from gateway.api.serving.ollama import OllamaServing
from gateway.api.serving.ollama_models import OllamaModels
from gateway.api.serving.responses import ResponsesServing
from gateway.generation import Engine
from gateway.settings import GatewaySettings, is_loopback
from gateway.state.api_keys import KeyStore
from gateway.state.conversations_store import ConversationStore
from gateway.state.quotas import QuotaLimiter
from gateway.state.redis_link import RedisLink
from gateway.state.replicas import ReplicaCensus
from gateway.state.responses_store import ResponseStore
from gateway.state.store import SessionStore
from shared.background import Periodic, stop_task
from shared.errors import DhtLost
from shared.exit import drop_cancelled_stream_handler_alarms

if TYPE_CHECKING:
    from gateway.model.engine import GenerationEngine

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_SECONDS = 5  # open streams get this long to finish on Ctrl-C before they are cut


def create_app(
    engine: Engine,
    config: ServingConfig,
    sessions: SessionTracker | None = None,
    authenticator: Authenticator | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """The API over ``engine``; without ``sessions`` they live in memory only, without ``authenticator`` it is open;
    browsers on ``allowed_origins`` (``*``: any) may call it (CORS), others get no CORS headers."""
    app = FastAPI(title="swarmgate", summary="An OpenAI-compatible API in front of a swarm of transformer blocks")
    if sessions is None:
        sessions = SessionTracker(SessionStore(RedisLink(None), "local"), None, config.model_name, resume_grace=0.0)
    app.state.authenticator = authenticator or Authenticator([], None, enabled=False)
    app.state.services = _services(engine, config, sessions)
    install_error_handlers(app)
    install_openapi(app)
    _install_middleware(app, engine, config, allowed_origins)
    _install_routes(app)
    return app


def _services(engine: Engine, config: ServingConfig, sessions: SessionTracker) -> Services:
    """One serving object per API, built once over the engine."""
    chat_serving = ChatServing(engine, config, sessions)
    embedding_serving = EmbeddingServing(engine, config, sessions)
    return Services(
        completions=CompletionServing(engine, config, sessions),
        chat=chat_serving,
        models=ModelServing(engine, config, sessions),
        sessions=sessions,
        responses=ResponsesServing(
            chat_serving,
            ResponseStore(sessions.store.link, config.responses_ttl),
            ConversationServing(ConversationStore(sessions.store.link)),
        ),
        embeddings=embedding_serving,
        ollama=OllamaServing(chat_serving),
        ollama_models=OllamaModels(embedding_serving),
    )


def _install_middleware(app: FastAPI, engine: Engine, config: ServingConfig, allowed_origins: Sequence[str]) -> None:
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(ErrorShapeMiddleware)  # Anthropic's and Ollama's bodies on their paths (401 and 413 too)
    install_metrics(app, engine)
    if allowed_origins:  # outermost, so that errors (401, 413, ...) carry the CORS headers a browser needs to read them
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Session-Id", "Retry-After"],
        )


def _install_routes(app: FastAPI) -> None:
    authenticated = [Depends(authenticate)]  # every /v1 route but the swarm view (the page and probes read it)
    apis = (completions, chat, responses, conversations, messages, embeddings, ollama, models, tokenize, session_routes)
    for module in apis:
        app.include_router(module.router, dependencies=authenticated)
    for module in (health, metrics, page):  # probes, Prometheus and the swarm page need no API key
        app.include_router(module.router)
    app.include_router(responses_socket.router)  # WebSocket mode authenticates in its handshake (no Request there)


async def serve(settings: GatewaySettings) -> None:
    """Build the engine, serve the API until SIGINT/SIGTERM, then close the engine (its DHT and sessions)."""
    from gateway.model.engine import GenerationEngine  # torch and hivemind load only when serving for real

    install_request_ids()
    drop_cancelled_stream_handler_alarms(asyncio.get_running_loop())
    engine = await GenerationEngine.create(settings)
    link = RedisLink(settings.redis_url or None)
    replica = settings.replica_id or f"{socket.gethostname()}:{os.getpid()}"
    store = SessionStore(link, replica, settings.session_ttl)
    census = ReplicaCensus(link, replica, settings.replicas)
    try:
        config = _serving_config(settings, engine)
        if link.enabled and await link.probe():
            logger.info("sessions, API keys and quotas in Redis at %s", link.url)
        store.start()
        census.start()
        quotas = QuotaLimiter(link, settings.replicas, census)
        sessions = SessionTracker(
            store, quotas, config.model_name, settings.resume_grace, settings.max_concurrent_generations
        )
        app = create_app(engine, config, sessions, _authenticator(settings, link), settings.allowed_origins)
        await _serve_http(app, settings, sessions, engine.watch_dht)
    finally:
        await census.close()
        await store.close()
        await link.close()
        await engine.close()


def _serving_config(settings: GatewaySettings, engine: GenerationEngine) -> ServingConfig:
    if engine.sampling_defaults:
        logger.info("sampling defaults from generation_config.json: %s", engine.sampling_defaults)
    return ServingConfig(
        settings.served_model_name or engine.model_name,
        settings.default_max_tokens,
        settings.max_request_bytes,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        responses_ttl=settings.responses_ttl,
        sampling_defaults=engine.sampling_defaults,
    )


async def _serve_http(
    app: FastAPI, settings: GatewaySettings, sessions: SessionTracker, watch_dht: Callable[[], Awaitable[None]]
) -> None:
    """uvicorn on the bound socket until a signal, with the coverage watch beside it; then the sessions close.

    Should the DHT child (or its p2pd) die, the gateway drains as on SIGTERM and then raises ``DhtLost``: blind to
    the swarm's changes, it would route on records that expire under it."""
    listener = _bind(settings.host, settings.port)
    host, port = listener.getsockname()[:2]
    uvicorn_config = uvicorn.Config(
        app, log_config=None, access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS
    )
    server = _Server(uvicorn_config, sessions, settings.drain_timeout)
    services: Services = app.state.services
    logger.info("serving %s on http://%s:%d/v1", services.models.config.model_name, host, port)
    # Logs swarm gaps as they appear, e.g. "no node announces model X; nodes announce Y".
    watcher = Periodic("coverage-watch", COVERAGE_CHECK_PERIOD, services.models.swarm_coverage, "coverage check failed")
    watcher.start()
    dht_watch = asyncio.create_task(_drain_when_dht_lost(watch_dht, server), name="dht-watch")
    try:
        await server.serve(sockets=[listener])
    finally:
        await stop_task(dht_watch)
        await watcher.stop()
    await sessions.close()
    if server.dht_lost is not None:
        raise server.dht_lost


async def _drain_when_dht_lost(watch_dht: Callable[[], Awaitable[None]], server: _Server) -> None:
    try:
        await watch_dht()
    except DhtLost as lost:
        logger.error("%s: this gateway can no longer follow the swarm; stopping", lost)
        server.dht_lost = lost
        server.drain_then_exit("the DHT is lost")


COVERAGE_CHECK_PERIOD = 10.0  # seconds between checks that log a gap in the swarm (each change once)


def _authenticator(settings: GatewaySettings, link: RedisLink) -> Authenticator:
    """Authentication as the operator set it (``--auth``), fixed for the process's life."""
    mode, operator_keys = settings.auth_mode(), settings.operator_keys()
    if mode == "none":
        if not is_loopback(settings.host):
            logger.warning("authentication is off (--auth none) on %s: anyone who reaches it is admin", settings.host)
        else:
            logger.info("authentication off (--auth none): every caller is admin")
        return Authenticator([], None, enabled=False)
    if not operator_keys and not link.enabled:
        logger.warning("authentication on with neither an operator key nor Redis: every request will be refused")
    logger.info(
        "authentication on: %d operator key(s)%s",
        len(operator_keys),
        ", and keys in Redis" if link.enabled else "; no Redis, so no other keys",
    )
    return Authenticator(operator_keys, KeyStore(link) if link.enabled else None, enabled=True)


def _bind(host: str, port: int) -> socket.socket:
    """Bind ourselves so that port 0 works and the real port can be logged (uvicorn logs the configured one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.set_inheritable(True)
    return listener


class _Server(uvicorn.Server):
    """uvicorn with a drain: the first SIGTERM/SIGINT stops new generations (503 ``draining``, /ready 503) and lets
    running ones finish for up to ``drain_timeout`` seconds before the server stops; a second signal stops it now."""

    def __init__(self, config: uvicorn.Config, sessions: SessionTracker, drain_timeout: float) -> None:
        super().__init__(config)
        self.sessions = sessions
        self.drain_timeout = drain_timeout
        self._drain: asyncio.Task[None] | None = None
        self.dht_lost: DhtLost | None = None  # why the server stopped by itself, if it did

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would kill the process before the
        # engine closes its DHT and node sessions; here a signal only asks the server to drain, then stop.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain is not None:
            logger.warning("second %s: stopping without waiting for running generations", signal.Signals(sig).name)
            self.handle_exit(sig, None)
            return
        self.drain_then_exit(signal.Signals(sig).name)

    def drain_then_exit(self, reason: str) -> None:
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit(reason))

    async def _drain_then_exit(self, reason: str) -> None:
        running = len(self.sessions.live)
        logger.info("%s: draining (%d generations running, up to %.0fs)", reason, running, self.drain_timeout)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_timeout):
                await self.sessions.drain()
        if self.sessions.live:
            # Before the server stops: a stream it cut would end with neither an error nor [DONE].
            logger.warning("drain time ran out: stopping %d running generations", len(self.sessions.live))
            await self.sessions.stop_all(
                f"the gateway is shutting down (its drain time of {self.drain_timeout:g}s ran out)"
            )
        self.should_exit = True
