"""A private redis-server on a free 127.0.0.1 port, so a test may freeze or kill it without touching anyone else's."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError("redis-server is not installed (Debian package redis-server)")
        self.executable = executable
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.executable, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        log = (self.workdir / f"redis-{self.port}.log").open("wb")
        self.process = subprocess.Popen([*args, "--dir", str(self.workdir)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def freeze(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A private redis-server for the ``with`` block; killed after it, whatever happened."""
    server = RedisServer(workdir).start()
    try:
        yield server
    finally:
        server.stop()
