"""Bad requests at the HTTP edge, over the scripted engine (a seam): each is a 4xx in OpenAI's envelope, never a 500.

The context window on both sides of its limit (text, token-id and chat prompts), empty and out-of-vocabulary
prompts, bodies that are no JSON object, the wrong content type, 10 MB strings, sampling parameters outside OpenAI's
ranges, and the non-finite numbers Python's json reads (``NaN``, ``Infinity``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from tests.helpers.scripted_engine import CharCodec, ScriptedEngine, content_of

LIMIT = 64  # the scripted engine's context window, in tokens (one per character)
MB = 1024 * 1024


class TemplateCodec(CharCodec):
    """Renders a chat as its contents, one token per character: ``[user "abc"]`` is 3 prompt tokens."""

    chat_message = staticmethod(content_of)


def make_client(max_bytes: int = 8 * MB) -> tuple[ScriptedEngine, httpx.AsyncClient]:
    engine = ScriptedEngine(codec=TemplateCodec(), context_length=LIMIT)
    app = create_app(engine, ServingConfig(engine.model_name, max_request_bytes=max_bytes))
    return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def completion(**fields: object) -> dict[str, object]:
    return {"model": "scripted", "prompt": "ab", "max_tokens": 3, **fields}


def chat(**fields: object) -> dict[str, object]:
    return {"model": "scripted", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3, **fields}


def assert_refused(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    """``status`` with OpenAI's error envelope, exactly its four keys."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


# -- the context window, on both sides ----------------------------------------------------------------------------

BOUNDARY = [
    # (route, body with a prompt of P tokens asking for M more, fits the window)
    ("/v1/completions", completion(prompt="a" * (LIMIT - 5), max_tokens=5), True),
    ("/v1/completions", completion(prompt="a" * (LIMIT - 5), max_tokens=6), False),
    ("/v1/completions", completion(prompt="a" * LIMIT, max_tokens=0, echo=True), True),  # scoring a full window
    ("/v1/completions", completion(prompt="a" * (LIMIT + 1), max_tokens=0), False),
    ("/v1/completions", completion(prompt=[1] * (LIMIT - 1), max_tokens=1), True),
    ("/v1/completions", completion(prompt=[1] * LIMIT, max_tokens=1), False),
    ("/v1/completions", completion(prompt=[[1] * (LIMIT - 2), [2]], max_tokens=2), True),
    ("/v1/completions", completion(prompt=[[2], [1] * (LIMIT - 1)], max_tokens=2), False),  # any prompt of several
    ("/v1/completions", completion(prompt="a" * (LIMIT - 1), max_tokens=None), True),  # null: the rest of the window
    ("/v1/completions", completion(prompt="a" * LIMIT, max_tokens=None), False),  # ... of which nothing is left
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * (LIMIT - 4)}], max_tokens=4), True),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * (LIMIT - 4)}], max_tokens=5), False),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * (LIMIT - 1)}], max_tokens=None), True),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * LIMIT}], max_tokens=None), False),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "system", "content": "a" * 30}, {"role": "user", "content": "b" * 31}], max_tokens=3),
        True,
    ),
    (
        "/v1/chat/completions",
        chat(
            messages=[{"role": "system", "content": "a" * 30}, {"role": "user", "content": "b" * 31}],
            max_completion_tokens=4,
        ),
        False,
    ),
]


@pytest.mark.parametrize(("route", "body", "fits"), BOUNDARY)
async def test_the_context_window_is_enforced_exactly_at_its_limit(
    route: str, body: dict[str, object], fits: bool
) -> None:
    engine, client = make_client()
    async with client:
        response = await client.post(route, json=body)
    if fits:
        assert response.status_code == 200, response.text
        assert all(choice["finish_reason"] for choice in response.json()["choices"])
    else:
        assert_refused(response, 400, "context_length_exceeded", "messages" if "chat" in route else "max_tokens")
        assert f"maximum context length is {LIMIT} tokens" in response.json()["error"]["message"]
    assert engine.active == 0


# -- empty and out-of-vocabulary prompts --------------------------------------------------------------------------

PROMPTS = [
    ("/v1/completions", completion(prompt=""), "prompt"),
    ("/v1/completions", completion(prompt="#$%"), "prompt"),  # text with no token of this vocabulary: empty too
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(prompt=[[]]), "prompt[0]"),
    ("/v1/completions", completion(prompt=["ab", ""]), "prompt"),
    ("/v1/completions", completion(prompt=[CharCodec.vocab_size]), "prompt"),
    ("/v1/completions", completion(prompt=[[1, 2], [-1]]), "prompt[1][0]"),
    ("/v1/completions", completion(prompt=[2**40]), "prompt"),
    ("/v1/completions", completion(logit_bias={str(CharCodec.vocab_size): 1}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"a": 1}), "logit_bias"),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": ""}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "ab"}]), "messages[0].role"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    ("/detokenize", {"tokens": [CharCodec.vocab_size]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/tokenize", {"messages": []}, "messages"),
]


@pytest.mark.parametrize(("route", "body", "param"), PROMPTS)
async def test_empty_and_out_of_vocabulary_prompts_are_400(route: str, body: dict[str, object], param: str) -> None:
    engine, client = make_client()
    async with client:
        assert_refused(await client.post(route, json=body), 400, param=param)
    assert engine.active == 0


