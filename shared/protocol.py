"""The node's wire protocol: typed messages inside hivemind's protobuf envelope.

Every RPC carries a ``runtime_pb2.ExpertRequest`` / ``ExpertResponse``: ``metadata`` is one JSON message validated by
the pydantic models below, ``tensors`` are hidden states serialized by hivemind. Three handlers:

* ``inference`` (stream ↔ stream): ``OpenSession`` → ``SessionOpened``; then ``Step`` + hidden [1, T, D] →
  ``StepResult`` + hidden [1, T, D]; ``ResizeSession`` → ``SessionResized`` grows or shrinks the session's room (its
  stored positions kept); the session's KV cache lives until ``CloseSession`` or the stream ends.
* ``batch`` (stream ↔ stream): ``BatchStep`` + hidden [B, 1, D] → ``BatchStepResult`` + hidden [B, 1, D]: one decode
  step for each of B sessions the caller opened on its inference streams, in one message each way. A gateway whose
  streams step together (they do: its LM head scores them as one batch) sends one message per node instead of B,
  and the node's batcher gets all B rows at once instead of waiting for them to trickle in. A row that fails (its
  session closed, a bad position) carries its own ``ErrorReply``; the other rows are answered.
* ``forward`` (unary): ``ForwardRequest`` + hidden [B, T, D] → ``ForwardResult`` + hidden, no state kept.
* ``info`` (unary): ``InfoRequest`` → ``NodeInfo``.

Any request may be answered by ``ErrorReply`` with a typed code (``shared.errors``); the node keeps serving.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared.errors import BadRequest, RemoteError, error_from_code

PROTOCOL_VERSION = 3  # 2: ResizeSession; 3: the batch handler

INFERENCE_HANDLER = "swarmgate.inference"
BATCH_HANDLER = "swarmgate.batch"
FORWARD_HANDLER = "swarmgate.forward"
INFO_HANDLER = "swarmgate.info"

# Hidden states travel in these dtypes only; anything else is refused before deserializing.
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Bytes per element in hivemind's uncompressed buffer (it widens bfloat16 to float32 on the wire).
_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 4}
MAX_WIRE_ELEMENTS = 1 << 28  # 1 GiB of fp32: refuses absurd declared sizes before allocating
MAX_BATCH_ROWS = 256  # sessions in one BatchStep


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


class Step(_Message):
    type: Literal["step"] = "step"
    position: int = Field(ge=0)  # position of the first new token; below the session's length rewinds it


class ResizeSession(_Message):
    """New room for an open session: the node grants the difference from its pool (or takes it back), keeping the
    stored tokens; never below them. A gateway grows a kept conversation's session for its next turn this way."""

    type: Literal["resize"] = "resize"
    max_length: int = Field(gt=0)
    alloc_timeout: float = Field(0.0, ge=0, le=600)


class CloseSession(_Message):
    type: Literal["close"] = "close"


class BatchRow(_Message):
    session_id: str = Field(min_length=1, max_length=64)  # as SessionOpened named it
    position: int = Field(ge=0)


class BatchStep(_Message):
    """One new token for each of several sessions (row b of the hidden states is ``rows[b]``'s)."""

    type: Literal["batch_step"] = "batch_step"
    rows: list[BatchRow] = Field(min_length=1, max_length=MAX_BATCH_ROWS)


ClientMessage = Annotated[OpenSession | Step | ResizeSession | CloseSession, Field(discriminator="type")]
_CLIENT_MESSAGE: TypeAdapter[OpenSession | Step | ResizeSession | CloseSession] = TypeAdapter(ClientMessage)


class ForwardRequest(_Message):
    type: Literal["forward"] = "forward"
    protocol: int
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    auth: str | None = None


class InfoRequest(_Message):
    type: Literal["info"] = "info"
    auth: str | None = None


class SessionOpened(_Message):
    type: Literal["opened"] = "opened"
    session_id: str
    start: int
    end: int
    max_length: int


class SessionResized(_Message):
    type: Literal["resized"] = "resized"
    max_length: int


class StepResult(_Message):
    type: Literal["result"] = "result"
    position: int


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
    """Row b's output is row b of the hidden states, unless ``errors[b]`` says why it failed (its row is zeros)."""

    type: Literal["batch_result"] = "batch_result"
    errors: list[ErrorReply | None]


_ServerMessages = SessionOpened | SessionResized | StepResult | BatchStepResult | ForwardResult | NodeInfo | ErrorReply
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


def decode_client_message(
    request: runtime_pb2.ExpertRequest,
) -> tuple[OpenSession | Step | ResizeSession | CloseSession, list[torch.Tensor]]:
    return _parse(_CLIENT_MESSAGE, request.metadata), decode_tensors(request.tensors)


def decode_unary(request: runtime_pb2.ExpertRequest, model: type[_Message]) -> tuple[Any, list[torch.Tensor]]:
    return _parse(TypeAdapter(model), request.metadata), decode_tensors(request.tensors)


_BATCH_STEP: TypeAdapter[BatchStep] = TypeAdapter(BatchStep)


def decode_batch_step(request: runtime_pb2.ExpertRequest) -> tuple[BatchStep, list[torch.Tensor]]:
    return _parse(_BATCH_STEP, request.metadata), decode_tensors(request.tensors)


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
