"""A TCP proxy that adds latency: every chunk is held rtt/2 in each direction, pipelined.

These machines have no ``tc netem``. Each direction of a connection has a reader that timestamps every chunk as it
arrives and a writer that sends it once ``arrival + rtt/2`` has passed: chunks in flight overlap like packets on a
long link (a sleep per chunk would serialize them and turn latency into a bandwidth limit).

The delay is read from a control file (seconds of round-trip time, e.g. ``0.05``) every ``POLL`` seconds, so one set
of nodes can be measured at several RTTs without restarting them.

    python -m bench.latency_proxy --rtt-file /tmp/rtt 127.0.0.1:41001=127.0.0.1:42001 ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import deque
from pathlib import Path

logger = logging.getLogger(__name__)

POLL = 0.2  # seconds between reads of the control file
CHUNK = 1 << 16


class Delay:
    """The current one-way delay (half the RTT), from a control file."""

    def __init__(self, path: Path | None, rtt: float) -> None:
        self.path = path
        self.one_way = rtt / 2

    async def follow(self) -> None:
        while self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                self.one_way = float(self.path.read_text().strip() or 0) / 2
            await asyncio.sleep(POLL)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    loop = asyncio.get_running_loop()
    held: deque[tuple[float, bytes]] = deque()  # (due time, chunk), in arrival order
    arrived = asyncio.Event()
    done = False

    async def read() -> None:
        nonlocal done
        try:
            while chunk := await reader.read(CHUNK):
                held.append((loop.time() + delay.one_way, chunk))
                arrived.set()
        finally:
            done = True
            arrived.set()

    reading = asyncio.create_task(read())
    try:
        while True:
            if not held:
                if done:
                    break
                arrived.clear()
                await arrived.wait()
                continue
            due, chunk = held[0]
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            held.popleft()
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():  # a half-close travels on: the other direction stays open
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()  # a broken side ends both directions
    finally:
        reading.cancel()


async def _serve_connection(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, target: tuple[str, int], delay: Delay
) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(*target)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(
        _pipe(client_reader, server_writer, delay), _pipe(server_reader, client_writer, delay), return_exceptions=True
    )
    for writer in (client_writer, server_writer):
        with contextlib.suppress(Exception):
            writer.close()


async def serve(mappings: list[tuple[tuple[str, int], tuple[str, int]]], delay: Delay) -> None:
    servers = []
    for (host, port), target in mappings:

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter, target: tuple[str, int] = target) -> None:
            await _serve_connection(r, w, target, delay)

        servers.append(await asyncio.start_server(handle, host, port))
    print("ready", flush=True)  # noqa: T201 - the parent waits for this line
    await asyncio.gather(delay.follow(), *(s.serve_forever() for s in servers))


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mappings", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    parser.add_argument("--rtt", type=float, default=0.0, help="round-trip time added, seconds (default: 0)")
    parser.add_argument("--rtt-file", type=Path, default=None, help="file holding the RTT in seconds (polled)")
    args = parser.parse_args()
    mappings = [(_address(m.split("=")[0]), _address(m.split("=")[1])) for m in args.mappings]
    asyncio.run(serve(mappings, Delay(args.rtt_file, args.rtt)))


if __name__ == "__main__":
    main()
