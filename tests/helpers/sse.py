"""Reading server-sent events the way an EventSource does: ``id:``/``data:`` fields, a blank line ends an event."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Event:
    id: str | None
    data: str


def sse_events(response: httpx.Response) -> Iterator[Event]:
    """The events of a streamed response (comments and retry hints skipped)."""
    event_id: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield Event(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield Event(event_id, "\n".join(data))


def completion_choices(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """A streamed completion's first-choice chunks, up to its ``[DONE]``."""
    for event in sse_events(response):
        if event.data == "[DONE]":
            return
        yield json.loads(event.data)["choices"][0]
