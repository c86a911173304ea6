"""Gateway sessions in Redis, end to end: two `gateway serve` replicas sharing a private redis-server, in front of
real node processes (a tiny Llama, blocks 0:3 and 3:6), driven over HTTP.

Cancel from the other replica, resume a dropped stream on the other replica, API keys (401, ownership, revocation,
no plaintext in Redis), per-key limits (429 at exactly the count) and Redis dying mid-stream. The Redis-killing test
runs last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
from hivemind.p2p import P2P

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.node_info import wait_all_free
from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm
from tests.helpers.redis_server import RedisServer
from tests.helpers.sse import Event, sse_events
from tests.integration.conftest import CONTEXT
from tests.tiny_models import TinyModel

pytestmark = pytest.mark.timeout(300)

ADMIN = "sk-operator-test-0123456789abcdef"  # an operator key given with --api-keys: admin, no limits
PROMPT = [5, 17, 99, 3, 42, 8, 1]


@pytest.fixture(scope="module")
def replicas(module_swarm: LocalSwarm, chat_model: TinyModel, module_redis: RedisServer) -> Iterator[list[Gateway]]:
    try:
        module_swarm.start_dht()
        module_swarm.start_nodes(chat_model.folder, ("0:3", "3:6"), "--cache-tokens", "8192")
        # Sessions across replicas are what this module tests: no spot checks' extra forwards on the frozen node.
        shared = ["--redis-url", module_redis.url, "--api-keys", ADMIN, "--step-timeout", "10", "--no-verify"]
        yield [start_gateway(module_swarm, chat_model.folder, *shared, "--replica-id", name) for name in "AB"]
    finally:
        stop_gracefully(module_swarm)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def create_key(redis_url: str, name: str, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", "create", name, "--redis-url", redis_url, *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def chunk_text(event: Event) -> str:
    choices = json.loads(event.data)["choices"]
    return "".join(choice["text"] for choice in choices)


def completion(gateway: Gateway, **overrides: object) -> dict[str, object]:
    return {"model": gateway.model, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **overrides}


async def test_a_cancel_sent_to_replica_b_stops_the_stream_on_a_and_frees_node_caches(
    replicas: list[Gateway], module_swarm: LocalSwarm, client_p2p: P2P
) -> None:
    a, b = replicas
    body = completion(a, prompt=[1, 2, 3], max_tokens=CONTEXT - 3, stream=True)
    with a.http(headers=bearer(ADMIN)) as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        session_id = response.headers["x-session-id"]
        events = sse_events(response)
        first = [next(events) for _ in range(3)]
        with b.http(headers=bearer(ADMIN)) as other:
            assert other.get(f"/v1/sessions/{session_id}").json()["status"] == "running"
            cancelled = other.delete(f"/v1/sessions/{session_id}")
        rest = list(events)
    assert cancelled.status_code == 200, cancelled.text
    record = cancelled.json()
    # The replicas' logs in the message: this once failed only inside the full suite, and never alone.
    logs = f"A:\n{a.log_text()[-4000:]}\nB:\n{b.log_text()[-4000:]}"
    assert (record["object"], record["status"], record["replica"]) == ("session", "cancelled", "A"), logs
    assert rest[-1].data == "[DONE]"
    assert json.loads(rest[-2].data)["error"]["code"] == "session_cancelled"
    tokens = sum(1 for event in first + rest[:-2] if chunk_text(event))
    assert tokens < CONTEXT - 3  # stopped long before the end
    infos = await wait_all_free(client_p2p, module_swarm)
    assert all(i.sessions == 0 and i.cache_tokens_left == i.cache_tokens_total for i in infos), infos


def test_the_openai_client_does_not_send_a_cancelled_request_again(replicas: list[Gateway]) -> None:
    """The official client sends a request again after a 409 (its retries on) unless the answer says not to: a
    non-streamed completion whose session is deleted mid-generation raises ``ConflictError`` after one POST, and
    no second session runs it again."""
    a, b = replicas
    posts: list[httpx.Request] = []
    http = httpx.Client(trust_env=False, timeout=120, event_hooks={"request": [posts.append]})
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key=ADMIN, max_retries=2, http_client=http)
    before = {session["id"] for session in _all_sessions(a)}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            client.completions.create,
            model=a.model,
            prompt=PROMPT,
            max_tokens=CONTEXT - len(PROMPT),
            temperature=0,
            extra_body={"ignore_eos": True},
        )

        def running() -> list[dict[str, object]]:
            return [s for s in _all_sessions(a) if s["id"] not in before and s["status"] == "running"]

        wait_until(lambda: bool(running()), within=60)
        with b.http(headers=bearer(ADMIN)) as other:
            assert other.delete(f"/v1/sessions/{running()[0]['id']}").status_code == 200
        with pytest.raises(openai.ConflictError, match="cancelled"):
            answer.result(timeout=120)
    assert [r.method for r in posts] == ["POST"]
    assert [s["status"] for s in _all_sessions(a) if s["id"] not in before] == ["cancelled"]


def test_a_dropped_stream_resumes_on_the_other_replica_with_every_token_exactly_once(replicas: list[Gateway]) -> None:
    a, b = replicas
    body = completion(a, max_tokens=200)
    with a.http(headers=bearer(ADMIN)) as client:
        expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            session_id = response.headers["x-session-id"]
            events = sse_events(response)
            seen = [next(events) for _ in range(10)]
        # the connection is gone; the generation goes on for --resume-grace seconds
    assert [event.id for event in seen] == [str(n) for n in range(1, 11)]
    with b.http(headers=bearer(ADMIN)) as other:
        with other.stream(
            "GET", f"/v1/sessions/{session_id}/events", headers={"Last-Event-ID": seen[-1].id or ""}
        ) as response:
            assert response.status_code == 200
            rest = list(sse_events(response))
        record = other.get(f"/v1/sessions/{session_id}").json()
    every = seen + rest
    assert [int(event.id or 0) for event in every] == list(range(1, len(every) + 1))  # no gap, no repeat
    assert every[-1].data == "[DONE]"
    assert "".join(chunk_text(event) for event in every[:-1]) == expected
    assert (record["status"], record["completion_tokens"], record["finish_reason"]) == ("finished", 200, "length")
    # A client may also replay a whole ended session from the start, on either replica.
    with a.http(headers=bearer(ADMIN)) as client, client.stream("GET", f"/v1/sessions/{session_id}/events") as replay:
        assert [event.data for event in sse_events(replay)] == [event.data for event in every]


STALL_SECONDS = 36  # longer than the stale window (30 s) and the keep-alive period (10 s)
STALLED_TOKENS = 200  # of the stalled stream: still running when its node freezes


@dataclass
class StreamEnd:
    """How a streamed response ended: its text, whether an error event came, keep-alive comments, [DONE] last."""

    text: str = ""
    error: str | None = None
    keepalives: int = 0
    done_last: bool = False

    def read(self, lines: Iterable[str], started: threading.Event | None = None) -> StreamEnd:
        data: list[str] = []
        for line in lines:
            self.keepalives += line == ": keep-alive"
            if line.startswith("data: "):
                data.append(line.removeprefix("data: "))
                if started is not None:
                    started.set()
        self.done_last = bool(data) and data[-1] == "[DONE]"
        for chunk in data[:-1]:
            parsed = json.loads(chunk)
            if "error" in parsed:
                self.error = parsed["error"]["code"]
            self.text += "".join(choice["text"] for choice in parsed.get("choices", []))
        return self


@pytest.mark.timeout(900)  # a 36 s freeze, then a failover that may wait for the node to announce again
def test_a_stream_stalled_past_every_timeout_ends_with_its_whole_text_or_an_error_then_done(
    replicas: list[Gateway], module_swarm: LocalSwarm, chat_model: TinyModel, module_redis: RedisServer
) -> None:
    """A node's process frozen for longer than the stale window: three clients (raw SSE and the openai client on
    the replica running the stream, a follower on the other replica) each get the whole text or an error event,
    then [DONE], with keep-alive comments meanwhile — never a silent end."""
    _, b = replicas
    flags = ["--redis-url", module_redis.url, "--api-keys", ADMIN, "--replica-id", "C", "--no-verify"]
    # Token by token (no speculation) and long: the stream must still be running when the node freezes, however
    # long the two other clients take to start on a loaded machine (a 40-token stream once ended before it).
    flags += ["--speculative", "off"]
    c = start_gateway(module_swarm, chat_model.folder, *flags, "--step-timeout", str(STALL_SECONDS + 60))
    node = next(p for p in module_swarm.processes if p.name.startswith("node-0-3"))
    try:
        body = completion(c, max_tokens=STALLED_TOKENS)
        with c.http(headers=bearer(ADMIN)) as client:
            expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            ends = [StreamEnd(), StreamEnd()]
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = response.iter_lines()
                head = [next(lines) for _ in range(4)]  # the first event: id, retry, data, blank
                session_id = response.headers["x-session-id"]
                with ThreadPoolExecutor(2) as pool:
                    started = [threading.Event(), threading.Event()]
                    follower = pool.submit(_follow, b, session_id, ends[1], started[0])
                    openai_text = pool.submit(_openai_stream, c, started[1])
                    assert all(event.wait(60) for event in started)  # both under way before the freeze
                    node.popen.send_signal(signal.SIGSTOP)  # the process only: its p2pd keeps the connections
                    try:
                        time.sleep(STALL_SECONDS)  # the stall under test
                    finally:
                        node.popen.send_signal(signal.SIGCONT)
                    ends[0] = StreamEnd().read([*head, *lines])
                    ends[1] = follower.result(timeout=120)
                    via_openai = openai_text.result(timeout=120)
    finally:
        c.process.stop()
    logs = f"C:\n{c.log_text()[-3000:]}"
    for end in ends:
        assert end.done_last, (end, logs)
        assert end.keepalives >= 2, (end, logs)
        assert end.error is not None or end.text == expected, (end, expected, logs)
    assert via_openai in (expected, "error"), (via_openai, expected, logs)


def _follow(gateway: Gateway, session_id: str, end: StreamEnd, started: threading.Event) -> StreamEnd:
    with gateway.http(headers=bearer(ADMIN)) as client, client.stream("GET", f"/v1/sessions/{session_id}/events") as r:
        return end.read(r.iter_lines(), started)


def _openai_stream(gateway: Gateway, started: threading.Event) -> str:
    """The whole text the openai client streams (it must skip keep-alive comments), or "error" for an error event."""
    client = gateway.openai(ADMIN)
    extra = {"ignore_eos": True}
    try:
        stream = client.completions.create(
            model=gateway.model, prompt=PROMPT, max_tokens=STALLED_TOKENS, temperature=0, stream=True, extra_body=extra
        )
        text = ""
        for chunk in stream:
            started.set()
            text += "".join(choice.text for choice in chunk.choices)
        return text
    except openai.APIError:
        return "error"


def test_api_keys_authenticate_own_their_sessions_and_never_reach_redis_in_plaintext(
    replicas: list[Gateway], module_redis: RedisServer
) -> None:
    a, b = replicas
    alice, bob = create_key(module_redis.url, "alice"), create_key(module_redis.url, "bob")
    with a.http() as anonymous:
        for headers in ({}, bearer("sk-not-a-key"), {"Authorization": "Basic abc"}):
            response = anonymous.get("/v1/models", headers=headers)
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert anonymous.get("/health").status_code == 200  # probes need no key
    session_id = a.openai(alice).completions.create(model=a.model, prompt=PROMPT, max_tokens=4).id
    with b.http() as client:
        listed = client.get("/v1/sessions", headers=bearer(alice)).json()
        assert listed["object"] == "list" and session_id in [s["id"] for s in listed["data"]]
        assert session_id not in [s["id"] for s in client.get("/v1/sessions", headers=bearer(bob)).json()["data"]]
        assert client.get(f"/v1/sessions/{session_id}", headers=bearer(bob)).status_code == 404
        assert client.delete(f"/v1/sessions/{session_id}", headers=bearer(bob)).status_code == 404
        assert client.get(f"/v1/sessions/{session_id}", headers=bearer(ADMIN)).json()["status"] == "finished"
    key_id = bob.split("-")[1]
    subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", "revoke", key_id, "--redis-url", module_redis.url], check=True
    )
    with b.http() as client:
        assert client.get("/v1/models", headers=bearer(bob)).status_code == 401
        assert client.get("/v1/models", headers=bearer(alice)).status_code == 200
    stored = _everything_in(module_redis.url)
    for plaintext in (alice, bob, ADMIN):
        assert plaintext not in stored and plaintext.split("-", 2)[-1] not in stored  # sg-<id>-<secret>


def _everything_in(url: str) -> str:
    """Every key and value in the Redis database, as one string."""
    client = redis.Redis.from_url(url, decode_responses=True)
    parts = []
    readers = {
        "string": client.get,
        "hash": client.hgetall,
        "set": client.smembers,
        "zset": lambda key: client.zrange(key, 0, -1),
        "list": lambda key: client.lrange(key, 0, -1),
        "stream": client.xrange,
    }
    for key in client.scan_iter():
        value = readers[str(client.type(key))](key)
        parts.append(f"{key}={value}")
    client.close()
    assert parts, "nothing was stored in Redis"
    return "\n".join(parts)


def _outside_minute_edge() -> None:
    """Per-minute windows are calendar minutes: don't start a count a moment before one ends."""
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)


