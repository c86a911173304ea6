"""POST /v1/responses/compact over a scripted engine: the model is asked to summarize the conversation, the answer is
its user messages then one compaction item, and that item sent back as input puts the summary in the prompt."""

from __future__ import annotations

import httpx

from gateway.api.serving.common import ServingConfig
from gateway.api.serving.responses_compact import DEFAULT_INSTRUCTIONS
from gateway.app import create_app
from tests.helpers.ascii_engine import AsciiEngine


def client_for(engine: AsciiEngine) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_compaction_keeps_user_messages_and_summarizes_the_rest_into_one_item() -> None:
    engine = AsciiEngine("Goal: a red bike.")
    async with client_for(engine) as client:
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "I want a red bike."})
        compacted = await client.post(
            "/v1/responses/compact",
            json={"model": "scripted", "previous_response_id": first.json()["id"], "input": "Also a bell."},
        )
        assert compacted.status_code == 200, compacted.text
        body = compacted.json()
        assert body["object"] == "response.compaction" and {"id", "created_at", "usage"} <= set(body)
        asked = engine.codec.decode(engine.requests[-1].prompt_ids)
        assert asked.index("I want a red bike.") < asked.index("Also a bell.") < asked.index(DEFAULT_INSTRUCTIONS)
        *users, item = body["output"]
        assert [user["content"][0]["text"] for user in users] == ["I want a red bike.", "Also a bell."]
        assert all(user["role"] == "user" for user in users)
        assert item["type"] == "compaction" and item["id"].startswith("cmp_") and item["encrypted_content"]
        assert body["usage"]["output_tokens"] == len("Goal: a red bike.") + 1  # and its end token
        # The compacted items are the next request's whole context: the summary comes back in the prompt.
        follow = {"model": "scripted", "input": [*body["output"], {"role": "user", "content": "Which colour?"}]}
        assert (await client.post("/v1/responses", json=follow)).status_code == 200
        prompt = engine.codec.decode(engine.requests[-1].prompt_ids)
        assert prompt.index("Also a bell.") < prompt.index("Goal: a red bike.") < prompt.index("Which colour?")


async def test_compaction_refuses_what_it_cannot_read() -> None:
    async with client_for(AsciiEngine("x")) as client:
        nothing = await client.post("/v1/responses/compact", json={"model": "scripted"})
        assert nothing.status_code == 400 and nothing.json()["error"]["param"] == "input"
        forged = {"type": "compaction", "encrypted_content": "bm90IG91cnM="}
        bad = await client.post("/v1/responses", json={"model": "scripted", "input": [forged]})
        assert bad.status_code == 400 and "compact" in bad.json()["error"]["message"]
        unknown = await client.post("/v1/responses/compact", json={"model": "scripted", "previous_response_id": "r"})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "previous_response_not_found"
