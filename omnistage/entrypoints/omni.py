"""The offline API, as vLLM users write it: `Omni(model, **engine keywords)`,
`generate(prompts, sampling_params)` and `chat(messages, sampling_params)`.

Built on `AsyncOmni`: the same checks, the same stage graph and orchestrator; a call submits
every prompt, then waits for all of them (a tqdm bar over the requests, one request too; a
diffusion request moves it step by step; when stderr is not a terminal, a plain line every
tenth or 5 s instead of the bar's carriage-return frames). A prompt is a string (tokenized as is, no chat
template) or a dict with `prompt`, `prompt_token_ids`, `prompt_embeds` or `messages`.
`sampling_params` is one `SamplingParams` (the entry stage's; `DiffusionParams` for an image
model) or a list with one entry per stage (None: that stage's default). With no model, the
built-in demo model runs (handwritten digits from a small diffusion transformer).
"""

from __future__ import annotations

import queue
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from omnistage.configs.schema import GraphConfig, OutputKind
from omnistage.engine.async_omni import AsyncOmni, ParamsList
from omnistage.engine.inputs import PromptType
from omnistage.outputs import OmniOutput, RequestEvent
from omnistage.utils.logging import Progress, progress_logger

Message = dict[str, Any]
BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n:.3g}/{total_fmt} "
              "[{elapsed}<{remaining}{postfix}]")


class Omni:
    def __init__(self, model: str | None = None, *, stage_config: str | Path | None = None,
                 stage_overrides: list[str] | tuple[str, ...] = (), device: str = "auto",
                 graph: GraphConfig | None = None, **engine_kw: object) -> None:
        """`engine_kw`: vLLM's engine keywords (`gpu_memory_utilization`, `max_num_seqs`,
        `max_model_len`, `enforce_eager`, `dtype`, `seed`, ...) or stage keys; see
        omnistage/engine/engine_args.py for which stage each one sets."""
        self.engine = AsyncOmni(model, stage_config=stage_config,
                                stage_overrides=stage_overrides, device=device, graph=graph,
                                **engine_kw)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: ParamsList = None, use_tqdm: bool = True, *,
                 sampling_params_list: ParamsList = None,
                 output_modalities: set[OutputKind] | None = None) -> list[OmniOutput]:
        """One output per prompt, in order. `sampling_params_list` is the older name of
        `sampling_params` (give one of them)."""
        params = _one_of(sampling_params, sampling_params_list)
        batch = isinstance(prompts, (list, tuple))
        return self._run(list(prompts) if batch else [prompts], params, output_modalities,
                         use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: ParamsList = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             sampling_params_list: ParamsList = None,
             output_modalities: set[OutputKind] | None = None) -> list[OmniOutput]:
        """Chat through the model's chat template, as vLLM's `LLM.chat`: `messages` is one
        conversation (a list of {role, content} dicts) or a list of them; one output each.
        A text model takes text content (a string or text parts); a multimodal one (Qwen3-Omni)
        also audio / image / video parts, and applies its own template."""
        params = _one_of(sampling_params, sampling_params_list)
        batch = bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = list(messages) if batch else [messages]
        options: dict[str, Any] = {}
        if chat_template is not None:
            options["chat_template"] = chat_template
        if chat_template_kwargs:
            options["chat_template_kwargs"] = chat_template_kwargs
        if not add_generation_prompt or continue_final_message:
            options["add_generation_prompt"] = add_generation_prompt
            options["continue_final_message"] = continue_final_message
        prompts: list[PromptType] = [{"messages": list(c), **options} for c in conversations]
        return self._run(prompts, params, output_modalities, use_tqdm)

    def _run(self, prompts: list[PromptType], params: ParamsList,
             output_modalities: set[OutputKind] | None, show_bar: bool) -> list[OmniOutput]:
        # every prompt is checked before any is scheduled; the bar is what shows progress
        requests = [self.engine.request(p, params, modalities=output_modalities,
                                        want_progress=show_bar) for p in prompts]
        prepared = [self.engine.prepare(r) for r in requests]
        events: queue.Queue[RequestEvent] = queue.Queue()
        outputs: dict[str, OmniOutput] = {}
        try:
            for request, ready in zip(requests, prepared):
                out = self.engine.add_request(request, events.put, ready)
                outputs[out.request_id] = out
            _wait(outputs, events, show_bar)
        except BaseException:  # interrupted: leave nothing running behind
            for rid, out in outputs.items():
                if not out.finished:
                    self.engine.abort(rid)
            raise
        return list(outputs.values())

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def _one_of(sampling_params: ParamsList, sampling_params_list: ParamsList) -> ParamsList:
    if sampling_params is not None and sampling_params_list is not None:
        raise TypeError("give sampling_params or sampling_params_list, not both (they are "
                        "the same argument: one params object, or one per stage)")
    return sampling_params if sampling_params is not None else sampling_params_list


def _wait(outputs: dict[str, OmniOutput], events: queue.Queue[RequestEvent],
          show_bar: bool) -> None:
    """Fold events into `outputs` until every request finished. The bar counts requests;
    one that reports progress (diffusion steps) moves it by its share as it goes."""
    counted: dict[str, float] = {}
    num_tokens = 0
    is_terminal = sys.stderr.isatty()
    lines = Progress(len(outputs), "Processed prompts", progress_logger(), unit="req",
                     is_terminal=False) if show_bar and not is_terminal else None
    with tqdm(total=len(outputs), desc="Processed prompts", unit="req",
              disable=not (show_bar and is_terminal), bar_format=BAR_FORMAT,
              dynamic_ncols=True) as bar:
        pending = set(outputs)
        while pending:
            ev = events.get()
            out = outputs.get(ev.request_id)
            if out is None:   # a request whose submission failed, aborted meanwhile
                continue
            out.apply(ev)
            share = 1.0 if out.finished else (out.progress or 0.0)
            if share > counted.get(out.request_id, 0.0):
                bar.update(share - counted.get(out.request_id, 0.0))
                if lines is not None:
                    lines.update(share - counted.get(out.request_id, 0.0))
                counted[out.request_id] = share
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                num_tokens += out.metrics.num_output_tokens
                elapsed = bar.format_dict["elapsed"]
                if num_tokens and elapsed > 0:
                    bar.set_postfix_str(f"output {num_tokens / elapsed:.0f} tok/s",
                                        refresh=False)
    if lines is not None:
        lines.close()