def test_each_per_key_limit_trips_at_exactly_its_count(replicas: list[Gateway], module_redis: RedisServer) -> None:
    a, b = replicas
    _outside_minute_edge()
    rpm = create_key(module_redis.url, "rpm", "--requests-per-minute", "3")
    tpm = create_key(module_redis.url, "tpm", "--tokens-per-minute", "100")
    streams = create_key(module_redis.url, "streams", "--concurrent-streams", "1")
    with a.http() as client_a, b.http() as client_b:
        # Requests per minute, counted across both replicas.
        statuses = [
            (client_a if i % 2 else client_b).post(
                "/v1/completions", json=completion(a, max_tokens=2), headers=bearer(rpm)
            )
            for i in range(4)
        ]
        assert [r.status_code for r in statuses] == [200, 200, 200, 429]
        _assert_rate_limited(statuses[-1], "requests")
        # Tokens per minute: each request reserves 7 prompt + 40 completion tokens; the third would make 141 > 100.
        body = completion(a, max_tokens=40)
        statuses = [client_a.post("/v1/completions", json=body, headers=bearer(tpm)) for _ in range(3)]
        assert [r.status_code for r in statuses] == [200, 200, 429]
        _assert_rate_limited(statuses[-1], "tokens")
        # Concurrent streams: a second generation while the first runs is refused, and allowed once it ends.
        long_stream = completion(a, max_tokens=CONTEXT - len(PROMPT), stream=True)
        with client_a.stream("POST", "/v1/completions", json=long_stream, headers=bearer(streams)) as running:
            session_id = running.headers["x-session-id"]
            next(sse_events(running))
            refused = client_b.post("/v1/completions", json=completion(a, max_tokens=2), headers=bearer(streams))
            assert refused.status_code == 429
            _assert_rate_limited(refused, "requests")
            assert client_b.delete(f"/v1/sessions/{session_id}", headers=bearer(streams)).status_code == 200
        again = client_b.post("/v1/completions", json=completion(a, max_tokens=2), headers=bearer(streams))
        assert again.status_code == 200, again.text


