"""A choice's pieces through its chat output parser, for the APIs that answer in blocks of their own (Responses,
Messages): each piece's reasoning, content and tool calls, and the session record's token counts as the choice ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.api.request_log import RequestRecord
from gateway.api.serving.choices import ChoiceEvent
from gateway.generation import PromptScores
from gateway.text.assembler import EmittedToken, FinishReason
from gateway.text.chat_output import ChatOutputParser, OutputDelta


@dataclass(frozen=True)
class ParsedPiece:
    delta: OutputDelta
    finish_reason: FinishReason | None  # set on the choice's last piece only
    stop: str | None  # on the last piece: the stop string that ended the choice, if one did
    text: str = ""  # the piece's text as generated, before parsing
    tokens: tuple[EmittedToken, ...] = ()  # the tokens it carries (their ``offset``: where in the choice's text)


async def parsed_pieces(
    events: AsyncIterator[ChoiceEvent], parser: ChatOutputParser, record: RequestRecord
) -> AsyncIterator[ParsedPiece]:
    """One choice's events (prompt scores skipped) as parsed pieces; the record counts its tokens at its end."""
    async for choice in events:
        if isinstance(choice.payload, PromptScores):
            continue
        piece = choice.payload
        last = piece.finish_reason is not None
        delta = parser.feed_piece(piece.text, last)
        if last:
            record.completion_tokens += choice.generated
            record.cached_tokens += choice.cached_tokens
            record.finish_reason = piece.finish_reason
        yield ParsedPiece(delta, piece.finish_reason, piece.stop, piece.text, piece.tokens)
