"""A real `swarm_node serve` process, driven over hivemind P2P: sessions, forward, info, and every typed refusal."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2

from gateway.swarm.chain_session import NodeSession
from gateway.swarm.routing import Hop
from shared.errors import (
    BadRequest,
    PositionOutOfRange,
    ProtocolMismatch,
    RemoteError,
    UnknownSession,
    WrongSpan,
)
from shared.wire import (
    FORWARD_HANDLER,
    INFERENCE_HANDLER,
    INFO_HANDLER,
    PROTOCOL_VERSION,
    ErrorReply,
    ForwardRequest,
    InfoRequest,
    NodeInfo,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    decode_server_message,
    encode_request,
)
from tests.helpers.processes import LocalSwarm
from tests.helpers.raw_stream import RawStream
from tests.tiny_models import NUM_LAYERS

pytestmark = pytest.mark.timeout(300)

HIDDEN = 64


def assert_error(reply: object, expected: type[RemoteError]) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert isinstance(reply.to_exception(), expected), reply


def open_message(**overrides: int) -> runtime_pb2.ExpertRequest:
    fields = {"protocol": PROTOCOL_VERSION, "start": 0, "end": NUM_LAYERS, "max_length": 16} | overrides
    return encode_request(OpenSession(**fields))


async def node_info(p2p: P2P, peer: str) -> NodeInfo:
    response = await p2p.call_protobuf_handler(
        PeerID.from_base58(peer), INFO_HANDLER, encode_request(InfoRequest()), runtime_pb2.ExpertResponse
    )
    info, _ = decode_server_message(response)
    assert isinstance(info, NodeInfo)
    return info


async def wait_for_room(p2p: P2P, peer: str, expected: int) -> NodeInfo:
    for _ in range(100):
        info = await node_info(p2p, peer)
        if info.cache_tokens_left == expected and info.sessions == 0:
            return info
        await asyncio.sleep(0.1)
    return info


async def test_malformed_requests_get_typed_errors_and_the_stream_keeps_serving(
    client_p2p: P2P, node_peer: str
) -> None:
    good_hidden = torch.randn(1, 3, HIDDEN)
    async with RawStream(client_p2p, node_peer) as stream:
        reply, _ = await stream.send(runtime_pb2.ExpertRequest(metadata=b"{not json"))
        assert_error(reply, BadRequest)
        reply, _ = await stream.send(encode_request(Step(position=0), (good_hidden,)))
        assert_error(reply, UnknownSession)
        reply, _ = await stream.send(open_message(protocol=PROTOCOL_VERSION + 1))
        assert_error(reply, ProtocolMismatch)
        reply, _ = await stream.send(open_message(end=NUM_LAYERS + 1))
        assert_error(reply, WrongSpan)

        reply, _ = await stream.send(open_message())
        assert isinstance(reply, SessionOpened)
        bad_steps = [
            (Step(position=0), (torch.randn(1, 3, HIDDEN + 1),), BadRequest),  # wrong hidden size
            (Step(position=0), (torch.randn(3, HIDDEN),), BadRequest),  # wrong rank
            (Step(position=0), (torch.ones(1, 3, HIDDEN, dtype=torch.int64),), BadRequest),  # wrong dtype
            (Step(position=0), (torch.full((1, 3, HIDDEN), float("nan")),), BadRequest),
            (Step(position=0), (), BadRequest),  # no tensor
            (Step(position=14), (good_hidden,), PositionOutOfRange),  # a gap after 0 tokens
            (Step(position=0), (torch.randn(1, 17, HIDDEN),), PositionOutOfRange),  # beyond max_length 16
        ]
        for message, tensors, expected in bad_steps:
            reply, _ = await stream.send(encode_request(message, tensors))
            assert_error(reply, expected)
        oversized = encode_request(Step(position=0), (good_hidden,))
        oversized.tensors[0].size[:] = [1, 1 << 20, 1 << 20]  # declares far more than it carries
        reply, _ = await stream.send(oversized)
        assert_error(reply, BadRequest)

        reply, tensors = await stream.send(encode_request(Step(position=0), (good_hidden,)))
        assert isinstance(reply, StepResult)
        assert tensors[0].shape == good_hidden.shape and torch.isfinite(tensors[0]).all()


async def test_interleaved_sessions_equal_each_alone_and_forward(client_p2p: P2P, node_peer: str) -> None:
    torch.manual_seed(0)
    prompts = [torch.randn(1, 5, HIDDEN), torch.randn(1, 3, HIDDEN)]
    steps = [[torch.randn(1, 1, HIDDEN) for _ in range(4)] for _ in prompts]
    hop = Hop(node_peer, 0, NUM_LAYERS)

    async def run_alone(index: int) -> list[torch.Tensor]:
        session = NodeSession(client_p2p, hop, max_length=16, step_timeout=60)
        await session.open()
        outputs = [await session.step(prompts[index], 0)]
        for offset, hidden in enumerate(steps[index]):
            outputs.append(await session.step(hidden, prompts[index].shape[1] + offset))
        await session.close()
        return outputs

    alone = [await run_alone(0), await run_alone(1)]
    sessions = [NodeSession(client_p2p, hop, max_length=16, step_timeout=60) for _ in prompts]
    for session in sessions:
        await session.open()
    interleaved: list[list[torch.Tensor]] = [[], []]
    for index, session in enumerate(sessions):
        interleaved[index].append(await session.step(prompts[index], 0))
    for offset in range(4):
        for index, session in enumerate(sessions):
            interleaved[index].append(await session.step(steps[index][offset], prompts[index].shape[1] + offset))
    for session in sessions:
        await session.close()
    for got, want in zip(interleaved, alone, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

    # The stateless forward of the whole sequence agrees with the session's prefill + decode steps.
    sequence = torch.cat([prompts[0], *steps[0]], dim=1)
    response = await client_p2p.call_protobuf_handler(
        PeerID.from_base58(node_peer),
        FORWARD_HANDLER,
        encode_request(ForwardRequest(protocol=PROTOCOL_VERSION, start=0, end=NUM_LAYERS), (sequence,)),
        runtime_pb2.ExpertResponse,
    )
    _, (forward_out,) = decode_server_message(response)
    torch.testing.assert_close(forward_out, torch.cat(alone[0], dim=1), rtol=1e-5, atol=1e-5)


async def test_cache_room_comes_back_after_close_and_after_a_dropped_stream(client_p2p: P2P, node_peer: str) -> None:
    info = await wait_for_room(client_p2p, node_peer, 300)
    assert info.cache_tokens_total == 300 and info.cache_tokens_left == 300

    session = NodeSession(client_p2p, Hop(node_peer, 0, NUM_LAYERS), max_length=200, step_timeout=60)
    await session.open()
    info = await node_info(client_p2p, node_peer)
    assert info.cache_tokens_left == 100 and info.sessions == 1
    # A second session that does not fit is refused with a typed, retryable error.
    too_big = NodeSession(client_p2p, Hop(node_peer, 0, NUM_LAYERS), max_length=150, step_timeout=60)
    with pytest.raises(RemoteError) as refused:
        await too_big.open()
    assert refused.value.code == "cache_full" and refused.value.retryable
    await too_big.close()
    await session.close()
    assert (await wait_for_room(client_p2p, node_peer, 300)).cache_tokens_left == 300

    # A client that vanishes without closing: its stream ends and the node frees the room.
    async with RawStream(client_p2p, node_peer) as stream:
        reply, _ = await stream.send(open_message(max_length=120))
        assert isinstance(reply, SessionOpened)
        assert (await node_info(client_p2p, node_peer)).cache_tokens_left == 180
    assert (await wait_for_room(client_p2p, node_peer, 300)).cache_tokens_left == 300


async def test_truncate_rolls_back_exactly_keeps_the_room_and_refuses_past_what_is_held(
    client_p2p: P2P, node_peer: str
) -> None:
    """Speculative drafts the gateway rejects are forgotten with a typed truncate: later steps compute what they
    would have without the drafts, the session's room is untouched (a resize gives it back exactly), and a truncate
    past the stored tokens is refused."""
    await wait_for_room(client_p2p, node_peer, 300)
    torch.manual_seed(1)
    prompt, drafts, token = torch.randn(1, 5, HIDDEN), torch.randn(1, 4, HIDDEN), torch.randn(1, 1, HIDDEN)
    hop = Hop(node_peer, 0, NUM_LAYERS)
    plain = NodeSession(client_p2p, hop, max_length=16, step_timeout=60)
    await plain.open()
    await plain.step(prompt, 0)
    await plain.step(drafts[:, :1], 5)
    expected = await plain.step(token, 6)
    await plain.close()

    session = NodeSession(client_p2p, hop, max_length=16, step_timeout=60)
    await session.open()
    await session.step(prompt, 0)
    await session.step(drafts, 5)  # holds 9 tokens; the last three drafts are rejected
    await session.truncate(6)
    assert (await node_info(client_p2p, node_peer)).cache_tokens_left == 300 - 16  # the room stays the session's
    with pytest.raises(PositionOutOfRange):
        await session.truncate(7)  # only 6 are held now
    # the draft kept was computed in a 4-position step, not a decode step: equal within float tolerance
    torch.testing.assert_close(await session.step(token, 6), expected, rtol=1e-5, atol=1e-5)
    await session.resize(7)
    assert (await node_info(client_p2p, node_peer)).cache_tokens_left == 300 - 7
    await session.close()
    assert (await wait_for_room(client_p2p, node_peer, 300)).cache_tokens_left == 300


async def test_a_tree_step_and_its_kept_branch_over_the_wire(client_p2p: P2P, node_peer: str) -> None:
    """A tree step's branch equals its chain alone; the next step keeps it (``branch``) and goes on as the chain
    does; a truncate keeps a branch too; malformed trees and branches are refused with typed errors."""
    await wait_for_room(client_p2p, node_peer, 300)
    torch.manual_seed(2)
    prompt, tree, token = torch.randn(1, 5, HIDDEN), torch.randn(1, 4, HIDDEN), torch.randn(1, 1, HIDDEN)
    parents = [-1, 0, 0, 2]  # the fed token, two drafts below it, one below the second: branch 0, 2, 3
    hop = Hop(node_peer, 0, NUM_LAYERS)
    chain = NodeSession(client_p2p, hop, max_length=16, step_timeout=60)
    await chain.open()
    await chain.step(prompt, 0)
    alone = await chain.step(tree[:, [0, 2, 3]], 5)
    expected = await chain.step(token, 8)
    await chain.close()

    session = NodeSession(client_p2p, hop, max_length=16, step_timeout=60)
    await session.open()
    await session.step(prompt, 0)
    both = await session.step(tree, 5, tree=parents)
    torch.testing.assert_close(both[:, [0, 2, 3]], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(PositionOutOfRange):
        await session.step(token, 8, branch=[8, 6])  # not ascending
    torch.testing.assert_close(await session.step(token, 8, branch=[7, 8]), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(BadRequest):
        await session.step(tree, 9, tree=[-1, 2, 0, 1])  # a parent after its child
    await session.step(tree, 9, tree=parents)
    await session.truncate(12, branch=[11, 12])  # the fed token at 9, then the branch 11, 12
    await session.close()


# -- fuzzing: seeded random, truncated and ill-typed messages over the real node ---------------------------------

FUZZ_SEED = 20261129
ILL_TYPED: list[object] = [
    {"type": "step", "position": -1},
    {"type": "step", "position": "0"},
    {"type": "step", "position": 1e30},
    {"type": "step", "position": 10**30},
    {"type": "step"},
    {"type": "step", "position": 0, "extra": 1},
    {"type": "nope"},
    {"type": "open", "protocol": PROTOCOL_VERSION, "start": 0, "end": NUM_LAYERS, "max_length": 8},  # a second one
    {"type": "open", "protocol": PROTOCOL_VERSION, "start": 0, "end": NUM_LAYERS, "max_length": -5},
    {"type": "resize", "max_length": 0},
    {"type": "resize", "max_length": 10**12},
    {"type": "truncate", "length": -1},
    {"type": "truncate", "length": 10**6},
    [],
    42,
    None,
    "step",
]


def mutate_tensor(rng: random.Random, proto: runtime_pb2.Tensor) -> None:
    """Tensor metadata that does not match its buffer, or that no node takes."""
    elements = len(proto.buffer) // 4
    choice = rng.randrange(7)
    if choice == 0:
        proto.dtype = rng.choice(["int64", "float64", "bool", "complex64", "uint8", "", "float32 "])
    elif choice == 1:
        proto.size[:] = [rng.randrange(2**32) for _ in range(rng.randrange(6))]
    elif choice == 2:
        proto.size[:] = rng.choice(
            [[1, 3, HIDDEN + 1], [3, HIDDEN], [1, 3 * HIDDEN], [1, 1, 3, HIDDEN], [3, 1, HIDDEN]]
        )
    elif choice == 3:
        proto.buffer = bytes(proto.buffer)[: rng.randrange(len(proto.buffer))]
    elif choice == 4:
        proto.compression = rng.choice([c for c in runtime_pb2.CompressionType.values() if c])
    elif choice == 5:
        proto.size[:] = rng.choice([[2**32 - 1] * 3, [1, 1 << 20, 1 << 20], [1 << 16, 1 << 16]])  # huge, no bytes
    else:  # a wire dtype whose bytes are another's: half the buffer as float16
        proto.dtype, proto.buffer = "float16", bytes(proto.buffer)[: elements * 2]


def fuzzed_requests(
    rng: random.Random, valid: runtime_pb2.ExpertRequest, count: int
) -> Iterator[runtime_pb2.ExpertRequest]:
    for _ in range(count):
        request = runtime_pb2.ExpertRequest()
        request.CopyFrom(valid)
        kind = rng.randrange(5)
        if kind == 0:
            request.metadata = rng.randbytes(rng.randrange(1, 300))
        elif kind == 1:
            request.metadata = valid.metadata[: rng.randrange(len(valid.metadata))]
        elif kind == 2:
            request.metadata = json.dumps(rng.choice(ILL_TYPED)).encode()
        elif kind == 3:
            mutate_tensor(rng, request.tensors[0])
        elif rng.random() < 0.5:
            del request.tensors[:]  # no tensor
        else:
            request.tensors.extend(valid.tensors[:] * rng.randrange(1, 3))  # several
        yield request


def assert_typed_refusal(reply: object) -> None:
    """A refusal with a code that says what was wrong: never the node's internal_error."""
    assert isinstance(reply, ErrorReply), reply
    assert reply.code != "internal_error", reply
    reply.to_exception()  # a known code


