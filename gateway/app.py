"""`gateway serve`: the FastAPI app over a generation engine, served by uvicorn on one event loop.

    uvicorn (event loop) ── routes ── serving classes ── Engine ── ChainSession ── nodes (hivemind P2P)
                                                            └── torch (embed, LM head, sampling) in worker threads

``create_app`` takes any ``Engine`` (the interface in ``gateway.generation``); ``serve`` builds the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from gateway.api.dependencies import Services
from gateway.api.errors import install_error_handlers
from gateway.api.request_log import install_request_ids
from gateway.api.routes import chat, completions, health, models, tokenize
from gateway.api.serving_chat import ChatServing
from gateway.api.serving_common import ServingConfig
from gateway.api.serving_completions import CompletionServing
from gateway.api.serving_models import ModelServing
from gateway.generation import Engine
from gateway.settings import ServeSettings

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_SECONDS = 5  # open streams get this long to finish on Ctrl-C before they are cut


def create_app(engine: Engine, config: ServingConfig) -> FastAPI:
    app = FastAPI(title="swarmgate", summary="An OpenAI-compatible API in front of a swarm of transformer blocks")
    app.state.services = Services(
        completions=CompletionServing(engine, config),
        chat=ChatServing(engine, config),
        models=ModelServing(engine, config),
    )
    install_error_handlers(app)
    for module in (completions, chat, models, tokenize, health):
        app.include_router(module.router)
    return app


async def serve(settings: ServeSettings) -> None:
    """Build the engine, serve the API until SIGINT/SIGTERM, then close the engine (its DHT and sessions)."""
    from gateway.engine import GenerationEngine  # torch and hivemind load only when serving for real

    install_request_ids()
    engine = await GenerationEngine.create(settings)
    try:
        config = ServingConfig(settings.served_model_name or engine.model_name, settings.default_max_tokens)
        app = create_app(engine, config)
        listener = _bind(settings.host, settings.port)
        host, port = listener.getsockname()[:2]
        server = _Server(
            uvicorn.Config(
                app,
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            )
        )
        logger.info("serving %s on http://%s:%d/v1", config.model_name, host, port)
        await server.serve(sockets=[listener])
    finally:
        await engine.close()


def _bind(host: str, port: int) -> socket.socket:
    """Bind ourselves so that port 0 works and the real port can be logged (uvicorn logs the configured one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.set_inheritable(True)
    return listener


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would kill the process before the
        # engine closes its DHT and node sessions; here a signal only asks the server to stop.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
