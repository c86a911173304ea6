"""The Conversations API over a scripted engine (no Redis: one replica's memory; Redis and the openai client:
tests/integration/test_responses_smollm2.py): CRUD on conversations and items, paging, ownership by API key, and a
response made with ``conversation``: its items are the context, its input and output are appended."""

from __future__ import annotations

import httpx
import pytest

from gateway.api.auth import Caller
from gateway.api.errors import NotFound
from gateway.api.protocol.conversations import ConversationCreate
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.conversations import ConversationServing
from gateway.app import create_app
from gateway.state.conversations_store import ConversationStore
from gateway.state.redis_link import RedisLink
from tests.helpers.ascii_engine import AsciiEngine


def client_for(engine: AsciiEngine) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def texts(items: list[dict[str, object]]) -> list[str]:
    return [item["content"][0]["text"] for item in items]  # type: ignore[index]


async def test_conversation_and_item_crud_with_paging() -> None:
    async with client_for(AsciiEngine("x")) as client:
        made = await client.post(
            "/v1/conversations", json={"metadata": {"topic": "bikes"}, "items": [{"role": "user", "content": "one"}]}
        )
        assert made.status_code == 200, made.text
        conversation = made.json()
        assert conversation["object"] == "conversation" and conversation["id"].startswith("conv_")
        base = f"/v1/conversations/{conversation['id']}"
        assert (await client.get(base)).json()["metadata"] == {"topic": "bikes"}
        updated = await client.post(base, json={"metadata": {"topic": "cars"}})
        assert updated.json()["metadata"] == {"topic": "cars"}
        added = await client.post(
            f"{base}/items",
            json={
                "items": [
                    {"role": "assistant", "content": "two"},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "three"}]},
                ]
            },
        )
        assert added.status_code == 200 and texts(added.json()["data"]) == ["two", "three"]
        newest_first = (await client.get(f"{base}/items")).json()
        assert texts(newest_first["data"]) == ["three", "two", "one"] and newest_first["has_more"] is False
        first_page = (await client.get(f"{base}/items", params={"order": "asc", "limit": 2})).json()
        assert texts(first_page["data"]) == ["one", "two"] and first_page["has_more"] is True
        rest = (await client.get(f"{base}/items", params={"order": "asc", "after": first_page["last_id"]})).json()
        assert texts(rest["data"]) == ["three"]
        one = first_page["data"][0]
        assert (await client.get(f"{base}/items/{one['id']}")).json() == one
        assert one["status"] == "completed" and one["content"][0]["type"] == "input_text"
        assert (await client.delete(f"{base}/items/{one['id']}")).json()["id"] == conversation["id"]
        assert (await client.get(f"{base}/items/{one['id']}")).status_code == 404
        deleted = (await client.delete(base)).json()
        assert deleted == {"id": conversation["id"], "object": "conversation.deleted", "deleted": True}
        gone = await client.get(base)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "conversation_not_found"


async def test_a_response_in_a_conversation_reads_its_items_and_adds_its_turn() -> None:
    engine = AsciiEngine("Blue.")
    async with client_for(engine) as client:
        conversation = (
            await client.post("/v1/conversations", json={"items": [{"role": "user", "content": "I like blue."}]})
        ).json()
        answer = await client.post(
            "/v1/responses", json={"model": "scripted", "input": "Which colour?", "conversation": conversation["id"]}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["conversation"] == {"id": conversation["id"]}
        prompt = engine.codec.decode(engine.requests[-1].prompt_ids)
        assert prompt.index("I like blue.") < prompt.index("Which colour?")
        items = (await client.get(f"/v1/conversations/{conversation['id']}/items", params={"order": "asc"})).json()
        assert texts(items["data"]) == ["I like blue.", "Which colour?", "Blue."]
        assert items["data"][-1]["id"] == answer.json()["output"][0]["id"]  # the output item as the response has it
        again = await client.post(
            "/v1/responses", json={"model": "scripted", "input": "And?", "conversation": {"id": conversation["id"]}}
        )
        assert again.status_code == 200
        prompt = engine.codec.decode(engine.requests[-1].prompt_ids)
        assert prompt.index("Which colour?") < prompt.index("Blue.") < prompt.index("And?")
        both = {"model": "scripted", "input": "x", "conversation": conversation["id"], "previous_response_id": "r"}
        refused = await client.post("/v1/responses", json=both)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "conversation"
        unknown = await client.post("/v1/responses", json={"model": "scripted", "input": "x", "conversation": "conv_x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "conversation"


async def test_a_conversation_is_visible_to_its_own_key_and_to_admins_only() -> None:
    serving = ConversationServing(ConversationStore(RedisLink(None)))
    alice, bob = Caller("key-alice", admin=False), Caller("key-bob", admin=False)
    made = await serving.create(ConversationCreate(), alice)
    assert (await serving.retrieve(made.id, alice)) == made
    assert (await serving.retrieve(made.id, Caller("op", admin=True))) == made
    with pytest.raises(NotFound):
        await serving.retrieve(made.id, bob)
    with pytest.raises(NotFound):
        await serving.delete(made.id, bob)
