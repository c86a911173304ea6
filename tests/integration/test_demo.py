"""`make demo` stops everything once, whatever arrives while it stops (issue 24).

`make` forwards the SIGTERM its process group gets to `scripts/demo.py`, which so hears it twice; an impatient user
presses Ctrl-C during the cleanup. The demo is started for real (the DHT, two SmolLM2 nodes, the gateway on a free
port), signalled that way, and afterwards none of its processes may be left and none of their ports taken.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers.polling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
STARTUP = 600.0  # seconds: the demo's own start-up timeout (two nodes load the GGUF; a first run measures speed)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening_ports(processes: list[psutil.Process]) -> set[int]:
    ports = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            for conn in process.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    ports.add(conn.laddr.port)
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_demo_stops_everything_once_whatever_arrives_while_it_stops(tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    with out.open("wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "scripts/demo.py", "--port", str(_free_port())],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a process group of its own, as `make demo` has in a terminal
        )
    tree: list[psutil.Process] = []

    def said(text: str) -> bool:
        if demo.poll() is not None:
            raise AssertionError(f"the demo exited with {demo.returncode}:\n{out.read_text(errors='replace')}")
        return text in out.read_text(errors="replace")

    try:
        wait_until(lambda: said("The swarm is ready"), within=STARTUP, every=1.0)
        tree = list(psutil.Process(demo.pid).children(recursive=True))
        ports = _listening_ports(tree)
        assert len(ports) >= 4, f"expected the gateway's and three p2pd's ports, got {ports}"  # noqa: PLR2004

        os.killpg(demo.pid, signal.SIGTERM)  # the group's SIGTERM...
        wait_until(lambda: said("stopping"), within=60)
        os.killpg(demo.pid, signal.SIGTERM)  # ...and make's copy of it, arriving while the demo stops
        demo.send_signal(signal.SIGINT)  # and a second Ctrl-C
        demo.wait(120)

        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"
        assert all(_port_free(port) for port in ports), [port for port in ports if not _port_free(port)]
        assert out.read_text().rstrip().endswith("stopped")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.kill()
