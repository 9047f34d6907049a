"""The offline API: `Omni(model=...).generate(prompts, sampling_params_list)`.

Built on `AsyncOmni`: the same checks, the same stage graph and orchestrator; `generate` submits
every prompt, then waits for all of them. A prompt is a string (tokenized as is, no chat
template) or a dict with `prompt`, `prompt_token_ids` or `prompt_embeds`.
`sampling_params_list` has one entry per stage (None: that stage's default); a single
`SamplingParams` (or `DiffusionParams`) applies to the entry stage. With no model, the
built-in demo model runs (handwritten digits from a small diffusion transformer).
"""

from __future__ import annotations

import queue
from pathlib import Path
from types import TracebackType

from tqdm import tqdm

from omnistage.configs.schema import GraphConfig, OutputKind
from omnistage.engine.async_omni import AsyncOmni, ParamsList, accumulate
from omnistage.engine.inputs import PromptType
from omnistage.outputs import OmniOutput, RequestEvent


class Omni:
    def __init__(self, model: str | None = None, *, stage_config: str | Path | None = None,
                 stage_overrides: list[str] | tuple[str, ...] = (), device: str = "auto",
                 graph: GraphConfig | None = None, **engine_kw: object) -> None:
        self.engine = AsyncOmni(model, stage_config=stage_config,
                                stage_overrides=stage_overrides, device=device, graph=graph,
                                **engine_kw)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params_list: ParamsList = None,
                 output_modalities: set[OutputKind] | None = None,
                 use_tqdm: bool = False) -> list[OmniOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        # every prompt is checked before any is scheduled
        prepared = [self.engine.prepare(p, sampling_params_list) for p in prompts]
        events: queue.Queue[RequestEvent] = queue.Queue()
        outputs: dict[str, OmniOutput] = {}
        try:
            for prompt, ready in zip(prompts, prepared):
                out = self.engine.submit(prompt, sampling_params_list, None, output_modalities,
                                         events.put, ready)
                outputs[out.request_id] = out
            pending = set(outputs)
            with tqdm(total=len(pending), desc="generate", disable=not use_tqdm) as bar:
                while pending:
                    ev = events.get()
                    accumulate(outputs[ev.request_id], ev)
                    if ev.done:
                        pending.discard(ev.request_id)
                        bar.update(1)
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
