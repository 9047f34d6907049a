"""The offline API: `Omni(model=...).generate(prompts, sampling_params_list)`.

A prompt is a string (tokenized as is, no chat template) or a dict with `prompt`,
`prompt_token_ids` or `prompt_embeds`. `sampling_params_list` has one entry per stage (None:
that stage's default); a single `SamplingParams` is accepted for one-stage models.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Union

import torch
from tqdm import tqdm

from omnistage.ar.engine import AREngine, StepOutput
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.outputs import OmniOutput
from omnistage.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data",
                "negative_prompt"}


class Omni:
    def __init__(self, model: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 cpu_kv_cache_bytes: int = 1 << 30, memory_fraction: float = 0.9,
                 num_kv_blocks: int | None = None, config: ARConfig | None = None) -> None:
        if config is None:
            config = ARConfig(
                model=model, device=device, dtype=dtype, seed=seed,
                kv_cache=KVCacheConfig(block_size=block_size,
                                       enable_prefix_caching=enable_prefix_caching,
                                       memory_fraction=memory_fraction,
                                       cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                                       num_blocks=num_kv_blocks),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          enable_chunked_prefill=enable_chunked_prefill,
                                          max_model_len=max_model_len))
        elif model and model != config.model:
            config = replace(config, model=model)
        self.config = config
        self.engine = AREngine(config)
        self.tokenizer = self.engine.tokenizer
        self.default_sampling = SamplingParams()
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params_list: SamplingParams | list[SamplingParams | None] | None = None,
                 use_tqdm: bool = False) -> list[OmniOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._stage_params(sampling_params_list)
        # Validate every prompt first: a bad one raises before anything is scheduled.
        parsed = [self._parse(p) for p in prompts]
        for ids, embeds in parsed:
            self.engine.validate(ids, params, embeds)

        outputs: dict[str, OmniOutput] = {}
        order: list[str] = []
        for prompt, (ids, embeds) in zip(prompts, parsed):
            rid = str(next(self._ids))
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            self.engine.add_request(rid, ids, params, embeds)
            outputs[rid] = OmniOutput(request_id=rid, prompt=text,
                                      prompt_token_ids=list(ids) if ids is not None else [],
                                      logprobs=[] if params.logprobs is not None else None)
            order.append(rid)

        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm)
        pending = set(order)
        while pending:
            for step_out in self.engine.step():
                if step_out.request_id not in outputs:
                    continue  # a request someone else added to the engine
                _merge(outputs[step_out.request_id], step_out)
                if step_out.finished:
                    pending.discard(step_out.request_id)
                    bar.update(1)
        bar.close()
        return [outputs[rid] for rid in order]

    def _stage_params(self, given: SamplingParams | list[SamplingParams | None] | None
                      ) -> SamplingParams:
        if given is None:
            return self.default_sampling
        if isinstance(given, SamplingParams):
            return given
        given = list(given)
        if len(given) != 1:
            raise ValueError(f"sampling_params_list has {len(given)} entries, this model has "
                             "1 stage")
        return given[0] or self.default_sampling

    def _parse(self, prompt: PromptType) -> tuple[list[int] | None, torch.Tensor | None]:
        if isinstance(prompt, str):
            return self._encode(prompt), None
        if not isinstance(prompt, dict):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt has unknown keys {sorted(unknown)}; "
                             f"known: {sorted(_PROMPT_KEYS)}")
        if prompt.get("multi_modal_data"):
            raise ValueError("multi_modal_data: this model takes text only")
        given = [k for k in ("prompt", "prompt_token_ids", "prompt_embeds") if k in prompt]
        if len(given) != 1:
            raise ValueError("a prompt dict needs exactly one of prompt, prompt_token_ids, "
                             f"prompt_embeds (got {given or 'none'})")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("prompt['prompt'] must be a string")
            return self._encode(prompt["prompt"]), None
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return list(ids), None
        embeds = prompt["prompt_embeds"]
        if not isinstance(embeds, torch.Tensor):
            raise ValueError("prompt_embeds must be a torch.Tensor of shape (num_tokens, hidden)")
        return None, embeds

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        return self.tokenizer(text, add_special_tokens=True)["input_ids"] if text else []


def _merge(out: OmniOutput, step: StepOutput) -> None:
    out.token_ids.extend(step.new_token_ids)
    out.text += step.text_delta
    if step.logprobs is not None and out.logprobs is not None:
        out.logprobs.extend(step.logprobs)
    if step.hidden_states is not None:
        if out.hidden_states is None:
            out.hidden_states = {k: v.clone() for k, v in step.hidden_states.items()}
        else:
            out.hidden_states = {k: torch.cat([out.hidden_states[k], v])
                                 for k, v in step.hidden_states.items()}
    if step.finished:
        out.finish_reason = step.finish_reason.value
        out.error = step.error
        if step.metrics is not None:
            out.metrics = step.metrics


__all__ = ["Omni", "OmniOutput", "PromptType"]
