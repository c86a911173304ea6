"""Reachability: how relay circuits are spelled to p2pd, whom a dial-back helper agrees to dial, and that a node
nobody can dial is not coverage."""

from __future__ import annotations

from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from gateway.swarm.view import SwarmView
from shared.dht_records import NodeState, ServerRecord
from shared.reachability import DialBackService, Reachability, circuit_addrs, maddr_bytes, peer_of

RELAY = "QmbCbBamjCm38RMf588cmzZhaNwGEYCs29EGPjgjzXsEPA"
NODE = "QmXVuxU3sBaLbyNaheMUw4BdC6sFhG7WUnxgTEUaczuYEs"


def test_a_circuit_is_spelled_with_raw_multihash_peer_ids_as_p2pd_parses_them() -> None:
    # /ip4/10.77.1.2 /tcp/31337 /p2p/<34-byte multihash, length 0x22> /p2p-circuit: the bytes p2pd accepted here.
    expected = "040a4d0102067a69a503221220bf174be13e29210d1a5294c06067cacc7cde518d2bf73dc253c9cd8a7240ae29a202"
    assert maddr_bytes(f"/ip4/10.77.1.2/tcp/31337/p2p/{RELAY}/p2p-circuit").hex() == expected
    full = maddr_bytes(f"/ip4/10.77.1.2/tcp/31337/p2p/{RELAY}/p2p-circuit/p2p/{NODE}")
    assert full.startswith(bytes.fromhex(expected)) and full.endswith(PeerID.from_base58(NODE).to_bytes())


def test_circuit_addresses_go_through_each_relay_to_the_node() -> None:
    relays = [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}", "/ip4/10.0.0.2/tcp/2"]  # the second names no peer: no circuit
    assert circuit_addrs(relays, NODE) == [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{NODE}"]
    assert peer_of(circuit_addrs(relays, NODE)[0]) == NODE


@dataclass
class _PeerInfo:
    peer_id: PeerID
    addrs: list[str]


@dataclass
class _FakeP2P:
    peer_id: PeerID
    peers: list[_PeerInfo] = field(default_factory=list)

    async def list_peers(self) -> list[_PeerInfo]:
        return self.peers


async def test_a_helper_dials_only_the_callers_own_ip_and_circuits_through_itself() -> None:
    caller = PeerID.from_base58(NODE)
    helper = _FakeP2P(PeerID.from_base58(RELAY), [_PeerInfo(caller, ["/ip4/10.1.2.3/tcp/4444"])])
    service = DialBackService(helper)  # type: ignore[arg-type]
    asked = [
        f"/ip4/10.1.2.3/tcp/5000/p2p/{NODE}",  # the IP the request came from: dialled
        f"/ip4/192.168.1.9/tcp/5000/p2p/{NODE}",  # a private address behind the NAT: never dialled
        "/ip4/10.1.2.3/tcp/22/p2p/QmSomeoneElse",  # another peer: refused
        f"/ip4/10.9.9.9/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{NODE}",  # a circuit through this helper: dialled
        f"/ip4/10.9.9.8/tcp/1/p2p/{NODE}/p2p-circuit/p2p/{NODE}",  # a circuit through a third party: refused
    ]
    assert await service._dialable(asked, NODE) == [asked[0], asked[3]]


def _record(peer: str, reach: Reachability) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=0, end=2, state=NodeState.ONLINE, reachability=reach, version="0", protocol=3
    )


def test_a_node_nobody_can_dial_is_not_coverage_but_a_relayed_one_is() -> None:
    unreachable = SwarmView(2, {"a": _record("a", Reachability.UNREACHABLE)})
    assert unreachable.online() == [] and unreachable.missing_blocks() == [0, 1]
    relayed = SwarmView(2, {"b": _record("b", Reachability.RELAYED)})
    assert [s.peer_id for s in relayed.online()] == ["b"] and relayed.missing_blocks() == []