async def reference_step(p2p: P2P, peer: str, hidden: torch.Tensor) -> torch.Tensor:
    session = NodeSession(p2p, Hop(peer, 0, NUM_LAYERS), max_length=16, step_timeout=60)
    await session.open()
    try:
        return await session.step(hidden, 0)
    finally:
        await session.close()


async def test_fuzzed_rpcs_get_typed_refusals_and_the_node_keeps_serving_right_answers(
    client_p2p: P2P, node_peer: str, module_swarm: LocalSwarm
) -> None:
    rng = random.Random(FUZZ_SEED)
    hidden = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(FUZZ_SEED))
    before = await reference_step(client_p2p, node_peer, hidden)
    peer = PeerID.from_base58(node_peer)

    async with RawStream(client_p2p, node_peer) as stream:  # one session's stream, 150 bad messages through it
        reply, _ = await stream.send(open_message())
        assert isinstance(reply, SessionOpened)
        for request in fuzzed_requests(rng, encode_request(Step(position=0), (hidden,)), 150):
            reply, _ = await stream.send(request)
            assert_typed_refusal(reply)
        reply, (output,) = await stream.send(encode_request(Step(position=0), (hidden,)))
        assert isinstance(reply, StepResult) and torch.equal(output, before)

    forward = encode_request(ForwardRequest(protocol=PROTOCOL_VERSION, start=0, end=NUM_LAYERS), (hidden,))
    info = encode_request(InfoRequest(), (hidden,))  # info takes no tensor, but its decoding checks any it gets
    for handler, valid, count in ((FORWARD_HANDLER, forward, 40), (INFO_HANDLER, info, 20)):
        for request in fuzzed_requests(rng, valid, count):
            response = await client_p2p.call_protobuf_handler(peer, handler, request, runtime_pb2.ExpertResponse)
            reply, _ = decode_server_message(response)
            if isinstance(reply, NodeInfo):  # well-formed tensors it has no use for: answered all the same
                assert request.metadata == valid.metadata
                continue
            assert_typed_refusal(reply)

    # Below our messages: protobuf bytes cut short, and frames that lie about their length or type.
    serialized = forward.SerializeToString()
    for _ in range(10):
        with pytest.raises(P2PHandlerError):  # the node's protobuf parser refuses it; the call fails, not the node
            await client_p2p._client.call_unary_handler(peer, FORWARD_HANDLER, serialized[: rng.randrange(1, 60)])
    frames = [
        P2P.MESSAGE_MARKER + len(serialized).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + serialized[:40],  # then EOF
        P2P.MESSAGE_MARKER + (2**63).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 64,  # a huge length
        b"\x07" + rng.randbytes(64),  # no such frame type
        P2P.MESSAGE_MARKER + (20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\xff" * 20,  # not protobuf
    ]
    for frame in frames:
        _, reader, writer = await client_p2p.call_binary_stream_handler(peer, INFERENCE_HANDLER)
        writer.write(frame)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 30)  # the node ends the stream (an RPCError at most)
        writer.close()

    assert all(process.popen.poll() is None for process in module_swarm.processes)
    assert (await wait_for_room(client_p2p, node_peer, 300)).sessions == 0
    assert torch.equal(await reference_step(client_p2p, node_peer, hidden), before)
