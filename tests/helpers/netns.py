"""A home NAT built from network namespaces, for tests of nodes that nobody can dial.

    this machine's namespace            router namespace                     home namespace
    veth 10.213.K.1/24 ──────────── 10.213.K.2 │ 10.214.K.1 ──────────── 10.214.K.2/24, default via 10.214.K.1
    (bootstrap, gateway, public nodes)   MASQUERADE out, inbound dropped      (the volunteer's node)

The home side dials out and is answered; nothing dials in: this namespace has no route to 10.214.K.0/24, and the
router forwards only replies inward. The router and home namespaces have no other link, so nothing they send leaves
these three namespaces. The subnets are private ones (libp2p's DHT drops addresses that are neither private nor
public, such as the test ranges 198.18.0.0/15), checked to be unused here first. Needs root, ``ip`` and ``iptables``;
``available()`` says whether this machine can build it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class HomeNat:
    public_ip: str  # this namespace's end of the public link: bootstrap, gateway and public nodes listen here
    home_ip: str  # the volunteer's private address
    home_ns: str

    @property
    def wrapper(self) -> tuple[str, ...]:
        """Runs a command inside the home namespace."""
        return ("ip", "netns", "exec", self.home_ns)


def available() -> str | None:
    """None when a home NAT can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (apt-get install iproute2 iptables)"
    probe = f"sgprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False).returncode != 0:
        return "cannot create network namespaces here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


@contextlib.contextmanager
def home_nat() -> Iterator[HomeNat]:
    k = os.getpid() % 250 + 1
    router, home, uplink = f"sgrtr{k}", f"sghome{k}", f"sgpub{k}"
    public, router_up, router_down, home_ip = f"10.213.{k}.1", f"10.213.{k}.2", f"10.214.{k}.1", f"10.214.{k}.2"
    for subnet in (f"10.213.{k}.0/24", f"10.214.{k}.0/24"):
        used = subprocess.run(["ip", "route", "show", "match", subnet], capture_output=True, text=True, check=True)
        if any(not line.startswith("default") for line in used.stdout.splitlines()):
            raise RuntimeError(f"{subnet} is already routed on this machine: not building a test NAT over it")
    try:
        for ns in (router, home):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", uplink, "type", "veth", "peer", "name", "up0", "netns", router)
        _run("ip", "link", "add", "home0", "netns", home, "type", "veth", "peer", "name", "down0", "netns", router)
        _run("ip", "addr", "add", f"{public}/24", "dev", uplink)
        _run("ip", "link", "set", uplink, "up")
        _run("ip", "-n", router, "addr", "add", f"{router_up}/24", "dev", "up0")
        _run("ip", "-n", router, "addr", "add", f"{router_down}/24", "dev", "down0")
        _run("ip", "-n", home, "addr", "add", f"{home_ip}/24", "dev", "home0")
        for ns, dev in ((router, "up0"), (router, "down0"), (home, "home0")):
            _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", home, "route", "add", "default", "via", router_down)
        in_router = ("ip", "netns", "exec", router)
        _run(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"10.214.{k}.0/24", "-o", "up0", "-j",
             "MASQUERADE")  # fmt: skip
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "up0", "-o", "down0", "-m", "state", "--state",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "up0", "-o", "down0", "-j", "DROP")
        yield HomeNat(public, home_ip, home)
    finally:
        subprocess.run(["ip", "link", "del", uplink], capture_output=True, check=False)
        for ns in (home, router):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
