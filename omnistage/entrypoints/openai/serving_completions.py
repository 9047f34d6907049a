"""POST /v1/completions: raw prompts (no chat template) for models that produce text.

A prompt is a string, a list of token ids, or a batch of either (up to 64): a batch is one
engine request per prompt, admitted together, answered as choices in prompt order (streamed
chunks carry their choice's `index` and may interleave); with `n`, prompt i's completion j is
choice i * n + j.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from omnistage.engine.request import RequestFields
from omnistage.entrypoints.openai.client import (EngineClient, RequestHandle, failed,
                                                 unless_disconnected)
from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.params import openai_sampling_fields
from omnistage.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                   CompletionRequest, CompletionResponse, Usage)
from omnistage.entrypoints.openai.streaming import DONE, EventStream, sse, sse_error
from omnistage.outputs import CompletionOutput, OmniOutput

_END = object()


class CompletionServing:
    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    async def create(self, req: CompletionRequest, request: Request
                     ) -> CompletionResponse | Response:
        if "text" not in self.client.outputs or self.client.text_entry:
            raise bad_request("this model does not complete text (it produces "
                              f"{', '.join(sorted(self.client.outputs))}); use "
                              "/v1/images/generations or /v1/chat/completions", "model",
                              "unsupported_endpoint")
        if req.suffix:
            raise bad_request("suffix (insertion) is not supported by this server", "suffix")
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of={req.best_of}: only 1 is supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not "
                              "computed)", "echo")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed with stream: true", "stream_options")
        prompts = _prompts(req.prompt)
        fields = RequestFields(openai_sampling_fields(req, req.max_tokens, req.logprobs),
                               req.sampling_params_list)
        asked = ("max_tokens", req.max_tokens) if req.max_tokens is not None else None
        # n completions: n slots each
        handles = await self.client.start(
            [self.client.request(p, fields, {"text"}, "cmpl", max_tokens=asked,
                                 param="prompt" if len(prompts) == 1 else f"prompt[{i}]")
             for i, p in enumerate(prompts)])
        closers = [h.close for h in handles]
        if req.stream:
            await self.client.open_stream(request, handles, closers,
                                          "prompt" if len(handles) == 1 else None)
            return EventStream(self._stream(req, handles), closers)
        try:
            return await unless_disconnected(request, lambda: self._full(req, handles))
        finally:
            for close in closers:
                close()

    async def _full(self, req: CompletionRequest, handles: list[RequestHandle]
                    ) -> CompletionResponse:
        finals: list[OmniOutput] = [None] * len(handles)  # type: ignore[list-item]
        async for i, out in _merged(handles):
            finals[i] = out
        for out in finals:
            self.client.check(out, "prompt")
        # prompt i's completion j is choice i * n + j (OpenAI's order)
        choices = [CompletionChoice(index=i * req.n + c.index,
                                    text=(self._prompt_text(out) if req.echo else "") + c.text,
                                    finish_reason=_finish(c),
                                    logprobs=self._logprobs(c.token_ids, c.logprobs or [])
                                    if req.logprobs is not None else None)
                   for i, out in enumerate(finals) for c in out.outputs]
        return CompletionResponse(id=handles[0].request_id, model=self.model_name,
                                  choices=choices, usage=_usage(finals))

    async def _stream(self, req: CompletionRequest, handles: list[RequestHandle]
                      ) -> AsyncIterator[str]:
        rid = handles[0].request_id
        finals: list[OmniOutput] = []

        def chunk(index: int, text: str, finish: str | None = None,
                  logprobs: CompletionLogprobs | None = None) -> str:
            return sse(CompletionResponse(id=rid, model=self.model_name, choices=[
                CompletionChoice(index=index, text=text, finish_reason=finish,
                                 logprobs=logprobs)]))

        started: set[int] = set()
        ended: set[int] = set()
        async for i, out in _merged(handles):
            if failed(out):
                yield sse_error(self.client.failure(out, "prompt"))
                yield DONE
                return
            for c in out.outputs:
                index = i * req.n + c.index
                text = c.delta_text
                if req.echo and index not in started and (text or c.finished):
                    text = self._prompt_text(out) + text
                    started.add(index)
                lp = None
                if req.logprobs is not None and c.delta_token_ids:
                    new = (c.logprobs or [])[-len(c.delta_token_ids):]
                    lp = self._logprobs(c.delta_token_ids, new)
                if text or lp is not None:
                    yield chunk(index, text, logprobs=lp)
                if c.finished and index not in ended:
                    ended.add(index)
                    yield chunk(index, "", finish=_finish(c))
            if out.finished:
                finals.append(out)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": 0,
                       "model": self.model_name, "choices": [],
                       "usage": _usage(finals).model_dump()})
        yield DONE

    def _prompt_text(self, out: OmniOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.client.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]
                  ) -> CompletionLogprobs:
        tok = self.client.tokenizer
        text = (lambda t: tok.decode([t])) if tok is not None else str
        tokens, offsets, offset = [], [], 0
        for t in token_ids:
            tokens.append(text(t))
            offsets.append(offset)
            offset += len(tokens[-1])
        return CompletionLogprobs(
            tokens=tokens, text_offset=offsets,
            token_logprobs=[lp.get(t, float("-inf")) for t, lp in zip(token_ids, logprobs)],
            top_logprobs=[{text(k): v for k, v in sorted(lp.items(), key=lambda kv: -kv[1])}
                          for lp in logprobs])


def _prompts(prompt: Any) -> list[str | dict[str, list[int]]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [{"prompt_token_ids": list(p)} for p in prompt]


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, OmniOutput]]:
    """Every handle's outputs as (handle index, output), as they come."""
    if len(handles) == 1:
        async for out in handles[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for out in handle.outputs():
                queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out = await queue.get()
            if out is _END:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _usage(finals: list[OmniOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) or o.metrics.num_prompt_tokens for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def _finish(out: OmniOutput | CompletionOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"
