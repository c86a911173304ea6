"""The Open Responses surface end to end: SmolLM2-135M-Instruct (the bundled GGUF) on two real nodes, two
`gateway serve` replicas sharing a private redis-server, the official `openai` client throughout.

The response object has every field the spec requires; WebSocket mode (``client.responses.connect()``) runs
sequential responses on one socket with ``previous_response_id``; a background response made on replica A is read,
resumed from a sequence number and cancelled from replica B; the Conversations API keeps a conversation that both
replicas extend; ``responses.compact`` returns a compaction item the next request continues from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.open_responses import check_resource
from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm
from tests.helpers.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def replicas(smollm2_swarm: LocalSwarm, smollm2_gguf: Path, module_redis: RedisServer) -> Iterator[list[Gateway]]:
    try:
        shared = ["--redis-url", module_redis.url, "--default-max-tokens", "48"]
        a = start_gateway(smollm2_swarm, smollm2_gguf, *shared, "--replica-id", "A", timeout=600)
        b = start_gateway(smollm2_swarm, smollm2_gguf, *shared, "--replica-id", "B", timeout=600)
        yield [a, b]
    finally:
        stop_gracefully(smollm2_swarm)


def test_the_response_object_has_every_required_field_with_the_values_applied(replicas: list[Gateway]) -> None:
    a, _ = replicas
    raw = a.openai().responses.with_raw_response.create(
        model=a.model, input="Say hi.", extra_body={"client_metadata": {"x": "1"}}
    )
    data = json.loads(raw.text)  # as sent: the client's model reads created_at as a float
    check_resource(data)
    # No max_output_tokens asked: the gateway's --default-max-tokens is what capped it, and it says so.
    assert data["max_output_tokens"] == 48
    assert isinstance(data["temperature"], float) and isinstance(data["top_p"], float)
    if data["status"] == "incomplete":
        assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert data["completed_at"] is not None and data["output"][-1]["phase"] == "final_answer"


# The openai client opens its socket with websockets' connect() outside a context manager (its own choice).
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_websocket_mode_runs_sequential_responses_with_previous_response_id(replicas: list[Gateway]) -> None:
    a, _ = replicas
    with a.openai().responses.connect() as connection:
        connection.send({"type": "response.create", "model": a.model, "input": "My name is Ada.", "store": False})
        first = _until_done(connection)
        assert first[-1].type == "response.completed" or first[-1].type == "response.incomplete"
        first_id = first[-1].response.id
        connection.send(
            {
                "type": "response.create",
                "model": a.model,
                "input": "What is my name?",
                "previous_response_id": first_id,
                "store": False,
                "temperature": 0,
            }
        )
        second = _until_done(connection)
        final = second[-1].response
        assert final.previous_response_id == first_id and final.usage is not None
        assert final.usage.input_tokens > first[-1].response.usage.input_tokens  # the first turn is in its prompt
        assert [event.sequence_number for event in second] == list(range(len(second)))
        connection.send(
            {"type": "response.create", "model": a.model, "input": "x", "previous_response_id": "resp_missing"}
        )
        (error,) = _until_done(connection)
        assert error.type == "error" and error.error.code == "previous_response_not_found" and error.status == 400


def _until_done(connection: Any) -> list[Any]:
    events = []
    for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events
    raise AssertionError("the socket closed before the response ended")


def test_a_background_response_on_a_is_resumed_and_cancelled_from_b(replicas: list[Gateway]) -> None:
    a, b = replicas
    body: dict[str, Any] = {"model": a.model, "input": "Count from 1 to 500, one number a line.", "temperature": 0}
    started = a.openai().responses.create(**body, max_output_tokens=900, background=True)
    assert started.background is True and started.status == "in_progress"
    # Replica B streams it from sequence number 2 on, while A makes it.
    resumed = b.openai().responses.retrieve(started.id, stream=True, starting_after=2)
    first = [event for _, event in zip(range(6), resumed, strict=False)]
    assert [event.sequence_number for event in first] == list(range(3, 9))
    resumed.close()
    cancelled = b.openai().responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    wait_until(lambda: a.openai().responses.retrieve(started.id).status == "cancelled", within=60)
    # A short one finishes by itself, with nobody reading it.
    short = a.openai().responses.create(model=a.model, input="Say hi.", max_output_tokens=8, background=True)
    wait_until(lambda: b.openai().responses.retrieve(short.id).status in ("completed", "incomplete"), within=120)
    assert b.openai().responses.retrieve(short.id).output_text


def test_a_conversation_is_kept_in_redis_and_extended_from_both_replicas(replicas: list[Gateway]) -> None:
    a, b = replicas
    conversation = a.openai().conversations.create(
        items=[{"type": "message", "role": "user", "content": "My favourite colour is green."}],
        metadata={"topic": "colours"},
    )
    assert b.openai().conversations.retrieve(conversation.id).metadata == {"topic": "colours"}
    answer = b.openai().responses.create(
        model=a.model, input="What is my favourite colour?", conversation=conversation.id, temperature=0
    )
    assert answer.conversation is not None and answer.conversation.id == conversation.id
    items = list(a.openai().conversations.items.list(conversation.id, order="asc"))
    assert [item.type for item in items] == ["message", "message", "message"]
    assert items[-1].id == answer.output[0].id
    a.openai().conversations.items.delete(items[0].id, conversation_id=conversation.id)
    assert len(list(b.openai().conversations.items.list(conversation.id))) == 2
    assert b.openai().conversations.delete(conversation.id).deleted is True


def test_compact_returns_a_compaction_item_the_next_request_continues_from(replicas: list[Gateway]) -> None:
    a, _ = replicas
    client = a.openai()
    first = client.responses.create(model=a.model, input="I am planning a trip to Rome in May.", temperature=0)
    raw = client.responses.with_raw_response.compact(model=a.model, previous_response_id=first.id)
    compacted = raw.parse()
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    carried = json.loads(raw.text)["output"]  # as sent (the client's models read a user message as an output one)
    assert [item["type"] for item in carried] == ["message", "compaction"]
    follow = client.responses.create(
        model=a.model,
        input=[*carried, {"role": "user", "content": "Where?"}],
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete") and follow.usage is not None
    assert follow.usage.input_tokens > 10
