"""A realtime session's conversation: its items in order, and the chat messages they become
for each turn.

Every turn sends the whole conversation (instructions as the system message, then each item
still in the model's context: truncation.py drops the oldest when it outgrows it) through the
model's own input processor, the same path as a chat request. The messages of earlier turns
render to the same tokens each time, so the thinker's prefix cache holds them and a turn
prefills only what is new (`usage.input_token_details.cached_tokens`).

An assistant item keeps what the client was sent: its transcript (or text) as it streamed,
cut where a response was cancelled, and cut to the audio actually played by
`conversation.item.truncate` (the transcript kept in proportion to the audio kept, at a word
boundary: the model gives no per-word timing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.realtime.protocol import LISTEN_RATE, Item, new_id


@dataclass(slots=True)
class Part:
    kind: str                         # "text" | "audio"
    text: str = ""                    # the text, or an audio part's transcript
    audio: np.ndarray | None = None   # user audio: float32 (num_samples,) at LISTEN_RATE
    num_samples: int = 0              # assistant audio: samples sent (at the output rate)


@dataclass(slots=True)
class ConversationItem:
    role: str                         # "user" | "assistant" | "system"
    parts: list[Part]
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"
    in_context: bool = True           # False: truncated out of the model's context for good

    def as_event_item(self) -> dict[str, Any]:
        """The item as the protocol shows it (user audio is not echoed back)."""
        content = []
        for p in self.parts:
            if self.role == "assistant":
                content.append({"type": "output_audio", "transcript": p.text} if p.kind == "audio"
                               else {"type": "output_text", "text": p.text})
            else:
                content.append({"type": "input_audio", "transcript": None} if p.kind == "audio"
                               else {"type": "input_text", "text": p.text})
        return {"id": self.id, "type": "message", "object": "realtime.item",
                "status": self.status, "role": self.role, "content": content}

    def as_message(self) -> dict[str, Any]:
        """The chat-template message: text as a string, audio as the processor's part."""
        if all(p.kind == "text" or self.role == "assistant" for p in self.parts):
            return {"role": self.role, "content": "".join(p.text for p in self.parts)}
        return {"role": self.role, "content": [
            {"type": "audio", "audio": (p.audio, LISTEN_RATE)} if p.kind == "audio"
            else {"type": "text", "text": p.text} for p in self.parts]}


class Conversation:
    def __init__(self, max_items: int) -> None:
        self.items: list[ConversationItem] = []
        self.max_items = max_items

    def add(self, item: ConversationItem, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (None: at the end); returns the item before it."""
        if len(self.items) >= self.max_items:
            raise bad_request(f"the conversation holds its limit of {self.max_items} items; "
                              "delete some or start a new session", "item", "conversation_full")
        if any(i.id == item.id for i in self.items):
            raise bad_request(f"item.id: {item.id!r} is already in the conversation", "item.id")
        at = len(self.items)
        if previous_item_id is not None:
            at = self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at > 0 else None

    def index(self, item_id: str, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise bad_request(f"{param}: no item {item_id!r} in the conversation", param,
                          "item_not_found")

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id, "item_id")]

    def context(self) -> list[ConversationItem]:
        """The items the model sees, oldest first (truncation.py drops the oldest)."""
        return [i for i in self.items if i.in_context and i.parts]

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": instructions}] if instructions else []
        return system + [i.as_message() for i in self.context()]

    def drop_oldest(self, num_items: int) -> None:
        """Take the oldest `num_items` of the context out of it for good. They stay in the
        conversation (ids a client may still name), without the audio no prompt needs."""
        for item in self.context()[:num_items]:
            item.in_context = False
            for part in item.parts:
                part.audio = None

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int,
                 output_rate: int) -> None:
        """Cut an assistant audio part to what was played: the protocol's
        `conversation.item.truncate`."""
        item = self.items[self.index(item_id, "item_id")]
        if item.role != "assistant":
            raise bad_request("item_id: only assistant items can be truncated", "item_id")
        if not 0 <= content_index < len(item.parts) or item.parts[content_index].kind != "audio":
            raise bad_request(f"content_index={content_index}: not an audio part of the item",
                              "content_index")
        part = item.parts[content_index]
        sent_ms = part.num_samples * 1000 // output_rate
        if not 0 <= audio_end_ms <= sent_ms:
            raise bad_request(f"audio_end_ms={audio_end_ms}: the item's audio is {sent_ms} ms",
                              "audio_end_ms")
        keep = round(len(part.text) * audio_end_ms / sent_ms) if sent_ms else 0
        part.text = cut_at_word(part.text, keep)
        part.num_samples = audio_end_ms * output_rate // 1000
        item.status = "incomplete"


def cut_at_word(text: str, num_chars: int) -> str:
    """The first `num_chars` characters, back to the last whole word."""
    if num_chars >= len(text):
        return text
    head = text[:num_chars]
    space = head.rfind(" ")
    return head[:space] if space > 0 and not text[num_chars].isspace() else head


def item_from_event(item: Item, decode_audio: Any) -> ConversationItem:
    """`conversation.item.create`'s item -> ours (`decode_audio(b64, param)` -> samples)."""
    parts = []
    for j, c in enumerate(item.content):
        param = f"item.content[{j}]"
        if c.type == "input_audio":
            if item.role != "user" or not c.audio:
                raise bad_request(f"{param}.audio: a user input_audio part needs its audio",
                                  f"{param}.audio")
            parts.append(Part("audio", audio=decode_audio(c.audio, f"{param}.audio")))
        elif c.type == "output_audio":
            if item.role != "assistant":
                raise bad_request(f"{param}.type: output_audio is for assistant items",
                                  f"{param}.type")
            parts.append(Part("audio", text=c.transcript or ""))
        else:
            if c.text is None:
                raise bad_request(f"{param}.text: required for {c.type}", f"{param}.text")
            parts.append(Part("text", text=c.text))
    converted = ConversationItem(item.role, parts)
    if item.id is not None:
        converted.id = item.id
    return converted