def _assert_rate_limited(response: httpx.Response, kind: str) -> None:
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", kind)
    assert int(response.headers["retry-after"]) >= 1


async def test_a_cancellation_storm_leaves_no_session_on_nodes_or_in_redis_within_seconds(
    replicas: list[Gateway], module_swarm: LocalSwarm, client_p2p: P2P
) -> None:
    """200 concurrent streams, each client gone once its first event came (its session running): within 5 s of the
    last one leaving (the 2 s resume grace included) a new request succeeds, no node holds a session and no session
    is running in Redis."""
    a, b = replicas
    body = completion(a, max_tokens=30, stream=True)  # 200 x 37 tokens fit the nodes' 8192-token pools
    before = {session["id"] for session in _all_sessions(a)}  # earlier tests' (they may expire meanwhile)
    http = httpx.AsyncClient(
        base_url=a.url, trust_env=False, timeout=60, headers=bearer(ADMIN), limits=httpx.Limits(max_connections=250)
    )

    async def dropped() -> bool:
        """Whether the stream started; leaving the block drops the connection mid-generation."""
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return True
        return False

    # Each client leaves at its first event, not after a fixed time: how many sessions a storm starts must not hang
    # on how loaded the machine is.
    dropped_mid_stream = await asyncio.gather(*(dropped() for _ in range(200)))
    await http.aclose()
    assert all(dropped_mid_stream)
    assert len([s for s in _all_sessions(a) if s["id"] not in before]) == 200
    began = time.monotonic()
    async with b.async_http() as client:
        response = await client.post("/v1/completions", json=completion(b, max_tokens=3), headers=bearer(ADMIN))
        assert response.status_code == 200, response.text
        infos = await wait_all_free(client_p2p, module_swarm, within=5.0)
        assert all(i.sessions == 0 and i.cache_tokens_left == i.cache_tokens_total for i in infos), infos
        while time.monotonic() - began < 5:
            listed = (await client.get("/v1/sessions?limit=1000", headers=bearer(ADMIN))).json()["data"]
            if not any(s["status"] == "running" for s in listed):
                break
            await asyncio.sleep(0.2)
        assert not [s["id"] for s in listed if s["status"] == "running"]
    assert time.monotonic() - began < 5 + 2  # + the checks' own time on a loaded machine


