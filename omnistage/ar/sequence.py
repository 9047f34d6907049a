"""Per-request state of the autoregressive engine.

A sequence owes `num_tokens - num_computed_tokens` tokens to the model. There is no separate
prefill phase: a fresh prompt, a chunk of a long prompt, a prompt after a prefix-cache hit and a
decode step are all "compute the tokens still owed". The last token of a fully computed sequence
yields the logits for the next one.

    |<------------- prompt (P) ------------>|<--- output --->|
    | cached (prefix hit) | computed | owed ...                |
    0                     num_cached          num_computed    num_tokens

Streaming input (a chunked edge from an upstream stage) adds two things: the prompt may still
grow (`prompt.open`: prefill what has arrived, sample nothing yet), and decode inputs may carry
an extra embedding from upstream (`stream`, a `StreamInput`: row t is added to the input
embedding of position P + t; while open, a decode waits for its row).

Models with extra inputs (Qwen3-Omni) add a `MultimodalInput` (`mm`: the prompt's rotary
positions (3, P) with the decode offset, deepstack features), and fed-back embeddings that
replace an output token's own (`output_embeds`, from the model's feedback hook: a talker feeds
back the sum of a frame's codebook embeddings).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.ar.inputs import MultimodalInput, PromptInput, StreamInput
from omnistage.errors import StageError
from omnistage.outputs import RequestMetrics
from omnistage.sampling_params import SamplingParams

TokenLogprobs = dict[int, float]  # top-N token id -> logprob, always including the sampled token


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, recomputed from scratch
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    STOP = "stop"        # eos, stop token id or stop string
    LENGTH = "length"    # max_tokens or the model's maximum length
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # (P, hidden): replaces the embeddings of the prompt positions; prompt_token_ids then holds
    # P placeholder ids (used for penalties and hashing only; such prompts skip prefix caching).
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache (last admission)
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_hidden_emitted: int = 0         # positions whose hidden states were already sent
    generator: torch.Generator | None = None  # per-request RNG when sampling_params.seed is set
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    prompt: PromptInput = field(default_factory=PromptInput)   # embeddings, still arriving
    stream: StreamInput | None = None        # upstream rows added to its decodes
    mm: MultimodalInput | None = None        # rotary positions, deepstack
    output_embeds: list[torch.Tensor] = field(default_factory=list)  # (hidden,) per output
    # payloads (hidden rows) of the prefix-cache hit's blocks, until the engine sends them
    cached_payloads: list[object] = field(default_factory=list)
    # shadow sequences (ar/shadows.py): extra contexts run with this one, by the model's key;
    # a shadow names its owner and keeps its last row's final hidden state
    shadows: dict = field(default_factory=dict)
    owner: Sequence | None = None
    last_hidden: Tensor | None = None

    @property
    def penalty_prompt_ids(self) -> list[int]:
        """Prompt ids that count for repetition penalties (not placeholders)."""
        if self.prompt.embeds is not None and not self.prompt.ids_real:
            return []
        return self.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, idx: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[idx] if idx < p else self.output_token_ids[idx - p]

    def cache_id_at(self, idx: int) -> int:
        """What the prefix cache hashes at position idx: the token id, or for an embeddings
        prompt its cache id (PromptInput.cache_ids)."""
        cache_ids = self.prompt.cache_ids
        if cache_ids is not None and idx < len(cache_ids):
            return cache_ids[idx]
        return self.token_id_at(idx)

    @property
    def all_cache_ids(self) -> list[int]:
        cache_ids = self.prompt.cache_ids
        if cache_ids is None:
            return self.all_token_ids
        return cache_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_embeds(self) -> bool:
        """Inputs that token ids do not describe: such sequences skip prefix caching."""
        return self.prompt.embeds is not None or self.stream is not None

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens the model can compute now: owed tokens, less those still waiting for
        upstream input (an open prompt has no outputs; an open stream limits decodes)."""
        end = self.num_tokens
        if self.prompt.open:  # keep the last prompt token back: its logits give the first token
            end = self.num_prompt_tokens - 1
        if self.stream is not None and self.stream.open:
            end = min(end, self.num_prompt_tokens + self.stream.num_rows)
        return max(0, end - self.num_computed_tokens)

    @property
    def wants_hidden(self) -> bool:
        return bool(self.sampling_params.output_hidden_layers)


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    logprobs: list[TokenLogprobs] | None = None
    hidden_states: dict[int, Tensor] | None = None  # layer -> (n, hidden) for new positions
    hidden_start: int = 0                           # position of the first hidden-state row
    num_prompt_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: StageError | None = None                 # the request failed in this step
    metrics: RequestMetrics | None = None           # set when the request finished
    extra: dict[str, Tensor] | None = None          # the model's per-token extras (n, ...)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
