"""A real `gateway serve` subprocess on 127.0.0.1 (any free port), and clients that never leave the machine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil

from tests.helpers.launcher import spawn
from tests.helpers.processes import CONFIG_CACHE, LocalSwarm, ManagedProcess

LISTENING = re.compile(r"serving (\S+) on (http://127\.0\.0\.1:\d+)/v1")


@dataclass
class Gateway:
    process: ManagedProcess
    url: str  # http://127.0.0.1:PORT
    model: str  # the API's model id

    def log_text(self) -> str:
        return self.process.log_text()

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until GET /ready?swarm=complete answers 200: every block is served by a live node."""
        deadline = time.monotonic() + timeout
        with self.http() as client:
            while time.monotonic() < deadline:
                # The port is bound (and logged) a moment before uvicorn listens on it: refused means not yet.
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/ready", params={"swarm": "complete"}).status_code == 200:
                        return
                time.sleep(0.3)
        raise TimeoutError(f"gateway never became ready:\n{self.log_text()[-3000:]}")

    def http(self, **kwargs: object) -> httpx.Client:
        # trust_env=False: no proxy from the environment may carry loopback traffic elsewhere.
        return httpx.Client(base_url=self.url, trust_env=False, timeout=120, **kwargs)  # type: ignore[arg-type]

    def async_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=120)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        http_client = httpx.Client(trust_env=False, timeout=120)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, http_client=http_client)

    def async_openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        http_client = httpx.AsyncClient(trust_env=False, timeout=120)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, http_client=http_client)


def start_gateway(
    swarm: LocalSwarm, model: str | Path, *extra: str, wait_ready: bool = True, timeout: float = 180.0
) -> Gateway:
    """Start `gateway serve MODEL` against the swarm's DHT; wait until it listens (and, by default, is ready)."""
    gateway = _wait_listening(spawn_gateway(swarm, model, *extra), timeout)
    if wait_ready:
        gateway.wait_ready(timeout)
    return gateway


def spawn_gateway(swarm: LocalSwarm, model: str | Path, *extra: str) -> ManagedProcess:
    """`gateway serve MODEL` against the swarm's DHT, started and not waited on (it stops with the swarm)."""
    log = swarm.workdir / f"gateway-{len(swarm.processes)}.log"
    # No Redis unless a test gives one (--redis-url): the machine's own Redis may hold other sessions' keys.
    args = ["gateway.cli", "serve", str(model), "--port", "0", "--num-threads", "1", "--redis-url", ""]
    # No chat kept open between turns unless a test asks (a later flag wins): tests count node sessions going to 0.
    args += ["--conversation-keep-alive", "0"]
    args += ["--initial-peers", *swarm.initial_peers, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["SWARMGATE_CONFIG_CACHE"] = str(CONFIG_CACHE)
    # Its own session, as the nodes': ManagedProcess.send(SIGKILL/SIGSTOP) signals its group.
    process = ManagedProcess("gateway", spawn(args, env, log, fork=swarm.fork), log)
    swarm.processes.append(process)
    return process


def _wait_listening(process: ManagedProcess, timeout: float) -> Gateway:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = LISTENING.search(process.log_text())
        if match and _accepts_connections(match.group(2)):
            return Gateway(process, match.group(2), match.group(1))
        if process.popen.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.popen.returncode}:\n{process.log_text()[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"gateway did not start listening:\n{process.log_text()[-3000:]}")


def _accepts_connections(url: str) -> bool:
    # The port is bound (and logged) a moment before uvicorn listens on it: a refused connection means not yet.
    try:
        httpx.get(f"{url}/health", trust_env=False, timeout=5)
    except httpx.TransportError:
        return False
    return True


def stop_gracefully(swarm: LocalSwarm, timeout: float = 20.0) -> None:
    """SIGTERM every process at once and wait; then kill whatever is left, children included.

    Killing a node or gateway outright would orphan the DHT process hivemind forks for it (and that process's
    p2pd daemon), which then runs on, stealing CPU from every later test.
    """
    descendants = {process.popen.pid: _descendants(process.popen.pid) for process in swarm.processes}
    for process in reversed(swarm.processes):
        process.send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in reversed(swarm.processes):
        try:
            process.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.popen.kill()
            process.popen.wait()
        _kill_all(descendants[process.popen.pid])


def kill_tree(process: ManagedProcess) -> None:
    """SIGKILL a process and everything it started: a crash that leaves nothing behind."""
    descendants = _descendants(process.popen.pid)
    process.popen.kill()
    process.popen.wait()
    _kill_all(descendants)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_all(processes: list[psutil.Process]) -> None:
    for child in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(processes, timeout=10)