def _all_sessions(gateway: Gateway) -> list[dict[str, object]]:
    with gateway.http(headers=bearer(ADMIN)) as client:
        data: list[dict[str, object]] = client.get("/v1/sessions?limit=1000").json()["data"]
        return data


def test_a_frozen_redis_costs_a_request_at_most_its_socket_timeout_and_ready_says_so(
    replicas: list[Gateway], module_redis: RedisServer
) -> None:
    a, _ = replicas
    body = completion(a, max_tokens=3)
    with a.http(headers=bearer(ADMIN)) as client:
        began = time.monotonic()
        assert client.post("/v1/completions", json=body).status_code == 200
        normal = time.monotonic() - began
        module_redis.freeze()
        try:
            began = time.monotonic()
            frozen = client.post("/v1/completions", json=body)
            took = time.monotonic() - began
            assert frozen.status_code == 200, frozen.text
            assert client.get("/ready").json()["redis"] == "down"
        finally:
            module_redis.thaw()
        # One socket timeout (0.5 s) marks Redis down; after that no call waits on it. Generous for a loaded machine.
        assert took < normal + 5, (took, normal)
        deadline = time.monotonic() + 15
        while client.get("/ready").json()["redis"] != "up" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/ready").json()["redis"] == "up"
        record = client.get(f"/v1/sessions/{frozen.json()['id']}").json()
        assert record["status"] == "finished"  # written through once Redis answered again


