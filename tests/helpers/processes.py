"""Real swarm processes on 127.0.0.1 for integration tests: a DHT bootstrap, nodes, and their logs.

Every process is started with ``python -m`` from this interpreter, logs to a file under the test's tmp folder, and
is killed when the ``LocalSwarm`` closes, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from transformers import PreTrainedTokenizerFast

from tests.helpers.launcher import ProcessHandle, spawn

SERVING = re.compile(r"serving blocks (\d+):(\d+) as (\w+)")
# Every test's nodes and gateways keep a GGUF file's converted config and tokenizer in one folder (entries are keyed
# by the file and the transformers version, written under a lock): a conversion costs a node some 8 CPU seconds at
# start. Tests of the cache itself give --config-cache a folder of their own.
CONFIG_CACHE = Path(tempfile.gettempdir()) / "swarmgate-test-configs"


@dataclass
class ManagedProcess:
    name: str
    popen: ProcessHandle
    log: Path
    peer_id: str = ""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def send(self, sig: int) -> None:
        """SIGTERM/SIGINT go to the process (a graceful stop); other signals to its whole group, DHT child and
        p2pd included, as when a machine dies or freezes."""
        if self.popen.poll() is not None:
            return
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.popen.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(self.popen.pid) != self.popen.pid:  # killpg would signal nobody, silently
                raise RuntimeError(f"{self.name} has no process group of its own: start it with start_new_session")
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0) -> int:
        self.send(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


@dataclass
class LocalSwarm:
    workdir: Path
    processes: list[ManagedProcess] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    fork: bool = True  # start processes from the tests' launcher (``tests.helpers.launcher``), not fresh interpreters

    def serving_nodes(self) -> list[ManagedProcess]:
        """The nodes seen serving (``wait_serving`` read their peer id), whether or not they still run."""
        return [process for process in self.processes if process.peer_id]

    def _spawn(self, name: str, args: list[str], wrapper: tuple[str, ...] = ()) -> ManagedProcess:
        log = self.workdir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "SWARMGATE_THROUGHPUT_CACHE": str(self.workdir / "throughput.json"),
            "SWARMGATE_CONFIG_CACHE": str(CONFIG_CACHE),
        }
        process = ManagedProcess(name, spawn(args, env, log, fork=self.fork, wrapper=wrapper), log)
        self.processes.append(process)
        return process

    def start_dht(self, *extra: str, timeout: float = 60.0, host: str = "127.0.0.1") -> str:
        """``host``: the address it listens on (and whose multiaddrs become ``initial_peers``)."""
        log = self.workdir / "dht.stdout"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        args = ["swarm_node.cli", "dht", "--host-maddrs", f"/ip4/{host}/tcp/0", *extra]
        popen = spawn(args, env, log, stderr=self.workdir / "dht.log", fork=self.fork)
        self.processes.append(ManagedProcess("dht", popen, self.workdir / "dht.log"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [line for line in log.read_text().splitlines() if line.startswith(f"/ip4/{host}/")]
            if lines:
                self.initial_peers = lines
                return lines[0]
            if popen.poll() is not None:
                raise RuntimeError(f"swarm_node dht exited with {popen.returncode}")
            time.sleep(0.1)
        raise TimeoutError("swarm_node dht printed no multiaddr")

    def start_node(
        self, model: str | Path, blocks: str, *extra: str, name: str | None = None, wrapper: tuple[str, ...] = ()
    ) -> ManagedProcess:
        """``wrapper``: a command the node runs under (e.g. ``ip netns exec NS`` to put it behind a NAT)."""
        args = ["swarm_node.cli", "serve", str(model), "--blocks", blocks, "--num-threads", "1"]
        args += ["--initial-peers", *self.initial_peers, *extra]
        return self._spawn(name or f"node-{blocks.replace(':', '-')}-{len(self.processes)}", args, wrapper)

    def start_nodes(self, model: str | Path, spans: Iterable[str], *extra: str) -> list[ManagedProcess]:
        """One node per span, all started before any is waited for (they load side by side), then serving."""
        nodes = [self.start_node(model, span, *extra) for span in spans]
        for node in nodes:
            self.wait_serving(node)
        return nodes

    def wait_serving(self, node: ManagedProcess, timeout: float = 180.0) -> str:
        """Block until the node logs that it serves; returns its peer id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = SERVING.search(node.log_text())
            if match:
                node.peer_id = match.group(3)
                return node.peer_id
            if node.popen.poll() is not None:
                raise RuntimeError(f"{node.name} exited with {node.popen.returncode}:\n{node.log_text()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{node.name} did not start serving:\n{node.log_text()[-3000:]}")

    def close(self) -> None:
        for process in reversed(self.processes):
            family = _children(process.popen.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.popen.pid, signal.SIGKILL)  # the DHT child and p2pd too
            # Should a process have no group of its own (started by hand, not by a helper here), killpg misses it and
            # waiting on it would wait for ever.
            process.popen.kill()
            process.popen.wait()
            for child in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            psutil.wait_procs(family, timeout=10)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def save_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the tiny model's vocabulary (tokens ``t0 … t{V-1}``), so the engine can load it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
