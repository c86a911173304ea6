"""The node's message decoding under fuzzing: any bytes, any tensor metadata — decoded, or refused as ``BadRequest``.

The same over a real node process, with the node answering and staying up, is in tests/integration/test_node_rpc.py.
"""

from __future__ import annotations

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import BadRequest
from shared.wire import (
    MAX_WIRE_ELEMENTS,
    WIRE_DTYPES,
    ForwardRequest,
    Step,
    decode_batch_step,
    decode_client_message,
    decode_tensors,
    decode_unary,
    encode_request,
)

FUZZ = settings(max_examples=300, derandomize=True, deadline=None)
VALID = encode_request(Step(position=3), (torch.randn(1, 2, 8),))
DTYPES = st.sampled_from([*WIRE_DTYPES, "int64", "float64", "bool", "complex64", "uint8", "", "float32\x00"])
SIZES = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 9), max_size=5)


def decoded_or_refused(request: runtime_pb2.ExpertRequest) -> None:
    """Decoding gives well-formed tensors (their bytes match their shape) or raises BadRequest — nothing else."""
    for decode in (decode_client_message, decode_batch_step, lambda r: decode_unary(r, ForwardRequest)):
        try:
            _, tensors = decode(request)
        except BadRequest:
            continue
        for tensor, proto in zip(tensors, request.tensors, strict=True):
            assert list(tensor.shape) == list(proto.size) and tensor.numel() <= MAX_WIRE_ELEMENTS


@FUZZ
@given(st.binary(max_size=300))
def test_random_metadata_bytes(metadata: bytes) -> None:
    decoded_or_refused(runtime_pb2.ExpertRequest(metadata=metadata, tensors=VALID.tensors))


@FUZZ
@given(st.integers(0, len(VALID.metadata) - 1))
def test_truncated_metadata(cut: int) -> None:
    decoded_or_refused(runtime_pb2.ExpertRequest(metadata=VALID.metadata[:cut], tensors=VALID.tensors))


@FUZZ
@given(st.data())
def test_wrong_tensor_metadata(data: st.DataObject) -> None:
    proto = runtime_pb2.Tensor()
    proto.CopyFrom(serialize_torch_tensor(torch.randn(1, 2, 8)))
    if data.draw(st.booleans()):
        proto.dtype = data.draw(DTYPES)
    if data.draw(st.booleans()):
        proto.size[:] = data.draw(SIZES)
    if data.draw(st.booleans()):
        buffer = bytes(proto.buffer)
        cut = data.draw(st.integers(0, len(buffer) + 16))
        proto.buffer = buffer[:cut] if cut <= len(buffer) else buffer + bytes(cut - len(buffer))
    if data.draw(st.booleans()):
        proto.compression = data.draw(st.sampled_from(list(runtime_pb2.CompressionType.values())))
    if data.draw(st.booleans()):
        proto.chunks = data.draw(st.integers(-(2**31), 2**31 - 1))
    decoded_or_refused(runtime_pb2.ExpertRequest(metadata=VALID.metadata, tensors=[proto]))


def test_huge_declared_sizes_are_refused_before_allocating() -> None:
    for size in ([2**32 - 1] * 3, [1, 1 << 20, 1 << 20], [MAX_WIRE_ELEMENTS + 1]):
        proto = runtime_pb2.Tensor(dtype="float32", size=size, buffer=b"\0" * 16)
        try:
            decode_tensors([proto])
        except BadRequest as refused:
            assert "out of bounds" in str(refused)
        else:
            raise AssertionError(f"size {size} was accepted")


def test_open_session_names_an_adapter_only_when_it_has_one() -> None:
    """Nodes from before adapters forbid unknown fields: a base-model open must not carry the field."""
    from shared.wire import OpenSession, decode_client_message, encode_request

    base = encode_request(OpenSession(protocol=4, start=0, end=2, max_length=8))
    assert b"adapter" not in base.metadata
    adapted = encode_request(OpenSession(protocol=4, start=0, end=2, max_length=8, adapter="sql"))
    message, _ = decode_client_message(adapted)
    assert isinstance(message, OpenSession) and message.adapter == "sql"


def test_steps_and_truncates_name_a_tree_or_branch_only_when_they_have_one() -> None:
    """Nodes from before trees forbid unknown fields: a plain step or truncate must not carry them."""
    from shared.wire import Step, TruncateSession, decode_client_message, encode_request

    assert b"tree" not in encode_request(Step(position=3)).metadata
    assert b"branch" not in encode_request(Step(position=3)).metadata
    assert b"branch" not in encode_request(TruncateSession(length=3)).metadata
    message, _ = decode_client_message(encode_request(Step(position=3, tree=[-1, 0, 0], branch=[5, 7])))
    assert isinstance(message, Step) and message.tree == [-1, 0, 0] and message.branch == [5, 7]
    message, _ = decode_client_message(encode_request(TruncateSession(length=9, branch=[8, 11])))
    assert isinstance(message, TruncateSession) and message.branch == [8, 11]