# -- bodies that are no JSON object, the wrong content type ------------------------------------------------------

BODIES = [
    (b'{"model": "scripted", "prompt": "ab"', "application/json", "invalid_json"),
    (b"{'model': 'scripted'}", "application/json", "invalid_json"),
    (b"\xff\xfe{}", "application/json", "invalid_json"),
    (b'[{"model": "scripted", "prompt": "ab"}]', "application/json", "invalid_type"),
    (b"42", "application/json", "invalid_type"),
    (b'"a string"', "application/json", "invalid_type"),
    (b"null", "application/json", None),
    (b"", "application/json", None),
    (b'{"model": "scripted", "prompt": "ab"}', "text/plain", None),
    (b"model=scripted&prompt=ab", "application/x-www-form-urlencoded", None),
    (b'{"model": "scripted", "prompt": "ab"}', "multipart/form-data; boundary=x", None),
]


@pytest.mark.parametrize(("content", "content_type", "code"), BODIES)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
async def test_bodies_that_are_no_json_object_are_400(
    route: str, content: bytes, content_type: str, code: str | None
) -> None:
    _, client = make_client()
    async with client:
        response = await client.post(route, content=content, headers={"Content-Type": content_type})
    assert_refused(response, 400, code)


# -- 10 MB strings ----------------------------------------------------------------------------------------------


async def test_a_10_mb_body_is_413_before_parsing_and_10_mb_strings_under_a_higher_limit_are_4xx() -> None:
    huge = "a" * (10 * MB)
    _, client = make_client()
    async with client:
        assert_refused(await client.post("/v1/completions", json=completion(prompt=huge)), 413, "payload_too_large")
    _, client = make_client(max_bytes=16 * MB)
    async with client:
        too_long = await client.post("/v1/completions", json=completion(prompt=huge))
        assert_refused(too_long, 400, "context_length_exceeded")
        chat_too_long = await client.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": huge}])
        )
        assert_refused(chat_too_long, 400, "context_length_exceeded")
        unknown = await client.post("/v1/completions", json=completion(model=huge))
        assert_refused(unknown, 404, "model_not_found")
        assert len(unknown.content) < 1000  # the name is not echoed back whole
        stop = await client.post("/v1/completions", json=completion(stop=huge))
        assert stop.status_code == 200
        counted = await client.post("/tokenize", json={"prompt": huge[:MB]})
        assert counted.status_code == 200 and counted.json()["count"] == MB


# -- sampling parameters outside OpenAI's ranges, wrong types, non-finite numbers ---------------------------------

OUT_OF_RANGE = [
    ("temperature", 2.01),
    ("temperature", -0.1),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("n", 0),
    ("n", -1),
    ("n", 129),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3),
    ("min_p", 1.5),
    ("top_k", -2),
    ("repetition_penalty", 0),
    ("repetition_penalty", 2.5),
    ("seed", 2**64),
    ("max_tokens", -1),
]
COMPLETIONS_ONLY = [("logprobs", 21), ("logprobs", -1), ("best_of", 0), ("best_of", 129)]
CHAT_ONLY = [("top_logprobs", 21), ("top_logprobs", -1), ("max_tokens", 0), ("max_completion_tokens", 0)]
WRONG_TYPE = [
    ("n", "2"),
    ("n", 1.5),
    ("n", True),
    ("temperature", "hot"),
    ("stream", "yes"),
    ("stream", 1),
    ("max_tokens", "16"),
    ("stop", 5),
    ("logit_bias", [1, 2]),
    ("stream_options", "usage"),
]


REFUSED_BY_ENDPOINT = [
    *[("/v1/completions", completion, f, v) for f, v in OUT_OF_RANGE + COMPLETIONS_ONLY + WRONG_TYPE],
    *[("/v1/chat/completions", chat, f, v) for f, v in OUT_OF_RANGE + CHAT_ONLY + WRONG_TYPE],
]


@pytest.mark.parametrize(("path", "body", "field", "value"), REFUSED_BY_ENDPOINT)
async def test_parameters_out_of_range_or_of_the_wrong_type_are_400(
    path: str, body: Callable[..., dict[str, object]], field: str, value: object
) -> None:
    engine, client = make_client()
    async with client:
        response = await client.post(path, json=body(**{field: value}))
    assert_refused(response, 400, param=field)
    assert engine.active == 0


async def test_integral_floats_are_integers_as_json_schema_says() -> None:
    _, client = make_client()
    async with client:
        response = await client.post("/v1/completions", json=completion(n=2.0, max_tokens=3.0, prompt=[1.0, 2.0]))
    assert response.status_code == 200 and len(response.json()["choices"]) == 2


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400"]  # Python's json reads all four (1e400 as inf)
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize("field", [*FLOAT_FIELDS, "n", "max_tokens", "seed", "logit_bias"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_non_finite_numbers_are_400(route: str, field: str, literal: str) -> None:
    body = completion() if route == "/v1/completions" else chat()
    value = f'{{"1": {literal}}}' if field == "logit_bias" else literal
    raw = json.dumps({key: v for key, v in body.items() if key != field})[:-1] + f', "{field}": {value}}}'
    engine, client = make_client()
    async with client:
        response = await client.post(route, content=raw.encode(), headers={"Content-Type": "application/json"})
    assert_refused(response, 400)
    assert response.json()["error"]["param"].startswith(field)
    assert engine.active == 0
