"""WebSocket mode of /v1/responses over a scripted engine (Starlette's test client speaks the WebSocket protocol to
the app): sequential responses on one socket, previous_response_id continuation, store: false kept only for the
socket's life, previous_response_not_found, bad messages, and the handshake's authentication."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from gateway.api.auth import Authenticator
from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from tests.helpers.ascii_engine import AsciiEngine

KEY = "sk-socket-test"


def app_for(engine: AsciiEngine, auth: bool = False) -> TestClient:
    authenticator = Authenticator([KEY], None, enabled=True) if auth else None
    return TestClient(create_app(engine, ServingConfig(engine.model_name), authenticator=authenticator))


def create(**fields: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": "scripted", **fields}


def until_end(ws: Any) -> list[dict[str, Any]]:
    """The events of one response, up to its final one (or a lone error)."""
    events: list[dict[str, Any]] = []
    while True:
        event = ws.receive_json()
        events.append(event)
        if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
            return events
        if event["type"] == "error" and "sequence_number" not in event:
            return events


def test_sequential_responses_on_one_socket_continue_with_previous_response_id() -> None:
    engine = AsciiEngine("pong")
    with app_for(engine) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json(create(input="ping", store=False))
        first = until_end(ws)
        assert [event["sequence_number"] for event in first] == list(range(len(first)))
        assert first[0]["type"] == "response.created" and first[-1]["type"] == "response.completed"
        done = first[-1]["response"]
        assert done["store"] is False and done["output"][0]["content"][0]["text"] == "pong"
        ws.send_json(create(input="again", previous_response_id=done["id"], store=False))
        second = until_end(ws)
        assert second[-1]["type"] == "response.completed"
        assert second[-1]["response"]["previous_response_id"] == done["id"]
        # The second prompt holds the first turn (store: false, kept by this socket) before the new input.
        prompt = engine.codec.decode(engine.requests[-1].prompt_ids)
        assert prompt.index("ping") < prompt.index("pong") < prompt.index("again")
        # Never stored: HTTP does not know it.
        assert client.get(f"/v1/responses/{done['id']}").status_code == 404
    with app_for(engine) as client, client.websocket_connect("/v1/responses") as other:
        other.send_json(create(input="x", previous_response_id=done["id"]))
        (error,) = until_end(other)
        assert error["status"] == 400 and error["error"]["code"] == "previous_response_not_found"


def test_previous_response_not_found_and_bad_messages_are_errors_on_an_open_socket() -> None:
    with app_for(AsciiEngine("ok")) as client, client.websocket_connect("/v1/responses") as ws:
        ws.send_json(create(input="x", previous_response_id="resp_unknown"))
        (error,) = until_end(ws)
        assert error == {
            "type": "error",
            "status": 400,
            "error": {
                "message": "Previous response with id 'resp_unknown' not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            },
        }
        ws.send_json({"type": "session.update"})
        (error,) = until_end(ws)
        assert (error["status"], error["error"]["code"], error["error"]["param"]) == (400, "invalid_event", "type")
        ws.send_json(create(input="x", background=True))
        (error,) = until_end(ws)
        assert error["error"]["param"] == "background"
        ws.send_json(create(input="x", temperature="hot"))
        (error,) = until_end(ws)
        assert error["error"]["param"] == "temperature"
        ws.send_text("{not json")
        (error,) = until_end(ws)
        assert error["error"]["code"] == "invalid_json"
        ws.send_json(create(input="x"))  # still open, and stored by default: HTTP reads it
        events = until_end(ws)
        assert events[-1]["type"] == "response.completed"
        stored = client.get(f"/v1/responses/{events[-1]['response']['id']}")
        assert stored.status_code == 200 and stored.json()["output"][0]["content"][0]["text"] == "ok"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_the_handshake_is_authenticated_as_http_is(headers: dict[str, str]) -> None:
    with app_for(AsciiEngine("ok"), auth=True) as client:
        with pytest.raises(WebSocketDenialResponse) as denied:
            client.websocket_connect("/v1/responses", headers=headers).__enter__()
        assert denied.value.status_code == 401
        assert denied.value.json()["error"]["code"] == "invalid_api_key"
        with client.websocket_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"}) as ws:
            ws.send_json(create(input="x"))
            assert until_end(ws)[-1]["type"] == "response.completed"
