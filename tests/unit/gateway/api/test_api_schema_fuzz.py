"""schemathesis over the gateway's own OpenAPI spec, in-process, against the scripted engine (a seam).

Every operation gets schema-valid and schema-breaking requests (seeded, a bounded number per operation); the
answers must be no 5xx, only documented statuses and content types, bodies and SSE events that match the documented
schemas, and breaking requests refused. Valid requests may still be refused 400 for what no static schema can say
(the served model's vocabulary and context window, fields that depend on each other): ``accepted_or_refused_late``
lets those through, but not a refusal by request validation, which would mean the spec allows what the models don't.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import CheckContext, Response
from schemathesis.core.failures import Failure

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from tests.helpers.scripted_engine import ALPHABET, CharCodec, ScriptedEngine

EXAMPLES = 30  # per operation and phase: the module takes about 20 s on the 2-core CI machine


class FuzzedCodec(CharCodec):
    """The scripted codec with a chat template, a BOS token, a token for every character and a real model's
    vocabulary size (ids past the alphabet read ``<id>``), so that random requests get as far as generating."""

    vocab_size = 1 << 17
    bos = len(ALPHABET)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ALPHABET.find(c) if c in ALPHABET else len(ALPHABET) - 1 for c in text]
        return [self.bos, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.token_bytes(t).decode() for t in token_ids if t != 0)

    def token_bytes(self, token_id: int) -> bytes:
        return (ALPHABET[token_id] if token_id < len(ALPHABET) else f"<{token_id}>").encode()

    chat_message = staticmethod(lambda message: f"{message['role']} {message['content']} ")


class FuzzedEngine(ScriptedEngine):
    async def swarm_report(self) -> dict[str, Any]:
        return {"model": self.model_name, "blocks": [], "nodes": []}


ENGINE = FuzzedEngine(codec=FuzzedCodec(), context_length=256)
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 20261129,
        "generation": {"max-examples": EXAMPLES, "deterministic": True},
        # Replaced by accepted_or_refused_late below, which knows the refusals no static schema can state.
        "checks": {"positive_data_acceptance": {"enabled": False}},
    }
)
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", create_app(ENGINE, ServingConfig(ENGINE.model_name)), config=CONFIG
)


class ValidRequestRefused(Failure):
    kind_title = "Schema-valid request refused by request validation"


def accepted_or_refused_late(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool | None:
    """A schema-valid request is answered, or refused 400 by a serving check (vocabulary, context, ...)."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return None
    error = json.loads(response.content)["error"]
    # errors.validation_error's answers: what pydantic refused although the spec allowed it.
    # Anthropic's body (/v1/messages) has no code: its message leads with the field when validation refused it.
    by_validation = error.get("code") in {"invalid_json", "invalid_type", "missing_required_parameter"} or str(
        error["message"]
    ).startswith("Invalid value for '")
    if by_validation:
        raise ValidRequestRefused(operation=case.operation.label, message=f"{error['param']}: {error['message']}")
    return True


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case: schemathesis.Case) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        # Generated model names are all unknown (404): name the served one, so that requests get to generating.
        case.body["model"] = ENGINE.model_name
    case.call_and_validate(additional_checks=[accepted_or_refused_late])


def test_streams_and_their_resumption_match_the_documented_events() -> None:
    """Streams the fuzzing above seldom gets to (most random requests are refused first), each event checked."""
    bodies = {
        "/v1/completions": {"model": "scripted", "prompt": "ab", "max_tokens": 5, "stream": True, "logprobs": 2},
        "/v1/chat/completions": {
            "model": "scripted",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
        },
        "/v1/responses": {"model": "scripted", "input": "hi", "max_output_tokens": 5, "stream": True},
    }
    for path, body in bodies.items():
        response = schema[path]["POST"].Case(body=body).call_and_validate()
        assert response.headers["content-type"][0].startswith("text/event-stream")
        events = schema["/v1/sessions/{session_id}/events"]["GET"]
        replay = events.Case(path_parameters={"session_id": response.headers["x-session-id"][0]}).call_and_validate()
        assert replay.content == response.content
