#!/usr/bin/env python3
"""`swarmgate-healthcheck`: the image's HEALTHCHECK, for whichever command the container runs.

One image runs the gateway, swarm nodes and the DHT bootstrap, so the check looks at the container's main command
(/proc/1/cmdline, through `docker run --init`'s tini too): for `gateway serve` it asks GET /health on the gateway's
port; for `swarm_node serve --metrics-port P` GET /health on P (the node's own liveness endpoint); otherwise for
`swarm_node` it opens a TCP connection to the fixed port of its first --host-maddrs, if it has one. Any other command
counts as healthy. Flags win over SWARMGATE_* env vars, as in the commands themselves.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import urllib.request
from collections.abc import Mapping, Sequence

TCP_PORT = re.compile(r"^/ip[46]/[^/]+/tcp/(\d+)")


def flag_values(argv: Sequence[str], flag: str) -> list[str] | None:
    """The values after `flag` (up to the next --flag), or None when it is absent; `--flag=v` counts too."""
    for index, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return [arg.split("=", 1)[1]]
        if arg == flag:
            values: list[str] = []
            for value in argv[index + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
            return values
    return None


def plan(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, int] | None:
    """What to check: ("http", port) for a gateway, ("tcp", port) for a node or DHT, None for nothing."""
    names = [os.path.basename(arg) for arg in argv]
    if "gateway" in names and "serve" in names:
        port = flag_values(argv, "--port")
        return "http", int(port[0] if port else env.get("SWARMGATE_PORT", "8000"))
    if "swarm_node" in names and "serve" in names:
        metrics = flag_values(argv, "--metrics-port")
        metrics_port = int(metrics[0] if metrics else env.get("SWARMGATE_METRICS_PORT", "0") or "0")
        if metrics_port:
            return "http", metrics_port
    if "swarm_node" in names:
        maddrs = flag_values(argv, "--host-maddrs")
        if maddrs is None:
            maddrs = json.loads(env.get("SWARMGATE_HOST_MADDRS", "[]"))
        match = TCP_PORT.match(maddrs[0]) if maddrs else None
        if match and int(match.group(1)) != 0:
            return "tcp", int(match.group(1))
    return None


def check(kind: str, port: int) -> None:
    if kind == "http":
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as response:
            if response.status != 200:
                raise OSError(f"/health answered {response.status}")
    else:
        socket.create_connection(("127.0.0.1", port), timeout=4).close()


def main() -> None:
    with open("/proc/1/cmdline", "rb") as file:
        argv = [arg.decode() for arg in file.read().split(b"\0") if arg]
    target = plan(argv, os.environ)
    if target is None:
        return
    try:
        check(*target)
    except OSError as error:
        sys.exit(f"unhealthy: {target[0]} check on port {target[1]}: {error}")


if __name__ == "__main__":
    main()
