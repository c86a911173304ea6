"""The image's own scripts (docker/*.py): entrypoint, DHT identity, health check — run for real on 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.conftest import ROOT
from tests.helpers.redis_server import free_port

SCRIPTS = ROOT / "docker"
PEER = "/dns4/dht/tcp/31337/p2p/QmZthY59sbKQBei9ZVyaq52CT97Bnr9nLh7qW7GzKz11Ri"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"swarmgate_docker_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


entrypoint = load("entrypoint")
healthcheck = load("healthcheck")


@contextlib.contextmanager
def serve_folder(folder: Path, status: int = 200) -> Iterator[int]:
    """An HTTP server on 127.0.0.1 serving `folder` (or answering `status` to everything when it isn't 200)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            if status == 200:
                super().do_GET()
            else:
                self.send_error(status)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


# --- swarmgate-entrypoint ---------------------------------------------------------------------------------------


def test_entrypoint_reads_the_bootstrap_file(tmp_path: Path) -> None:
    peers = tmp_path / "initial-peers.json"
    peers.write_text(json.dumps([PEER]))
    env = {"SWARMGATE_BOOTSTRAP_FILE": str(peers)}
    entrypoint.resolve_initial_peers(env)
    assert env == {"SWARMGATE_INITIAL_PEERS": json.dumps([PEER])}


def test_entrypoint_fetches_the_bootstrap_url(tmp_path: Path) -> None:
    (tmp_path / "initial-peers.json").write_text(json.dumps([PEER]))
    with serve_folder(tmp_path) as port:
        env = {"SWARMGATE_BOOTSTRAP_URL": f"http://127.0.0.1:{port}/initial-peers.json"}
        entrypoint.resolve_initial_peers(env)
    assert json.loads(env["SWARMGATE_INITIAL_PEERS"]) == [PEER]


OTHER_PEER = "/dns4/dht-1/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_entrypoint_joins_through_every_bootstrap_that_answers(tmp_path: Path) -> None:
    """Several bootstrap replicas: every one that answers is an initial peer; one down does not stop the start."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, peer in ((first, PEER), (second, OTHER_PEER)):
        folder.mkdir()
        (folder / "initial-peers.json").write_text(json.dumps([peer]))
    with serve_folder(first) as a, serve_folder(second) as b:
        down = f"http://127.0.0.1:{free_port()}/initial-peers.json"
        urls = [down, f"http://127.0.0.1:{a}/initial-peers.json", f"http://127.0.0.1:{b}/initial-peers.json"]
        env = {"SWARMGATE_BOOTSTRAP_URL": " ".join(urls), "SWARMGATE_BOOTSTRAP_TIMEOUT": "0"}
        entrypoint.resolve_initial_peers(env)
    assert json.loads(env["SWARMGATE_INITIAL_PEERS"]) == [PEER, OTHER_PEER]


def test_a_bootstrap_replica_starts_alone_when_no_other_answers_and_skips_itself(tmp_path: Path) -> None:
    (tmp_path / "initial-peers.json").write_text(json.dumps([PEER]))
    with serve_folder(tmp_path) as port:
        own = f"http://localhost:{port}/initial-peers.json"  # this replica's own address: never its own peer
        env = {
            "SWARMGATE_BOOTSTRAP_URL": f"{own} http://127.0.0.1:{free_port()}/initial-peers.json",
            "SWARMGATE_BOOTSTRAP_OPTIONAL": "1",
            "SWARMGATE_BOOTSTRAP_SKIP": "localhost",
        }
        entrypoint.resolve_initial_peers(env)
    assert env == {}  # nothing answered but itself: it starts without initial peers, at once
    assert entrypoint.bootstrap_urls("http://dht-0.h.ns.svc:1/x http://dht-1.h.ns.svc:1/x", "dht-0.h.ns.svc") == [
        "http://dht-1.h.ns.svc:1/x"
    ]


def test_explicit_initial_peers_win(tmp_path: Path) -> None:
    env = {"SWARMGATE_INITIAL_PEERS": '["/ip4/127.0.0.1/tcp/1/p2p/x"]', "SWARMGATE_BOOTSTRAP_FILE": "/nonexistent"}
    entrypoint.resolve_initial_peers(env)
    assert env == {"SWARMGATE_INITIAL_PEERS": '["/ip4/127.0.0.1/tcp/1/p2p/x"]'}


@pytest.mark.parametrize("content", ["", "[]", '["/dns4/dht/tcp/31337"]', '{"peers": 1}', "not json"])
def test_entrypoint_gives_up_on_a_missing_or_bad_list(tmp_path: Path, content: str) -> None:
    peers = tmp_path / "initial-peers.json"
    if content:
        peers.write_text(content)
    env = {"SWARMGATE_BOOTSTRAP_FILE": str(peers), "SWARMGATE_BOOTSTRAP_TIMEOUT": "0"}
    with pytest.raises(entrypoint.BootstrapUnavailable):
        entrypoint.resolve_initial_peers(env)


def test_entrypoint_gives_up_on_an_http_error(tmp_path: Path) -> None:
    with serve_folder(tmp_path, status=503) as port:
        env = {"SWARMGATE_BOOTSTRAP_URL": f"http://127.0.0.1:{port}/x", "SWARMGATE_BOOTSTRAP_TIMEOUT": "0"}
        with pytest.raises(entrypoint.BootstrapUnavailable, match="503"):
            entrypoint.resolve_initial_peers(env)


def test_entrypoint_waits_for_the_file_to_appear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peers = tmp_path / "initial-peers.json"
    reads = []

    def read() -> str:
        reads.append(1)
        if len(reads) == 3:
            peers.write_text(json.dumps([PEER]))
        return entrypoint.read_file(str(peers))

    monkeypatch.setattr(entrypoint, "RETRY_SECONDS", 0.01)
    assert entrypoint.fetch_peers(read, timeout=30) == [PEER]
    assert len(reads) == 3


def test_entrypoint_execs_the_command_with_the_peers(tmp_path: Path) -> None:
    peers = tmp_path / "initial-peers.json"
    peers.write_text(json.dumps([PEER]))
    show = "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('SWARMGATE_')}))"
    env = {"PATH": os.environ["PATH"], "SWARMGATE_BOOTSTRAP_FILE": str(peers)}
    result = subprocess.run(
        [sys.executable, SCRIPTS / "entrypoint.py", sys.executable, "-c", show],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )
    # The helper variables are gone, so nothing downstream mistakes them for settings.
    assert json.loads(result.stdout) == {"SWARMGATE_INITIAL_PEERS": json.dumps([PEER])}


def test_entrypoint_fails_clearly_without_a_bootstrap(tmp_path: Path) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "SWARMGATE_BOOTSTRAP_FILE": str(tmp_path / "none.json"),
        "SWARMGATE_BOOTSTRAP_TIMEOUT": "0",
    }
    result = subprocess.run(
        [sys.executable, SCRIPTS / "entrypoint.py", "true"], capture_output=True, text=True, env=env, timeout=30
    )
    assert result.returncode == 1
    assert "no DHT bootstrap address" in result.stderr


# --- swarmgate-identity + swarm_node dht + entrypoint, end to end on loopback ------------------------------------


def run_identity(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str | Path) -> str:
    """`swarmgate-identity ARGS` in this process (its hivemind import costs seconds in a fresh one)."""
    identity = load("identity")
    monkeypatch.setattr(sys, "argv", ["swarmgate-identity", *map(str, args)])
    identity.main()
    return capsys.readouterr().out.strip()


def test_identity_is_created_once_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "identity.key"
    peer_id = run_identity(monkeypatch, capsys, key)
    assert peer_id.startswith("Qm") and key.stat().st_mode & 0o777 == 0o400
    assert run_identity(monkeypatch, capsys, key) == peer_id
    peers = tmp_path / "peers.json"
    announced = run_identity(monkeypatch, capsys, key, "--announce", "/dns4/dht/tcp/31337", "--write-peers", peers)
    assert announced == peer_id
    assert json.loads(peers.read_text()) == [f"/dns4/dht/tcp/31337/p2p/{peer_id}"]
    with pytest.raises(SystemExit):
        run_identity(monkeypatch, capsys, key, "--announce", "/dns4/dht/tcp/31337")


@contextlib.contextmanager
def spawned(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[str]]:
    with log.open("w") as err:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_bootstrap_with_a_kept_identity_is_joined_through_its_dns4_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The compose design in miniature: the key and published multiaddr from swarmgate-identity, the real
    `swarm_node dht` announcing a /dns4 address with that key, and members that learn it through the entrypoint."""
    port = free_port()
    key, peers = tmp_path / "identity.key", tmp_path / "initial-peers.json"
    announce = f"/dns4/localhost/tcp/{port}"
    peer_id = run_identity(monkeypatch, capsys, key, "--announce", announce, "--write-peers", peers)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dht_args = [str(bin_dir / "swarm_node"), "dht", "--identity-path", str(key)]
    dht_args += ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--announce-maddrs", announce]
    with spawned(dht_args, env, tmp_path / "dht.log") as dht:
        assert dht.stdout is not None
        printed = dht.stdout.readline().strip()
        assert printed == f"{announce}/p2p/{peer_id}", (tmp_path / "dht.log").read_text()
        assert json.loads(peers.read_text()) == [printed]
        member_env = {"SWARMGATE_BOOTSTRAP_FILE": str(peers)}
        entrypoint.resolve_initial_peers(member_env)
        assert_joinable(json.loads(member_env["SWARMGATE_INITIAL_PEERS"]))


def assert_joinable(initial_peers: list[str]) -> None:
    """Two peers that know only `initial_peers`: what one stores, the other finds."""
    from hivemind import DHT
    from hivemind.utils import get_dht_time

    kwargs = {"initial_peers": initial_peers, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False}
    writer = DHT(start=True, auto_nat=False, **kwargs)
    reader = DHT(start=True, client_mode=True, auto_nat=False, **kwargs)
    try:
        writer.store("deploy-test", "joined", get_dht_time() + 60)
        found = reader.get("deploy-test", latest=True)
        assert found is not None and found.value == "joined"
    finally:
        reader.shutdown()
        writer.shutdown()


# --- swarmgate-healthcheck ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["/opt/venv/bin/python", "/opt/venv/bin/gateway", "serve", "M", "--port", "9000"], {}, ("http", 9000)),
        (["/sbin/docker-init", "--", "swarmgate-entrypoint", "gateway", "serve", "M"], {}, ("http", 8000)),
        (["python", "gateway", "serve", "M", "--port=8080"], {"SWARMGATE_PORT": "1"}, ("http", 8080)),
        (["python", "gateway", "serve", "M"], {"SWARMGATE_PORT": "8123"}, ("http", 8123)),
        (["python", "gateway", "--help"], {}, None),
        (["swarm_node", "dht", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337", "--nat-port-map"], {}, ("tcp", 31337)),
        (["python", "swarm_node", "serve", "M", "--host-maddrs", "/ip6/::/tcp/4001"], {}, ("tcp", 4001)),
        (["python", "swarm_node", "serve", "M"], {"SWARMGATE_HOST_MADDRS": '["/ip4/0.0.0.0/tcp/5000"]'}, ("tcp", 5000)),
        (["python", "swarm_node", "serve", "M"], {}, None),
        (
            ["swarm_node", "serve", "M", "--metrics-port", "9100", "--host-maddrs", "/ip4/0.0.0.0/tcp/1"],
            {},
            ("http", 9100),
        ),  # noqa: E501
        (["swarm_node", "serve", "M"], {"SWARMGATE_METRICS_PORT": "9200"}, ("http", 9200)),
        (["python", "swarm_node", "serve", "M", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], {}, None),
        (["swarmgate-identity", "/var/lib/swarmgate/identity/identity.key"], {}, None),
    ],
)
def test_healthcheck_plan(argv: list[str], env: dict[str, str], expected: tuple[str, int] | None) -> None:
    assert healthcheck.plan(argv, env) == expected


def test_healthcheck_checks_http_and_tcp(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")
    with serve_folder(tmp_path) as port:
        healthcheck.check("http", port)  # GET /health → 200
        healthcheck.check("tcp", port)
    with serve_folder(tmp_path, status=503) as port, pytest.raises(OSError):
        healthcheck.check("http", port)
    with pytest.raises(OSError):
        healthcheck.check("tcp", free_port())
