"""Which items of a realtime conversation the next response's prompt holds: the session's
`truncation`. The model sees the instructions, then the newest items that fit; the oldest go
first, whole items at a time, and stay out (the context is a window that only moves forward,
so the turns after a cut share their prompt's prefix and the prefix cache serves it):

    | instructions | out of context ... | in context: oldest .. newest | gen. prompt | output |
    |<------------------------------------ max_model_len ------------------------------------>|
                                        |<- the items' budget: max_model_len - the output
                                            room - the instructions and generation prompt ->|

    "auto"              over the budget: the oldest go until the rest fit
    "disabled"          over the budget: the response fails (an `error` event)
    retention_ratio r   over the budget (token_limits.post_instructions, if lower): the oldest
                        go until the rest take at most r of it, so the next turns grow into the
                        room left before the next cut

The newest item always stays: if it alone is over the budget, the response fails. The output
room is the response's max_output_tokens ("inf": 4096, OpenAI's cap on one response), at most
a quarter of the context, so that the conversation keeps the rest: an answer longer than its
room may end at the context's end (status incomplete), as it would without truncation. Items out
of the context stay in the conversation: the protocol deletes nothing on truncation (no
`conversation.item.deleted`), and a client may still name them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from starlette.concurrency import run_in_threadpool

from omnistage.engine.inputs import parse_with_processor
from omnistage.engine.request import OmniRequest, RequestFields
from omnistage.entrypoints.openai.errors import APIError, bad_request, from_value_error
from omnistage.entrypoints.openai.realtime.conversation import Conversation
from omnistage.entrypoints.openai.realtime.protocol import RetentionRatio, Truncation

from omnistage.entrypoints.openai.realtime.response import ResponsePlan

if TYPE_CHECKING:
    from omnistage.entrypoints.openai.client import EngineClient, Ready, RequestHandle

MAX_INF_OUTPUT_ROOM = 4096
_PROBE = [{"role": "user", "content": "."}]


def output_room(max_tokens: int | None, max_model_len: int) -> int:
    """The tokens a response's prompt leaves free for its output (`max_tokens` None: "inf")."""
    wanted = MAX_INF_OUTPUT_ROOM if max_tokens is None else max_tokens
    return min(wanted, max_model_len // 4)


@dataclass(frozen=True, slots=True)
class PromptSize:
    """A prompt's tokens: its instructions' (the system message, the generation prompt and
    anything else around the items) and each item's, oldest first."""
    instructions: int
    items: list[int]


def num_to_drop(size: PromptSize, max_input: int, truncation: Truncation) -> int:
    """How many of the oldest items to drop for a prompt of `size` to fit `max_input` tokens
    under `truncation`; a 400 (context_length_exceeded) when it cannot."""
    budget = max_input - size.instructions
    if isinstance(truncation, RetentionRatio) and truncation.token_limits is not None \
            and truncation.token_limits.post_instructions is not None:
        budget = min(budget, truncation.token_limits.post_instructions)
    used = sum(size.items)
    if used <= budget:
        return 0
    if truncation == "disabled":
        raise _too_long(f"the conversation takes {used} tokens after the instructions, over "
                        f"the {budget} the model's input leaves it, and truncation is "
                        "disabled: delete items, or set the session's truncation")
    target = budget if truncation == "auto" else int(truncation.retention_ratio * budget)
    num = 0
    while num < len(size.items) - 1 and used > target:
        used -= size.items[num]
        num += 1
    if used > budget:
        raise _too_long(f"the newest item alone takes {used} tokens, over the {budget} the "
                        "model's input leaves the conversation after the instructions")
    return num


async def submit(client: EngineClient, conversation: Conversation, instructions: str,
                 truncation: Truncation, plan: ResponsePlan, known: dict[str, int]
                 ) -> RequestHandle:
    """The conversation as one engine request, through the front door (admitted, then
    checked and fit to the context, submitted)."""
    if not conversation.context():
        raise bad_request("the conversation is empty: add an item or commit audio first",
                          None, "conversation_empty")
    fields = RequestFields({} if plan.max_tokens is None else
                           {"max_tokens": plan.max_tokens}, voice=plan.voice)
    wanted = {"text", "audio"} if plan.modality == "audio" else {"text"}

    def request(prompt: dict[str, Any]) -> OmniRequest:
        return client.request(prompt, fields, wanted, "rt", param="conversation")

    async def make() -> list[Ready]:
        return [await fit(client, conversation, instructions, truncation, plan.max_tokens,
                          known, request)]

    [handle] = await client.start(make, 1)
    return handle


async def fit(client: EngineClient, conversation: Conversation, instructions: str,
              truncation: Truncation, max_tokens: int | None, known: dict[str, int],
              request: Callable[[dict[str, Any]], OmniRequest]) -> Ready:
    """The request of the conversation's context, prepared. One over the model's input limit
    (room left for the response's `max_tokens`) is cut as `truncation` says, then prepared
    again. `known`: the instructions' tokens last measured (updated here)."""
    max_len = client.max_model_len
    limit = None if max_len is None else max_len - output_room(max_tokens, max_len)
    fits = limit
    if limit is not None and isinstance(truncation, RetentionRatio) \
            and truncation.token_limits is not None \
            and truncation.token_limits.post_instructions is not None:
        measured = known.get(instructions, 0)   # 0: not measured yet
        fits = min(limit, truncation.token_limits.post_instructions + measured)
    made = request({"messages": conversation.messages(instructions)})
    prepared, refusal = None, None
    try:
        prepared = await run_in_threadpool(client.prepare, made)
        if fits is None or prepared[0].num_tokens <= fits:
            return made, prepared
    except APIError as err:      # perhaps over max_model_len: measured below
        if limit is None:
            raise
        refusal = err
    num_dropped = 0
    while True:                  # each round drops one item or more, never the newest
        try:
            size = await run_in_threadpool(measure, client.processor,
                                           made.prompt["messages"], bool(instructions))
        except ValueError as exc:
            raise from_value_error(exc, "conversation") from None
        known.clear()
        known[instructions] = size.instructions
        num = num_to_drop(size, limit, truncation)
        if num == 0:
            break
        conversation.drop_oldest(num)
        num_dropped += num
        made = request({"messages": conversation.messages(instructions)})
    if num_dropped == 0:         # it fits: a refusal was for something else
        if refusal is not None:
            raise refusal
        return made, prepared
    return made, await run_in_threadpool(client.prepare, made)


def measure(processor: Any, messages: list[dict[str, Any]], has_system: bool) -> PromptSize:
    """The tokens of a chat prompt (the system message first if `has_system`) through the
    model's input processor, item by item (blocking: it extracts audio features). A ChatML
    template opens each message and the generation prompt with <|im_start|>: the ids split
    there exactly. Any other template (or a text holding that token): each item is priced by
    itself after a probe message, the instructions as the rest."""
    ids = _token_ids(processor, messages)
    item_messages = messages[1:] if has_system else messages
    start = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    starts = [i for i, t in enumerate(ids) if t == start]
    if len(starts) == len(messages) + 1:
        bounds = starts + [len(ids)]
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]      # messages..., gen. prompt
        items = sizes[1:-1] if has_system else sizes[:-1]
    else:
        base = len(_token_ids(processor, _PROBE))
        items = [len(_token_ids(processor, _PROBE + [m])) - base for m in item_messages]
    return PromptSize(len(ids) - sum(items), items)


def _token_ids(processor: Any, messages: list[dict[str, Any]]) -> list[int]:
    return parse_with_processor({"messages": messages}, processor).token_ids or []


def _too_long(message: str) -> APIError:
    return bad_request(message, None, "context_length_exceeded")
