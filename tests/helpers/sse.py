"""Reading server-sent events the way an EventSource does: ``id:``/``data:`` fields, a blank line ends an event."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
