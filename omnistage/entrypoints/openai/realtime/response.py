"""One response of a realtime session: the conversation so far submitted as one engine
request, its text and speech streamed back as the protocol's events, ended by `response.done`.

    response.created ─ conversation.item.added ─ response.output_item.added ─
    response.content_part.added ─ (response.output_audio_transcript.delta | response.output_
    audio.delta)* or response.output_text.delta* ─ ...done ─ response.content_part.done ─
    response.output_item.done ─ conversation.item.done ─ response.done (status, usage)

`cancel` closes the request's handle: the engine aborts it in every stage at its next step
(thinker, talker and code2wav alike), and the assistant item keeps what was sent.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from omnistage.entrypoints.openai.client import failed
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.realtime.conversation import ConversationItem, Part
from omnistage.entrypoints.openai.realtime.protocol import event, new_id
from omnistage.entrypoints.openai.serving_chat import audio_of
from omnistage.outputs import OmniOutput
from omnistage.utils.audio import resample, to_pcm16

if TYPE_CHECKING:
    from omnistage.entrypoints.openai.client import EngineClient, RequestHandle

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(slots=True)
class ResponsePlan:
    """What one response asks of the engine, settled before it starts."""
    modality: str                    # "audio" | "text"
    voice: str | None
    max_tokens: int | None
    output_rate: int
    metadata: dict[str, str] | None = None


class Response:
    def __init__(self, client: EngineClient, plan: ResponsePlan, item: ConversationItem,
                 send: Send, conversation_id: str) -> None:
        self.client, self.plan, self.item, self.send = client, plan, item, send
        self.id = new_id("resp")
        self.conversation_id = conversation_id
        self.handle: RequestHandle | None = None
        self.status, self.status_details = "in_progress", None
        self.last: OmniOutput | None = None
        self.started = time.monotonic()
        self.first_audio_s: float | None = None    # from start to the first audio delta
        self.done = asyncio.Event()

    @property
    def part(self) -> Part:
        return self.item.parts[0]

    def resource(self, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The protocol's response object."""
        body = {"id": self.id, "object": "realtime.response", "status": self.status,
                "status_details": self.status_details, "output": output or [],
                "conversation_id": self.conversation_id,
                "output_modalities": [self.plan.modality],
                "max_output_tokens": self.plan.max_tokens or "inf",
                "metadata": self.plan.metadata, "usage": None}
        if self.plan.modality == "audio":
            body["audio"] = {"output": {"format": {"type": "audio/pcm",
                                                   "rate": self.plan.output_rate},
                                        "voice": self.plan.voice}}
        return body

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0,
                "content_index": 0}

    async def run(self, handle: RequestHandle) -> None:
        """Stream the request's outputs as events until it ends (or is cancelled)."""
        self.handle = handle
        try:
            async for out in handle.outputs():
                self.last = out
                if failed(out):
                    if self.status == "in_progress":
                        self._fail(self.client.failure(out, "response"))
                    break
                await self._deltas(out)
            if self.status == "in_progress":
                self.status = ("incomplete" if self.last is not None
                               and self.last.finish_reason == "length" else "completed")
                if self.status == "incomplete":
                    self.status_details = {"type": "incomplete", "reason": "max_output_tokens"}
        finally:
            self.close()
        await self._finish()

    async def _deltas(self, out: OmniOutput) -> None:
        ids = self._ids()
        if out.delta_text:
            self.part.text += out.delta_text
            kind = ("response.output_audio_transcript.delta" if self.plan.modality == "audio"
                    else "response.output_text.delta")
            await self.send(event(kind, **ids, delta=out.delta_text))
        audio = audio_of(out.delta_tensors, self.client.engine.audio_sample_rate)
        if audio is not None and self.plan.modality == "audio":
            data = await run_in_threadpool(_pcm16, audio[0], audio[1], self.plan.output_rate)
            if data and self.status == "in_progress":
                if self.first_audio_s is None:
                    self.first_audio_s = time.monotonic() - self.started
                self.part.num_samples += len(data) // 2
                await self.send(event("response.output_audio.delta", **ids,
                                      delta=base64.b64encode(data).decode("ascii")))

    def cancel(self, reason: str) -> None:
        """Stop now: the request is aborted in every stage; `run` then ends the response."""
        if self.status == "in_progress":
            self.status = "cancelled"
            self.status_details = {"type": "cancelled", "reason": reason}
        self.close()

    def _fail(self, err: APIError) -> None:
        self.status = "failed"
        self.status_details = {"type": "failed", "error": {"type": err.type,
                                                           "code": err.code,
                                                           "message": err.message}}

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()       # aborted if unfinished; its slot freed

    async def start_events(self, previous_item_id: str | None) -> None:
        await self.send(event("response.created", response=self.resource()))
        item = self.item.as_event_item()
        await self.send(event("conversation.item.added", item=item,
                              previous_item_id=previous_item_id))
        await self.send(event("response.output_item.added", response_id=self.id,
                              output_index=0, item=item))
        part = ({"type": "audio", "transcript": ""} if self.plan.modality == "audio"
                else {"type": "text", "text": ""})
        await self.send(event("response.content_part.added", **self._ids(), part=part))

    async def _finish(self) -> None:
        """The closing events; the item stays in the conversation with what was sent."""
        ids, text = self._ids(), self.part.text
        self.item.status = "completed" if self.status == "completed" else "incomplete"
        if self.plan.modality == "audio":
            await self.send(event("response.output_audio.done", **ids))
            await self.send(event("response.output_audio_transcript.done", **ids,
                                  transcript=text))
            part = {"type": "audio", "transcript": text}
        else:
            await self.send(event("response.output_text.done", **ids, text=text))
            part = {"type": "text", "text": text}
        await self.send(event("response.content_part.done", **ids, part=part))
        item = self.item.as_event_item()
        await self.send(event("response.output_item.done", response_id=self.id,
                              output_index=0, item=item))
        await self.send(event("conversation.item.done", item=item))
        body = self.resource([item])
        body["usage"] = self.usage()
        await self.send(event("response.done", response=body))
        self.done.set()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: input tokens of the whole context, the part of them the prefix
        cache served (cached_tokens: prefill saved by reusing earlier turns), output text
        tokens (the thinker's) and audio tokens (the talker's codec frames)."""
        out = self.last
        if out is None:
            return {"total_tokens": 0, "input_tokens": 0, "output_tokens": 0}
        entry = self.client.entry
        stages = out.stage_metrics
        prompt = out.metrics.num_prompt_tokens
        cached = sum(stages[n].num_cached_tokens for n in entry if n in stages)
        text = len(out.token_ids)
        audio = sum(m.num_tokens for n, m in stages.items()
                    if n not in entry and self.client.graph.stage(n).kind == "ar")
        return {"total_tokens": prompt + text + audio, "input_tokens": prompt,
                "output_tokens": text + audio,
                "input_token_details": {"cached_tokens": cached},
                "output_token_details": {"text_tokens": text, "audio_tokens": audio}}


def _pcm16(wave: Any, rate: int, target: int) -> bytes:
    samples = wave.float().flatten().numpy() if hasattr(wave, "numpy") else wave
    if rate != target:
        samples = resample(samples, rate, target)
    return to_pcm16(samples)
