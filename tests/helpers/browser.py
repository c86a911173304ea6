"""Headless Chromium driven over the DevTools protocol, through a pipe: no WebDriver, no websocket library.

With ``--remote-debugging-pipe`` Chromium reads protocol messages (JSON, each ended by a NUL byte) from fd 3 and
writes replies and events to fd 4. One page target is attached in flat mode, so page commands carry its session
id. Hostname resolution is mapped away from everything but loopback and background networking is off: the
browser reaches nothing beyond this machine.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

QUIET_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-domain-reliability",
    "--disable-sync",
    "--disable-extensions",
    "--no-pings",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, executable: str, width: int = 1200, height: int = 800) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="swarmgate-chromium-", ignore_cleanup_errors=True)
        to_browser, self._send_fd = _high(os.pipe())
        self._recv_fd, from_browser = _high(os.pipe())
        command = f'exec "$@" 3<&{to_browser} 4>&{from_browser}'  # the protocol fds Chromium expects
        flags = [*QUIET_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self._profile.name}", "about:blank"]
        self.log = Path(self._profile.name) / "chromium.log"
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(
                ["bash", "-c", command, "bash", executable, *flags],
                pass_fds=(to_browser, from_browser),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its renderer and helper processes go with it on close
            )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        try:
            os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise RuntimeError(f"Chromium is gone:\n{self.log.read_text(errors='replace')[-3000:]}") from None
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, self._session, **params)

    def open(self, url: str) -> None:
        self.page("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        reply = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Until ``expression`` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"never true in the page: {expression}")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def pixel(self, x: float, y: float) -> tuple[int, int, int]:
        """The colour on screen at (x, y) CSS pixels: a 1×1 screenshot of that spot."""
        clip = {"x": x, "y": y, "width": 1, "height": 1, "scale": 1}
        png = base64.b64decode(self.page("Page.captureScreenshot", format="png", clip=clip)["data"])
        return _single_pixel(png)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        os.close(self._send_fd)
        os.close(self._recv_fd)
        self._profile.cleanup()

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._recv_fd], [], [], remaining)[0]:
                raise TimeoutError("no reply from Chromium")
            chunk = os.read(self._recv_fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed its pipe:\n{self.log.read_text(errors='replace')[-3000:]}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        parsed: dict[str, Any] = json.loads(message)
        return parsed


def _high(fds: tuple[int, int]) -> tuple[int, int]:
    """The pipe's ends moved to fds >= 10 (bash redirects those; dash takes one digit only), so that redirecting
    them onto fds 3 and 4 cannot clobber one another."""
    moved = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds)
    for fd in fds:
        os.close(fd)
    return moved[0], moved[1]


def _single_pixel(png: bytes) -> tuple[int, int, int]:
    """RGB of a 1×1, 8-bit RGB or RGBA PNG. With one pixel per row, every PNG filter leaves the bytes as they are."""
    offset, data, color_type = 8, b"", None
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset : offset + 4])
        kind, body = png[offset + 4 : offset + 8], png[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color_type = struct.unpack(">IIBB", body[:10])
            if (width, height, depth) != (1, 1, 8) or color_type not in (2, 6):
                raise ValueError(f"not a 1x1 8-bit RGB(A) PNG: {width}x{height}, depth {depth}, type {color_type}")
        elif kind == b"IDAT":
            data += body
        offset += 12 + length
    row = zlib.decompress(data)
    return row[1], row[2], row[3]  # row[0] is the filter type
