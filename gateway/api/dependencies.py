"""The serving objects a route needs, as ``Annotated`` dependencies, and the HTTP glue every route shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.api.auth import CallerDep
from gateway.api.errors import ClientDisconnected
from gateway.api.serving.chat import ChatServing
from gateway.api.serving.common import RequestContext, Stream
from gateway.api.serving.completions import CompletionServing
from gateway.api.serving.embeddings import EmbeddingServing
from gateway.api.serving.live_sessions import SessionTracker
from gateway.api.serving.models import ModelServing
from gateway.api.serving.ollama import OllamaServing
from gateway.api.serving.ollama_models import OllamaModels
from gateway.api.serving.responses import ResponsesServing
from gateway.api.serving.stop_signals import Signal, when
from gateway.api.sse import event_stream


@dataclass(frozen=True)
class Services:
    completions: CompletionServing
    chat: ChatServing
    models: ModelServing
    sessions: SessionTracker
    responses: ResponsesServing
    embeddings: EmbeddingServing
    ollama: OllamaServing
    ollama_models: OllamaModels


def services(request: Request) -> Services:
    found = request.app.state.services
    if not isinstance(found, Services):
        raise RuntimeError("the app was built without its services (use gateway.app.create_app)")
    return found


def _completions(request: Request) -> CompletionServing:
    return services(request).completions


def _chat(request: Request) -> ChatServing:
    return services(request).chat


def _models(request: Request) -> ModelServing:
    return services(request).models


CompletionsDep = Annotated[CompletionServing, Depends(_completions)]
ChatDep = Annotated[ChatServing, Depends(_chat)]
ModelsDep = Annotated[ModelServing, Depends(_models)]


def _responses(request: Request) -> ResponsesServing:
    return services(request).responses


ResponsesDep = Annotated[ResponsesServing, Depends(_responses)]


def _embeddings(request: Request) -> EmbeddingServing:
    return services(request).embeddings


EmbeddingsDep = Annotated[EmbeddingServing, Depends(_embeddings)]


def _sessions(request: Request) -> SessionTracker:
    return services(request).sessions


SessionsDep = Annotated[SessionTracker, Depends(_sessions)]


def _context(request: Request, caller: CallerDep) -> RequestContext:
    return RequestContext(caller, client_left(request))


ContextDep = Annotated[RequestContext, Depends(_context)]


def client_left(request: Request) -> Signal:
    """A stop signal that fires when the client disconnects (the body is already read, so the next ASGI message
    says so)."""

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return when(disconnect, lambda: ClientDisconnected("the client closed the connection", "client_disconnected"))


def respond(result: BaseModel | Stream) -> Response:
    if isinstance(result, Stream):
        return event_stream(result.events, result.id)
    session_id = getattr(result, "id", None)
    headers = {"X-Session-Id": session_id} if isinstance(session_id, str) else None
    return JSONResponse(result.model_dump(mode="json"), headers=headers)
