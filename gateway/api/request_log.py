"""A request id on every log record emitted while serving it, and one INFO line per request.

The id lives in a context variable: tasks and worker threads started for the request inherit it, so engine and
remote-session records carry it too. Prompts and outputs are never logged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.metrics import RequestTimer, start_request

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

logger = logging.getLogger("gateway.requests")


class RequestIdFilter(logging.Filter):
    """Prefixes each record's message with ``[request id]`` when one is set."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = request_id.get()
        if current != "-" and not getattr(record, "request_id", None):
            record.request_id = current
            record.msg = f"[{current}] {record.msg}"
        return True


def install_request_ids() -> None:
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())


@dataclass
class RequestRecord:
    id: str
    endpoint: str
    choices: int
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose node caches were reused from an earlier turn
    finish_reason: str | None = None  # of the last choice that finished
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))  # the response's ``created``: one per response
    timer: RequestTimer | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        request_id.set(self.id)
        self.timer = start_request(self.endpoint, self.started)
        if self.timer is not None:
            # A stream whose generator never started never runs ``tracking``: the in-flight gauge must still drop.
            weakref.finalize(self, self.timer.finish, "cancelled", 0)

    @contextlib.asynccontextmanager
    async def tracking(self) -> AsyncIterator[None]:
        """Logs the request's end when the block ends: finished, failed, or cancelled (the client left)."""
        try:
            yield
        except Exception as exc:
            self.done(failure(exc))
            raise
        except BaseException:
            self.done("cancelled")
            raise
        self.done("finished")

    def done(self, outcome: str) -> None:
        """One INFO line for the request: its outcome and sizes, never its text."""
        logger.info(
            "%s %s: %d choice(s), %d prompt + %d completion tokens in %.2fs",
            self.endpoint,
            outcome,
            self.choices,
            self.prompt_tokens,
            self.completion_tokens,
            time.monotonic() - self.started,
        )
        if self.timer is not None:
            self.timer.finish(outcome.split(" ", 1)[0], self.prompt_tokens)


def failure(exc: BaseException) -> str:
    """How a failed request is logged: the error's type and code (never its message, which may quote input)."""
    if not isinstance(exc, Exception) or getattr(exc, "code", None) == "client_disconnected":
        return "cancelled"
    code = getattr(exc, "code", None)
    return f"failed ({type(exc).__name__}{f': {code}' if code else ''})"
