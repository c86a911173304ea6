"""The ``encrypted_content`` of a compaction item: the summary of a compacted conversation, wrapped so that a client
treats it as opaque and sends it back unchanged (URL-safe base64 of a small versioned JSON object). It is not
encrypted: the caller may read its own summary, and the gateway keeps no secret to tell them apart."""

from __future__ import annotations

import base64
import binascii
import json

from gateway.api.errors import InvalidRequest

VERSION = 1
# How a summary is put back before the turns that follow it (as a user message: every chat template takes one).
PREFACE = "Summary of the earlier conversation (compacted):\n"


def sealed(summary: str) -> str:
    raw = json.dumps({"v": VERSION, "summary": summary}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode()


def opened(content: str | None) -> str:
    """The summary inside a compaction item's content; 400 for anything this gateway did not write."""
    try:
        data = json.loads(base64.urlsafe_b64decode((content or "").encode()))
    except (binascii.Error, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("v") != VERSION or not isinstance(data.get("summary"), str):
        raise InvalidRequest(
            "This compaction item was not made by this server's /v1/responses/compact.", "invalid_value", "input"
        )
    return str(data["summary"])
