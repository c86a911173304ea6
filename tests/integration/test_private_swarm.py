"""A private swarm on 127.0.0.1: outsiders are never routed to, records cannot be forged or overwritten, tokens are
checked and cannot be replayed."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest
import torch
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from gateway.swarm.chain_session import NodeSession
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from shared.dht_process import start_dht
from shared.dht_records import ModelRecord, NodeState, ServerRecord, block_key, fetch_servers
from shared.errors import Unauthorized
from shared.identity import new_identity
from shared.membership import CallAuth, make_call_token, owner_subkey, record_validators
from shared.model_source import resolve_model
from shared.rpc_client import fetch_info
from tests.helpers.gateway import start_gateway, stop_gracefully
from tests.helpers.polling import eventually
from tests.helpers.processes import LocalSwarm
from tests.integration.conftest import client_dht
from tests.tiny_models import NUM_LAYERS, GetTinyModel

pytestmark = pytest.mark.timeout(300)

SECRET = "private swarm secret for tests"
SPAN = f"0:{NUM_LAYERS}"


async def _store_raw(
    dht: DHT, node: DHTNode, *, key: str, subkey: bytes, value: dict[str, object], ttl: float = 30
) -> bool:
    return bool(await node.store(key, value, get_dht_time() + ttl, subkey=subkey))


async def _raw_subkeys(dht: DHT, node: DHTNode, *, key: str) -> list[bytes]:
    found = await node.get(key, latest=True)
    return list(found.value) if found is not None and isinstance(found.value, dict) else []


async def test_outsiders_are_ignored_and_members_cannot_forge_or_replay(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel
) -> None:
    folder: Path = tiny_model("llama").folder
    model = resolve_model(str(folder)).name
    local_swarm.start_dht("--swarm-secret", SECRET)
    member = local_swarm.start_node(folder, SPAN, "--swarm-secret", SECRET)
    outsider = local_swarm.start_node(folder, SPAN, "--swarm-secret", "a different secret entirely")
    stranger = local_swarm.start_node(folder, SPAN)  # no secret at all
    for node in (member, outsider, stranger):
        local_swarm.wait_serving(node)

    dht = client_dht(local_swarm.initial_peers, SECRET.encode())
    try:
        p2p = await dht.replicate_p2p()
        auth = CallAuth(SECRET.encode(), dht.peer_id.to_base58())

        async def member_online() -> bool:  # every node announced (JOINING) before it logged "serving"
            found = await fetch_servers(dht, model, NUM_LAYERS)
            return member.peer_id in found and found[member.peer_id].state is NodeState.ONLINE

        await eventually(member_online, within=30)
        servers = await fetch_servers(dht, model, NUM_LAYERS)
        assert set(servers) == {member.peer_id}

        router = Router(SwarmMonitor(dht, model, NUM_LAYERS, max_age=0.5), p2p, auth=auth)
        for _ in range(5):
            assert [hop.peer_id for hop in await router.route(16, fresh=True)] == [member.peer_id]

        # Overwriting the member's record under its own (owner-marked) subkey fails: we cannot sign as its owner.
        (member_subkey,) = await dht.run_coroutine(partial(_raw_subkeys, key=block_key(model, 0)), return_future=True)
        forged = servers[member.peer_id].model_copy(update={"state": NodeState.OFFLINE}).model_dump(mode="json")
        stored = await dht.run_coroutine(
            partial(_store_raw, key=block_key(model, 0), subkey=member_subkey, value=forged), return_future=True
        )
        assert not stored
        # A record claiming the member's identity under a plain subkey is refused by the schema of subkeys/owners.
        impostor = ServerRecord(
            peer_id=member.peer_id,
            start=0,
            end=NUM_LAYERS,
            state=NodeState.ONLINE,
            throughput=1e9,
            version="x",
            protocol=1,
        ).model_dump(mode="json")
        await dht.run_coroutine(
            partial(_store_raw, key=block_key(model, 0), subkey=b"someone-else", value=impostor), return_future=True
        )
        servers = await fetch_servers(dht, model, NUM_LAYERS)
        assert servers[member.peer_id].state is NodeState.ONLINE and servers[member.peer_id].throughput < 1e9

        # RPCs: no token, a token for another node, and a replayed token are refused; a fresh one works.
        hop = Hop(member.peer_id, 0, NUM_LAYERS)
        with pytest.raises(Unauthorized):
            await fetch_info(p2p, member.peer_id, 10)
        with pytest.raises(Unauthorized):
            await NodeSession(p2p, hop, 8, 10).open()
        other = CallAuth(SECRET.encode(), dht.peer_id.to_base58())
        wrong_callee = make_call_token(SECRET.encode(), dht.peer_id.to_base58(), outsider.peer_id)
        with pytest.raises(Unauthorized):
            await fetch_info(p2p, member.peer_id, 10, _FixedToken(wrong_callee))
        token = other.token_for(member.peer_id)
        info, _ = await fetch_info(p2p, member.peer_id, 10, _FixedToken(token))
        assert info.state == "online"
        with pytest.raises(Unauthorized, match="replayed"):
            await fetch_info(p2p, member.peer_id, 10, _FixedToken(token))
        session = NodeSession(p2p, hop, 8, 10, auth)
        await session.open()
        assert (await session.step(torch.randn(1, 2, 64), 0)).shape == (1, 2, 64)
        await session.close()
        await router.close()
    finally:
        dht.shutdown()


class _FixedToken(CallAuth):
    """Always presents the same token: what an eavesdropper replaying a captured request would send."""

    def __init__(self, token: str | None) -> None:
        super().__init__(None, "")
        self._token = token

    def token_for(self, callee: str) -> str | None:
        return self._token


async def test_a_member_cannot_announce_for_another_peer_id(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """A member holds the secret, so its records pass the MAC; a record it signs with its own key but that names
    another peer id is still dropped by every reader: the gateway and the other peers (a node choosing its span)."""
    folder: Path = tiny_with_tokenizer("llama").folder
    model = resolve_model(str(folder)).name
    local_swarm.start_dht("--swarm-secret", SECRET)
    victim = local_swarm.start_node(folder, SPAN, "--swarm-secret", SECRET)
    local_swarm.wait_serving(victim)

    # The forger runs as a member node does: a full DHT peer with the secret and its own bound identity.
    identity = new_identity()
    forger = start_dht(
        identity=identity,
        initial_peers=local_swarm.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        record_validators=record_validators(SECRET.encode(), (ServerRecord, ModelRecord), identity.key),
    )
    reader = client_dht(local_swarm.initial_peers, SECRET.encode())
    try:
        gateway = start_gateway(local_swarm, folder, "--swarm-secret", SECRET)
        real = (await fetch_servers(reader, model, NUM_LAYERS))[victim.peer_id]

        async def store(subkey: bytes, record: ServerRecord, ttl: float) -> bool:
            """Under every block of the span, as a node announces (readers keep a peer's last block's record)."""
            value = record.model_dump(mode="json")
            stored = []
            for block in record.blocks:
                job = partial(_store_raw, key=block_key(model, block), subkey=subkey, value=value, ttl=ttl)
                stored.append(bool(await forger.run_coroutine(job, return_future=True)))
            return all(stored)

        # Control: the member's own record, under its own peer id, is stored and read like any node's.
        own = real.model_copy(update={"peer_id": identity.peer_id, "state": NodeState.DRAINING})
        assert await store(owner_subkey(identity.peer_id), own, ttl=60)
        # The forgeries claim the victim's peer id, expire later than its real record (the newest would win) and
        # are signed by the forger's key and MAC'd with the secret; one also carries no owner at all.
        forged = real.model_copy(update={"state": NodeState.OFFLINE, "throughput": 1e9})
        await store(victim.peer_id.encode() + identity.owner_marker, forged, ttl=120)
        await store(victim.peer_id.encode(), forged, ttl=120)

        servers = await fetch_servers(reader, model, NUM_LAYERS)
        assert servers[identity.peer_id].state is NodeState.DRAINING
        assert servers[victim.peer_id].state is NodeState.ONLINE
        assert servers[victim.peer_id].throughput == real.throughput
        with gateway.http() as client:
            for _ in range(100):  # until the gateway's view holds the forger's own record (refreshed every 2 s)
                nodes = {node["peer_id"]: node for node in client.get("/v1/swarm").json()["nodes"]}
                if identity.peer_id in nodes:
                    break
                await asyncio.sleep(0.2)
        assert nodes[identity.peer_id]["state"] == "draining"
        assert nodes[victim.peer_id]["state"] == "online" and nodes[victim.peer_id]["throughput"] == real.throughput
    finally:
        reader.shutdown()
        forger.shutdown()
        stop_gracefully(local_swarm)  # the gateway is no process group leader: LocalSwarm.close cannot kill it
