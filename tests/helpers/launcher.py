"""Start the tests' node, DHT and gateway processes by forking one that has already imported their libraries.

A tiny-model node spends ~5 of its ~6 CPU seconds to serving importing torch, transformers and hivemind, and a
test run starts some two hundred such processes on two cores: a quarter of ``make test``'s CPU time. A launcher
process (one per pytest worker) imports those third-party libraries once, runs no thread, and forks a child per
request; the child takes the request's environment, working folder and log files, becomes the leader of a session
of its own (as ``start_new_session``), and runs ``python -m MODULE ARGS`` with ``runpy``. So each child is a real
process of its own, started from the same command line: only the third-party imports are not redone (none of
``gateway``, ``swarm_node`` or ``shared`` is imported before the fork). It exits as a Python process exits (threads
joined, ``atexit`` hooks run, multiprocessing's children reaped).

Python's own ``multiprocessing.forkserver`` starts Python functions as ``multiprocessing`` children, not command
lines with their own environment, logs and session, so it does not fit. Tests of how a process starts or exits
(``test_process_exit``, the node start-up tests, the demo) start real interpreters: ``LocalSwarm(fork=False)``.
``SWARMGATE_TEST_LAUNCHER=0`` turns the launcher off for a whole run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

# Third-party modules the launcher imports before forking (each child imports the rest itself). The environment
# variables these read when imported are set the same way in every test's processes (``LAUNCHER_ENVIRONMENT``).
PRELOADED = [
    "torch",
    "numpy",
    "transformers",
    "transformers.modeling_utils",
    "hivemind",
    "hivemind.p2p",
    "safetensors",
    "tokenizers",
    "fastapi",
    "uvicorn",
    "sse_starlette",
    "httpx",
    "prometheus_client",
    "redis.asyncio",
    "llguidance",
    "psutil",
]
LAUNCHER_ENVIRONMENT = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
START_TIMEOUT = 120.0  # seconds for the launcher to import its libraries and listen


class ProcessHandle(Protocol):
    """What tests use of ``subprocess.Popen``."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class LaunchedProcess:
    """A launcher's child, as ``subprocess.Popen`` shows one: the launcher reaps it and sends its exit status
    (negative for a signal, as ``Popen.returncode``) on the connection the request came on."""

    def __init__(self, connection: socket.socket, pid: int, args: list[str]) -> None:
        self._connection = connection
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._read(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped child's pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        readable, _, _ = select.select([self._connection], [], [], timeout)
        if not readable:
            return None
        message = _read_line(self._connection)
        self._connection.close()
        if message is None:
            raise RuntimeError(f"the test launcher went away before process {self.pid} exited")
        self.returncode = int(json.loads(message)["returncode"])
        return self.returncode


class Launcher:
    """The client side: starts the launcher on first use and stops it when this process exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._path = Path()
        atexit.register(self._stop)

    def spawn(self, args: list[str], env: dict[str, str], stdout: Path, stderr: Path | None = None) -> LaunchedProcess:
        """``python -m *args`` in a child of the launcher; output to ``stdout`` (and ``stderr``, else
        the same file)."""
        self._ensure_started()
        for log in (stdout, stderr):
            if log is not None:
                log.write_bytes(b"")  # there, empty, once this returns (as with Popen): callers read it at once
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(str(self._path))
        request = {"args": args, "env": env, "cwd": os.getcwd(), "stdout": str(stdout), "stderr": str(stderr or "")}
        connection.sendall(json.dumps(request).encode() + b"\n")
        reply = _read_line(connection)
        if reply is None:
            raise RuntimeError(f"the test launcher did not start {args}")
        return LaunchedProcess(connection, int(json.loads(reply)["pid"]), [sys.executable, "-m", *args])

    def _ensure_started(self) -> None:
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            # a folder of its own each start: a dead launcher's socket file is never taken for a live one
            self._path = Path(tempfile.mkdtemp(prefix="swarmgate-launcher-")) / "socket"
            log = self._path.with_name("launcher.log").open("ab")
            env = {**os.environ, **LAUNCHER_ENVIRONMENT}
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.launcher", str(self._path)], stdout=log, stderr=log, env=env
            )
            deadline = time.monotonic() + START_TIMEOUT
            while not self._path.exists():
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the test launcher did not start: see {log.name}")
                time.sleep(0.05)

    def _stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(10)


_launcher = Launcher()


def spawn(
    args: list[str],
    env: dict[str, str],
    stdout: Path,
    stderr: Path | None = None,
    fork: bool = True,
    wrapper: tuple[str, ...] = (),
) -> ProcessHandle:
    """``python -m *args`` in a session of its own, output to ``stdout`` (``stderr`` too unless given): a child of
    the launcher where ``fork`` and the run allow it, else a fresh interpreter, run under ``wrapper`` (a command
    such as ``ip netns exec NS``: always a fresh interpreter) if given."""
    if fork and not wrapper and os.environ.get("SWARMGATE_TEST_LAUNCHER", "1") != "0":
        return _launcher.spawn(args, env, stdout, stderr)
    with stdout.open("wb") as out, open(stderr or os.devnull, "wb") as err:
        return subprocess.Popen(
            [*wrapper, sys.executable, "-m", *args],
            stdout=out,
            stderr=err if stderr else subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _read_line(connection: socket.socket) -> str | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            return None
        data += chunk
    return data.decode()


# The launcher's side -------------------------------------------------------------------------------------------


def serve(path: str) -> None:
    for name in PRELOADED:
        __import__(name)
    ours = sorted(m for m in sys.modules if m.split(".")[0] in ("gateway", "swarm_node", "shared"))
    if ours or threading.active_count() != 1:  # a fork would carry them over: the children would not be fresh
        raise RuntimeError(f"the launcher imported {ours} or runs threads: {threading.enumerate()}")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the client waits for the path: it exists once we listen
    children: dict[int, socket.socket] = {}
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # Ctrl-C reaches the test run's whole group: stop as on SIGTERM
    while not stopping and os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            request = _read_line(connection)
            if request is not None:
                pid = _fork(json.loads(request), [listener, connection, *children.values()])
                children[pid] = connection
                connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(children)
    for pid in children:  # the test run is over: nothing it started outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()


def _fork(request: dict[str, Any], launchers: list[socket.socket]) -> int:
    """``launchers``: the launcher's sockets, closed in the child."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for launcher_socket in launchers:
            launcher_socket.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND) if request["stderr"] else out
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # What a fresh interpreter takes from its environment at start: PYTHONPATH's folders, after sys.path[0].
        for folder in reversed([f for f in os.environ.get("PYTHONPATH", "").split(os.pathsep) if f]):
            if folder not in sys.path:
                sys.path.insert(1, folder)
        import numpy

        numpy.random.seed()  # numpy's global generator is not reseeded at fork (``random``'s is)
        code = _run(request["args"])
    finally:
        os._exit(code)


def _run(args: list[str]) -> int:
    """``python -m args[0] args[1:]`` to its end, then what the interpreter does when its main module returns."""
    import runpy
    import traceback

    sys.argv = [args[0], *args[1:]]
    code = 0
    try:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            sys.stderr.write(f"{exit_.code}\n")
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads joined, as at an interpreter's exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:  # killed by SIGINT's default handler: die by it, as the interpreter does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    serve(sys.argv[1])
