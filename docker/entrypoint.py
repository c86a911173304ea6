#!/usr/bin/env python3
"""Container entrypoint (`swarmgate-entrypoint CMD...`): learn the DHT bootstrap's address, then exec CMD.

The bootstrap's peer id is known only once its identity key exists, so a container learns it at start instead of
from its manifest. The bootstrap side writes a JSON list of multiaddrs (`swarmgate-identity --write-peers`); here we
read that list from one of

- ``SWARMGATE_BOOTSTRAP_FILE``: a path (docker compose shares the file through a read-only volume), or
- ``SWARMGATE_BOOTSTRAP_URL``: an http URL (the Helm chart's DHT pod serves the file from a sidecar),

waiting up to ``SWARMGATE_BOOTSTRAP_TIMEOUT`` seconds (default 300) while the bootstrap starts, and export it as
``SWARMGATE_INITIAL_PEERS`` for the command. An ``SWARMGATE_INITIAL_PEERS`` already in the environment wins, so a
pinned bootstrap (its peer id given in the manifest) needs neither. Stdlib only: it runs before anything else.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, MutableMapping

FILE_VAR = "SWARMGATE_BOOTSTRAP_FILE"
URL_VAR = "SWARMGATE_BOOTSTRAP_URL"
TIMEOUT_VAR = "SWARMGATE_BOOTSTRAP_TIMEOUT"
PEERS_VAR = "SWARMGATE_INITIAL_PEERS"
RETRY_SECONDS = 2.0


class BootstrapUnavailable(RuntimeError):
    """The bootstrap's multiaddrs could not be read before the deadline."""


def read_file(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def read_url(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:  # the URL comes from our own manifest
        return str(response.read().decode("utf-8"))


def parse_peers(text: str) -> list[str]:
    peers = json.loads(text)
    if not isinstance(peers, list) or not peers or not all(isinstance(p, str) and "/p2p/" in p for p in peers):
        raise ValueError(f"expected a non-empty JSON list of multiaddrs ending in /p2p/PEER_ID, got {text!r}")
    return peers


def fetch_peers(read: Callable[[], str], timeout: float) -> list[str]:
    """Retry `read` until it returns a valid list or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return parse_peers(read())
        except (OSError, ValueError, urllib.error.URLError) as error:
            if time.monotonic() >= deadline:
                raise BootstrapUnavailable(f"no DHT bootstrap address after {timeout:.0f} s: {error}") from error
        time.sleep(RETRY_SECONDS)


def resolve_initial_peers(env: MutableMapping[str, str]) -> None:
    """Sets env[PEERS_VAR] from the bootstrap file or URL, unless it is already set or neither is given."""
    path, url = env.pop(FILE_VAR, ""), env.pop(URL_VAR, "")
    timeout = float(env.pop(TIMEOUT_VAR, "300"))
    if env.get(PEERS_VAR) or not (path or url):
        return
    peers = fetch_peers((lambda: read_file(path)) if path else (lambda: read_url(url)), timeout)
    env[PEERS_VAR] = json.dumps(peers)
    sys.stderr.write(f"swarmgate-entrypoint: joining the swarm through {', '.join(peers)}\n")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: swarmgate-entrypoint COMMAND [ARG...]")
    try:
        resolve_initial_peers(os.environ)
    except BootstrapUnavailable as error:
        sys.exit(f"swarmgate-entrypoint: {error}")
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