def test_redis_killed_mid_stream_leaves_it_to_complete_and_is_written_through_when_back(
    replicas: list[Gateway], module_redis: RedisServer
) -> None:
    a, b = replicas
    body = completion(a, max_tokens=150, stream=True)
    with a.http(headers=bearer(ADMIN)) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            session_id = response.headers["x-session-id"]
            events = sse_events(response)
            first = [next(events) for _ in range(5)]
            module_redis.stop()
            rest = list(events)
        assert rest[-1].data == "[DONE]"
        assert sum(1 for event in first + rest[:-1] if chunk_text(event)) == 150  # every token, no error event
        ready = client.get("/ready").json()
        assert ready["redis"] == "down"
        # New requests are served meanwhile (the operator key needs no Redis).
        assert client.post("/v1/completions", json=completion(a, max_tokens=3)).status_code == 200
        module_redis.start()
        deadline = time.monotonic() + 15
        while client.get("/ready").json()["redis"] != "up" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/ready").json()["redis"] == "up"
    with b.http(headers=bearer(ADMIN)) as other:
        # Replica A's tee writes the events it held through once Redis is back, then the record says "finished".
        def written_through() -> bool:
            record = other.get(f"/v1/sessions/{session_id}")
            return record.status_code == 200 and record.json()["status"] == "finished"

        wait_until(written_through, within=30)
        record = other.get(f"/v1/sessions/{session_id}")
        assert (record.json()["status"], record.json()["completion_tokens"]) == ("finished", 150)
        with other.stream("GET", f"/v1/sessions/{session_id}/events", timeout=20) as replay:
            assert [event.data for event in sse_events(replay)] == [event.data for event in first + rest]


