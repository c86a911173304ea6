"""/v1/responses: create (JSON or SSE), retrieve, cancel and delete stored responses."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from gateway.api.auth import CallerDep
from gateway.api.dependencies import ContextDep, ResponsesDep, respond
from gateway.api.openapi_docs import errors, streamed
from gateway.api.protocol.responses import (
    CompactedResponse,
    CompactRequest,
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from gateway.api.serving.responses_compact import compact

router = APIRouter(responses=errors(400, 401, 404))


@router.post(
    "/v1/responses",
    response_model=None,
    responses={**streamed(ResponseStreamEvent, json_model=ResponseObject), **errors(409, 413, 429, 503)},
)
async def create_response(body: ResponsesRequest, serving: ResponsesDep, context: ContextDep) -> Response:
    return respond(await serving.create(body, context))


@router.post("/v1/responses/compact", responses=errors(429, 503))
async def compact_response(body: CompactRequest, serving: ResponsesDep, context: ContextDep) -> CompactedResponse:
    """Compacts a conversation (``previous_response_id`` and/or ``input``): its user messages and one compaction item
    that summarizes the rest, to send back as the input of the next request."""
    return await compact(serving, body, context)


@router.get("/v1/responses/{response_id}", response_model=None, responses=streamed(ResponseStreamEvent))
async def get_response(
    response_id: str,
    caller: CallerDep,
    serving: ResponsesDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0, description="resume after this sequence number")] = None,
) -> Response:
    """The response as it is now; with ``stream=true``, a background response's events (after ``starting_after``)."""
    if stream:
        return respond(await serving.resume(response_id, caller, starting_after))
    return respond(await serving.retrieve(response_id, caller))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, caller: CallerDep, serving: ResponsesDep) -> ResponseObject:
    """Stops a response still being made (streamed or not, on any replica); the response as it ended."""
    return await serving.cancel(response_id, caller)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, caller: CallerDep, serving: ResponsesDep) -> DeletedResponse:
    return await serving.delete(response_id, caller)
