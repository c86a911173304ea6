"""``POST /v1/responses/compact``: a long conversation made short. The model summarizes it (through the chat path,
so quotas, sessions and routing are those of any request), and the answer is, as the Open Responses spec writes it,
every user message of the conversation followed by one ``compaction`` item holding the summary of everything else
(assistant turns, tool calls and their results). A later request sends those items back as its input (with no
``previous_response_id``) and continues from them.
"""

from __future__ import annotations

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from gateway.api.protocol.common import IGNORED_FIELDS, reject_unsupported
from gateway.api.protocol.responses import (
    CompactedResponse,
    CompactionItem,
    CompactRequest,
    ResponseUsage,
    UserMessageItem,
)
from gateway.api.serving.common import RequestContext
from gateway.api.serving.compaction_summary import PREFACE, sealed
from gateway.api.serving.responses import IGNORED_RESPONSES_FIELDS, ResponsesServing
from gateway.api.serving.responses_translate import Message, input_messages

DEFAULT_INSTRUCTIONS = (
    "Summarize the conversation so far so that it can be continued from the summary alone: the user's goals, what "
    "was decided and done, facts learned (tool results included), and the tasks still open. Write only the summary."
)


async def compact(serving: ResponsesServing, body: CompactRequest, context: RequestContext) -> CompactedResponse:
    reject_unsupported(body, IGNORED_FIELDS | IGNORED_RESPONSES_FIELDS | {"prompt_cache_options"})
    conversation = await _conversation(serving, body, context)
    ask = [*conversation, {"role": "user", "content": body.instructions or DEFAULT_INSTRUCTIONS}]
    request = ChatCompletionRequest.model_validate({"model": body.model, "messages": ask, "temperature": 0})
    answer = await serving.chat.create(request, context)
    if not isinstance(answer, ChatCompletionResponse):  # not streamed: the request above does not ask for it
        raise TypeError("a compaction is never streamed")
    summary = answer.choices[0].message.content or ""
    kept = [
        UserMessageItem(content=[{"type": "input_text", "text": message["content"]}])
        for message in conversation
        if message["role"] == "user" and not message["content"].startswith(PREFACE)  # older summaries: in the new one
    ]
    usage = answer.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return CompactedResponse(
        output=[*kept, CompactionItem(encrypted_content=sealed(summary))],
        usage=ResponseUsage.of(usage.prompt_tokens, usage.completion_tokens, cached),
    )


async def _conversation(serving: ResponsesServing, body: CompactRequest, context: RequestContext) -> list[Message]:
    history: list[Message] = []
    if body.previous_response_id is not None:
        history = (await serving.previous(body.previous_response_id, context.caller)).messages
    turn = input_messages(body.input) if body.input else []
    if not history and not turn:
        raise InvalidRequest("Nothing to compact: send input, previous_response_id or both.", "invalid_value", "input")
    return history + turn