def test_a_stream_still_running_when_the_drain_time_runs_out_ends_with_an_error_then_done(
    replicas: list[Gateway], module_swarm: LocalSwarm, chat_model: TinyModel
) -> None:
    """SIGTERM, and the stream outlives ``--drain-timeout``: the gateway stops it with an error event and ``[DONE]``
    before the server stops, not a connection cut mid-stream, and still exits 0 within drain + 10 s, its log free of
    tracebacks (the cut logged uvicorn's "Exception in ASGI application"; a p2p stream handler cancelled at exit,
    Python 3.11.7's ``StreamReaderProtocol`` alarm: ``shared.exit``)."""
    gateway = start_gateway(module_swarm, chat_model.folder, "--api-keys", ADMIN, "--no-verify", "--drain-timeout", "1")
    body = completion(gateway, max_tokens=600, stream=True)
    with gateway.http(headers=bearer(ADMIN)) as client, client.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
        first = [next(events) for _ in range(3)]
        gateway.process.send(signal.SIGTERM)
        rest = list(events)
    assert rest[-1].data == "[DONE]"
    error = json.loads(rest[-2].data)["error"]
    assert "shutting down" in error["message"] and error["code"] == "shutting_down", error
    assert sum(1 for event in first + rest[:-2] if chunk_text(event)) < 600  # stopped, not finished
    assert gateway.process.popen.wait(1 + 10) == 0
    assert "Traceback" not in gateway.log_text(), gateway.log_text()[-3000:]  # uvicorn's cut logged one


def test_sigterm_drains_the_gateway_running_streams_finish_new_requests_get_503(replicas: list[Gateway]) -> None:
    _, b = replicas
    body = completion(b, max_tokens=600, stream=True)  # long enough to still run when the signal comes
    with b.http(headers=bearer(ADMIN)) as client, client.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
        first = [next(events) for _ in range(3)]
        b.process.send(signal.SIGTERM)
        wait_until(lambda: client.get("/ready").status_code == 503, within=15)  # draining
        refused = client.post("/v1/completions", json=completion(b, max_tokens=2))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert client.get("/ready").status_code == 503
        rest = list(events)
    assert rest[-1].data == "[DONE]"
    assert sum(1 for event in first + rest[:-1] if chunk_text(event)) == 600  # finished, not cut
    b.process.popen.wait(30 + 10)  # within --drain-timeout (default 30 s) + 10 s
    assert b.process.popen.returncode == 0
