"""The node's wire protocol: typed messages inside hivemind's protobuf envelope.

Every RPC carries a ``runtime_pb2.ExpertRequest`` / ``ExpertResponse``: ``metadata`` is one JSON message validated by
the pydantic models below, ``tensors`` are hidden states serialized by hivemind. Three handlers:

* ``inference`` (stream ↔ stream): ``OpenSession`` → ``SessionOpened``; then ``Step`` + hidden [1, T, D] →
  ``StepResult`` + hidden [1, T, D]; ``ResizeSession`` → ``SessionResized`` grows or shrinks the session's room (its
  stored positions kept); ``TruncateSession`` → ``SessionTruncated`` drops the stored positions from ``length`` on
  (a gateway's rejected speculative drafts; refused past what the session holds; the session's room is unchanged);
  the session's KV cache lives until ``CloseSession`` or the stream ends.
* ``batch`` (stream ↔ stream): ``BatchStep`` + hidden [B, 1, D] → ``BatchStepResult`` + hidden [B, 1, D]: one decode
  step for each of B sessions the caller opened on its inference streams, in one message each way. A gateway whose
  streams step together (they do: its LM head scores them as one batch) sends one message per node instead of B,
  and the node's batcher gets all B rows at once instead of waiting for them to trickle in. A row that fails (its
  session closed, a bad position) carries its own ``ErrorReply``; the other rows are answered.
  Node-to-node push: a row may name the rest of its chain (``next``: each later node's peer id and session id);
  the node then pushes its output straight to the next node as well as answering. The gateway asks every later node
  with a ``pushed`` batch step (no tensor): the node answers each row once its step has run, with the output and the
  input it ran on ([B, 1, D] each), so the gateway keeps every hop's inputs for failover replay. A token costs
  gateway → A → B → gateway (1.5 round trips) instead of a relay through the gateway per node.
* ``push`` (stream ↔ stream, node to node): ``PushStep`` + hidden [B, 1, D] → ``PushAccepted``. Only a session's
  opener, or the predecessor it named (``OpenSession.pusher``, ``AllowPush``), may push into it: a session id is a
  secret bound to those peers; anyone else gets ``PushRefused``. A step reaching a node by push and from the gateway
  runs once (``swarm_node.step_slots``).
* ``forward`` (unary): ``ForwardRequest`` + hidden [B, T, D] → ``ForwardResult`` + hidden, no state kept.
* ``info`` (unary): ``InfoRequest`` → ``NodeInfo``.

Every step reply is signed by the node that ran it (``receipt``: ``shared.receipts``), with the step key its
``SessionOpened`` certified. Any request may be answered by ``ErrorReply`` with a typed code (``shared.errors``);
the node keeps serving.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
)

from shared.errors import BadRequest, RemoteError, error_from_code
from shared.receipts import StepKeyCertificate

# 2: ResizeSession; 3: the batch handler; 4: node-to-node push; 5: TruncateSession;
# 6: receipts (SessionOpened.step_key, StepResult.receipt, BatchStepResult.receipt: shared.receipts), tree steps
# (Step.tree, Step.branch, TruncateSession.branch) and ForwardRequest.adapter: a node of 5 would refuse each of them
PROTOCOL_VERSION = 6

INFERENCE_HANDLER = "swarmgate.inference"
BATCH_HANDLER = "swarmgate.batch"
PUSH_HANDLER = "swarmgate.push"
FORWARD_HANDLER = "swarmgate.forward"
INFO_HANDLER = "swarmgate.info"

# Hidden states travel in these dtypes only; anything else is refused before deserializing.
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Bytes per element in hivemind's uncompressed buffer (it widens bfloat16 to float32 on the wire).
_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 4}
MAX_WIRE_ELEMENTS = 1 << 28  # 1 GiB of fp32: refuses absurd declared sizes before allocating
MAX_BATCH_ROWS = 256  # sessions in one BatchStep
MAX_NEXT_HOPS = 64  # nodes after this one that a pushed row names


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OpenSession(_Message):
    type: Literal["open"] = "open"
    protocol: int
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    max_length: int = Field(gt=0)
    auth: str | None = None  # call token of a private swarm (shared.membership)
    alloc_timeout: float = Field(0.0, ge=0, le=600)  # seconds to wait for cache room (0: refuse at once)
    pusher: str | None = Field(None, max_length=128)  # peer id of the node before this one, allowed to push into it
    # The LoRA adapter the session's steps run with (None: the base model). Sent only when set, so a node from
    # before adapters still accepts every base-model session (it forbids unknown fields).
    adapter: str | None = Field(None, min_length=1, max_length=128)

    @model_serializer(mode="wrap")
    def _without_unset_adapter(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.adapter is None:
            data.pop("adapter", None)
        return data


class AllowPush(_Message):
    """The node allowed to push into this session is now ``pusher`` (its predecessor was replaced)."""

    type: Literal["allow_push"] = "allow_push"
    pusher: str | None = Field(None, max_length=128)


MAX_TREE_TOKENS = 256  # tokens of one tree step


class Step(_Message):
    """New tokens at ``position`` (below the session's length rewinds it). A verify step of speculative branches
    carries ``tree``: each token's parent in the step (-1: the token before ``position``); each attends to the stored
    tokens and its ancestors only, at position ``position + depth``, and all are stored provisionally. ``branch``
    keeps one branch of the previous tree step first: the stored tokens at these slots become the positions right
    before ``position`` (see ``TruncateSession``). Both are sent only when set: a node from before trees accepts
    every other step."""

    type: Literal["step"] = "step"
    position: int = Field(ge=0)
    tree: list[int] | None = Field(None, max_length=MAX_TREE_TOKENS)
    branch: list[int] | None = Field(None, max_length=MAX_TREE_TOKENS)

    @model_serializer(mode="wrap")
    def _without_unset_tree(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in ("tree", "branch"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ResizeSession(_Message):
    """New room for an open session: the node grants the difference from its pool (or takes it back), keeping the
    stored tokens; never below them. A gateway grows a kept conversation's session for its next turn this way."""

    type: Literal["resize"] = "resize"
    max_length: int = Field(gt=0)
    alloc_timeout: float = Field(0.0, ge=0, le=600)


class TruncateSession(_Message):
    """Keep the session's first ``length`` stored tokens: the rest are forgotten (the room they took stays the
    session's; ``ResizeSession`` gives room back). Refused past the tokens the session holds. With ``branch`` (a
    tree step's kept branch), the last ``len(branch)`` of the ``length`` are the stored tokens at those slots
    (ascending), moved there."""

    type: Literal["truncate"] = "truncate"
    length: int = Field(ge=0)
    branch: list[int] | None = Field(None, max_length=MAX_TREE_TOKENS)

    @model_serializer(mode="wrap")
    def _without_unset_branch(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.branch is None:
            data.pop("branch", None)
        return data


class CloseSession(_Message):
    type: Literal["close"] = "close"


class NextHop(_Message):
    peer_id: str = Field(min_length=1, max_length=128)
    session_id: str = Field(min_length=1, max_length=64)  # that node's name for the chain's session


class BatchRow(_Message):
    session_id: str = Field(min_length=1, max_length=64)  # as SessionOpened named it
    position: int = Field(ge=0)
    next: list[NextHop] = Field(default_factory=list, max_length=MAX_NEXT_HOPS)  # push the output on to next[0]


class BatchStep(_Message):
    """One new token for each of several sessions (row b of the hidden states is ``rows[b]``'s)."""

    type: Literal["batch_step"] = "batch_step"
    rows: list[BatchRow] = Field(min_length=1, max_length=MAX_BATCH_ROWS)
    pushed: bool = False  # the inputs come by push (no tensor here): answer each row once its step has run
    wait: float = Field(0.0, ge=0, le=600)  # seconds a pushed row waits for its input (then PushMissing)


class PushStep(_Message):
    """Node to node: the sender's outputs, row b the input of the receiver's session ``rows[b].session_id``."""

    type: Literal["push"] = "push"
    rows: list[BatchRow] = Field(min_length=1, max_length=MAX_BATCH_ROWS)


_ClientMessages = OpenSession | Step | ResizeSession | TruncateSession | AllowPush | CloseSession
ClientMessage = Annotated[_ClientMessages, Field(discriminator="type")]
_CLIENT_MESSAGE: TypeAdapter[_ClientMessages] = TypeAdapter(ClientMessage)


class ForwardRequest(_Message):
    type: Literal["forward"] = "forward"
    protocol: int
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    auth: str | None = None
    adapter: str | None = None  # the LoRA adapter to run the blocks with, as the checked session did (None: base)


class InfoRequest(_Message):
    type: Literal["info"] = "info"
    auth: str | None = None


class SessionOpened(_Message):
    type: Literal["opened"] = "opened"
    session_id: str
    start: int
    end: int
    max_length: int
    step_key: StepKeyCertificate  # signs every step reply's receipt (shared.receipts)


class SessionResized(_Message):
    type: Literal["resized"] = "resized"
    max_length: int


class SessionTruncated(_Message):
    type: Literal["truncated"] = "truncated"
    length: int


class PushAllowed(_Message):
    type: Literal["push_allowed"] = "push_allowed"


class StepResult(_Message):
    type: Literal["result"] = "result"
    position: int
    receipt: str = Field(max_length=256)  # the step key's signature of the step (shared.receipts)


class ForwardResult(_Message):
    type: Literal["forward_result"] = "forward_result"


class NodeInfo(_Message):
    type: Literal["node_info"] = "node_info"
    model: str
    start: int
    end: int
    state: str
    protocol: int
    version: str
    dtype: str
    cache_tokens_total: int
    cache_tokens_left: int
    sessions: int
    tokens_processed: int = 0  # tokens the span has computed (session steps and forwards) since the node started


class ErrorReply(_Message):
    type: Literal["error"] = "error"
    code: str
    message: str

    @classmethod
    def of(cls, error: RemoteError) -> ErrorReply:
        return cls(code=error.code, message=str(error))

    def to_exception(self) -> RemoteError:
        return error_from_code(self.code, self.message)


class BatchStepResult(_Message):
    """Row b's output is row b of the hidden states, unless ``errors[b]`` says why it failed (its row is zeros).
    A ``pushed`` step's reply carries a second tensor: the inputs the rows ran on. ``receipt`` signs the rows that
    ran, together, in order (``shared.receipts``)."""

    type: Literal["batch_result"] = "batch_result"
    errors: list[ErrorReply | None]
    receipt: str = Field(max_length=256)


class PushAccepted(_Message):
    """Per row of a ``PushStep``: None once its step ran, or why it was refused or failed."""

    type: Literal["push_accepted"] = "push_accepted"
    errors: list[ErrorReply | None]


_ServerMessages = (
    SessionOpened
    | SessionResized
    | SessionTruncated
    | PushAllowed
    | StepResult
    | BatchStepResult
    | PushAccepted
    | ForwardResult
    | NodeInfo
    | ErrorReply
)
ServerMessage = Annotated[_ServerMessages, Field(discriminator="type")]
_SERVER_MESSAGE: TypeAdapter[_ServerMessages] = TypeAdapter(ServerMessage)


def encode_request(message: BaseModel, tensors: tuple[torch.Tensor, ...] = ()) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(
        metadata=message.model_dump_json().encode(), tensors=[serialize_torch_tensor(t) for t in tensors]
    )


def encode_response(message: BaseModel, tensors: tuple[torch.Tensor, ...] = ()) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(
        metadata=message.model_dump_json().encode(), tensors=[serialize_torch_tensor(t) for t in tensors]
    )


def decode_client_message(request: runtime_pb2.ExpertRequest) -> tuple[_ClientMessages, list[torch.Tensor]]:
    return _parse(_CLIENT_MESSAGE, request.metadata), decode_tensors(request.tensors)


def decode_unary(request: runtime_pb2.ExpertRequest, model: type[_Message]) -> tuple[Any, list[torch.Tensor]]:
    return _parse(TypeAdapter(model), request.metadata), decode_tensors(request.tensors)


_BATCH_STEP: TypeAdapter[BatchStep] = TypeAdapter(BatchStep)


def decode_batch_step(request: runtime_pb2.ExpertRequest) -> tuple[BatchStep, list[torch.Tensor]]:
    return _parse(_BATCH_STEP, request.metadata), decode_tensors(request.tensors)


_PUSH_STEP: TypeAdapter[PushStep] = TypeAdapter(PushStep)


def decode_push_step(request: runtime_pb2.ExpertRequest) -> tuple[PushStep, list[torch.Tensor]]:
    return _parse(_PUSH_STEP, request.metadata), decode_tensors(request.tensors)


def decode_server_message(
    response: runtime_pb2.ExpertResponse,
) -> tuple[_ServerMessages, list[torch.Tensor]]:
    return _parse(_SERVER_MESSAGE, response.metadata), decode_tensors(response.tensors)


def _parse(adapter: TypeAdapter[Any], metadata: bytes) -> Any:
    try:
        return adapter.validate_json(metadata)
    except ValidationError as exc:
        raise BadRequest(f"malformed message: {exc.errors(include_url=False)[:3]}") from None


def decode_tensors(serialized: Any) -> list[torch.Tensor]:
    """Deserialize tensors after checking their declared dtype and size against the bytes actually sent."""
    tensors = []
    for proto in serialized:
        if proto.dtype not in WIRE_DTYPES:
            raise BadRequest(f"tensor dtype {proto.dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if proto.compression != runtime_pb2.CompressionType.NONE:
            raise BadRequest("compressed tensors are not accepted")
        elements = math.prod(proto.size)
        if any(d < 0 for d in proto.size) or elements > MAX_WIRE_ELEMENTS:
            raise BadRequest(f"tensor size {list(proto.size)} is out of bounds")
        if len(proto.buffer) != elements * _WIRE_BYTES[proto.dtype]:
            raise BadRequest(f"tensor of size {list(proto.size)} has {len(proto.buffer)} bytes")
        try:
            tensors.append(deserialize_torch_tensor(proto))
        except (ValueError, RuntimeError, TypeError) as exc:
            raise BadRequest(f"cannot deserialize tensor: {exc}") from None
    return tensors
