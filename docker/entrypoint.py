#!/usr/bin/env python3
"""Container entrypoint (`swarmgate-entrypoint CMD...`): learn the DHT bootstrap's address, then exec CMD.

The bootstrap's peer id is known only once its identity key exists, so a container learns it at start instead of
from its manifest. The bootstrap side writes a JSON list of multiaddrs (`swarmgate-identity --write-peers`); here we
read that list from one of

- ``SWARMGATE_BOOTSTRAP_FILE``: a path (docker compose shares the file through a read-only volume), or
- ``SWARMGATE_BOOTSTRAP_URL``: one or more http URLs, space-separated (each DHT bootstrap replica of the Helm chart
  serves its own file from a sidecar),

waiting up to ``SWARMGATE_BOOTSTRAP_TIMEOUT`` seconds (default 300) until at least one answers, and export every
address that answered as ``SWARMGATE_INITIAL_PEERS`` for the command: joining works while any bootstrap is up.
``SWARMGATE_BOOTSTRAP_OPTIONAL=1`` (the bootstrap replicas joining each other) asks each once and goes on with
whatever answered, possibly nothing; ``SWARMGATE_BOOTSTRAP_SKIP=HOST`` leaves out URLs of that host (a replica's
own). An ``SWARMGATE_INITIAL_PEERS`` already in the environment wins, so a pinned bootstrap (its peer id given in the
manifest) needs neither. Stdlib only: it runs before anything else.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, MutableMapping, Sequence

FILE_VAR = "SWARMGATE_BOOTSTRAP_FILE"
URL_VAR = "SWARMGATE_BOOTSTRAP_URL"
TIMEOUT_VAR = "SWARMGATE_BOOTSTRAP_TIMEOUT"
OPTIONAL_VAR = "SWARMGATE_BOOTSTRAP_OPTIONAL"
SKIP_VAR = "SWARMGATE_BOOTSTRAP_SKIP"
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
    return fetch_all([read], timeout)


def fetch_all(reads: Sequence[Callable[[], str]], timeout: float, optional: bool = False) -> list[str]:
    """Ask every source in turn until at least one gives a valid list (then return all that did in that round), or
    `timeout` seconds pass. ``optional``: one round, and whatever it gave, possibly nothing."""
    deadline = time.monotonic() + timeout
    while True:
        peers: list[str] = []
        errors: list[str] = []
        for read in reads:
            try:
                peers += [peer for peer in parse_peers(read()) if peer not in peers]
            except (OSError, ValueError, urllib.error.URLError) as error:
                errors.append(str(error))
        if peers or optional:
            return peers
        if time.monotonic() >= deadline:
            raise BootstrapUnavailable(f"no DHT bootstrap address after {timeout:.0f} s: {'; '.join(errors)}")
        time.sleep(RETRY_SECONDS)


def bootstrap_urls(value: str, skip: str) -> list[str]:
    """The URLs in `value` (space- or comma-separated), less those whose host is `skip` or starts with `skip.`."""
    urls = [url for url in value.replace(",", " ").split() if url]
    if not skip:
        return urls
    return [url for url in urls if not _host_is(urllib.parse.urlsplit(url).hostname or "", skip)]


def _host_is(host: str, name: str) -> bool:
    return host == name or host.startswith(name + ".")


def resolve_initial_peers(env: MutableMapping[str, str]) -> None:
    """Sets env[PEERS_VAR] from the bootstrap file or URL, unless it is already set or neither is given."""
    path, url = env.pop(FILE_VAR, ""), env.pop(URL_VAR, "")
    timeout = float(env.pop(TIMEOUT_VAR, "300"))
    optional = env.pop(OPTIONAL_VAR, "") not in ("", "0", "false")
    skip = env.pop(SKIP_VAR, "")
    if env.get(PEERS_VAR) or not (path or url):
        return
    if path:
        reads: list[Callable[[], str]] = [lambda: read_file(path)]
    else:
        reads = [_reader(one) for one in bootstrap_urls(url, skip)]
    peers = fetch_all(reads, timeout, optional)
    if not peers:
        sys.stderr.write("swarmgate-entrypoint: no other bootstrap answered; starting without initial peers\n")
        return
    env[PEERS_VAR] = json.dumps(peers)
    sys.stderr.write(f"swarmgate-entrypoint: joining the swarm through {', '.join(peers)}\n")


def _reader(url: str) -> Callable[[], str]:
    return lambda: read_url(url)


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
