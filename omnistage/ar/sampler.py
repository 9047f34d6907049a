"""Logits to token ids: min-tokens mask, penalties, logprobs, greedy, temperature/top-k/top-p/min-p.

Pure tensor code, vectorised over the batch. The order follows vLLM's sampler:

    logits (B, V) --float32--> raw
      1. min_tokens   eos / stop token ids -> -inf while a row has < min_tokens outputs
      2. penalties    repetition (HF rule), frequency and presence (OpenAI rule)
      3. logprobs     log_softmax(raw): the model's own distribution, before steps 1-2 and 5
      4. greedy rows  argmax of the penalised logits
      5. other rows   / temperature -> top-k -> top-p -> min-p -> exponential race

Sampling uses the exponential race `argmax(probs / q)`, `q ~ Exponential(1)` per vocab entry,
which picks token i with probability probs[i]. A seeded request draws its q from its own
generator (`seq.generator`), V values per sampled step, so its tokens depend only on its seed
and its logits, never on what else shares the batch. Unseeded rows share the engine generator.
Greedy rows draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.ar.sequence import Sequence, TokenLogprobs
from omnistage.layers.sampling import GREEDY_EPS, apply_top_k_top_p
from omnistage.utils.host import to_device


@dataclass(slots=True)
class DeviceSample:
    """A batch sampled on the device, on its way to the host (`Sampler.sample`)."""
    token_ids: Tensor                      # (B,) on the sampling device
    host: list[Tensor]                     # host copies: token ids [, top values, top ids,
                                           # sampled token's value], done at `event`
    event: torch.cuda.Event | None         # None: the tensors are on the CPU already
    logprob_rows: list[int]                # rows of the logprob tensors


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]                   # one per row
    logprobs: list[TokenLogprobs | None]   # None where the request did not ask for logprobs


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # engine-wide, per device

    def __call__(self, logits: Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
                 inplace: bool = False) -> SamplerOutput:
        """logits (B, V). inplace: they are the caller's fresh float32 logits, which the
        sampler may change (the runner's); otherwise it works on a copy."""
        return self.to_host(self.sample(logits, seqs, eos_token_ids, inplace), seqs)

    def sample(self, logits: Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
               inplace: bool = False, pending: Tensor | None = None) -> DeviceSample:
        """The device half: token ids and the asked-for logprobs computed, their copies to
        the host started behind them; nothing waits, so the next step can launch before
        these are read (`to_host`). pending (B,): each sequence's last sampled token, still
        on the device only (async scheduling): it counts as an output for min_tokens and the
        penalties."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), \
            f"logits {tuple(logits.shape)} vs {len(seqs)} sequences"
        # Each pass reads and writes B x V floats (39 MB at 64 rows of a 152k vocabulary), so
        # the unprocessed logits are copied aside only when a request asked for logprobs.
        x = logits.float() if inplace else logits.to(torch.float32, copy=True)   # (B, V)
        lp_rows = [i for i, s in enumerate(seqs) if s.sampling_params.logprobs is not None]
        raw = x.clone() if lp_rows else None
        apply_min_tokens(x, seqs, eos_token_ids, int(pending is not None))
        apply_penalties(x, seqs, pending)
        x.nan_to_num_(nan=float("-inf"))

        temps = [s.sampling_params.temperature for s in seqs]
        is_greedy = [t < GREEDY_EPS for t in temps]
        token_ids = x.argmax(dim=-1)                                      # (B,)
        sample_rows = [i for i, g in enumerate(is_greedy) if not g]
        if sample_rows:
            rows = to_device(sample_rows, x.device)
            sampled = self._sample(x[rows], [seqs[i] for i in sample_rows])
            token_ids[rows] = sampled
        tensors = [token_ids]
        if raw is not None:
            tensors += _top_logprobs(raw, seqs, lp_rows, token_ids)
        return DeviceSample(token_ids, *_copy_to_host(tensors), lp_rows)

    @staticmethod
    def to_host(sampled: DeviceSample, seqs: list[Sequence]) -> SamplerOutput:
        """The host half of `sample`: waits for its copies -> token ids and logprobs."""
        if sampled.event is not None:
            sampled.event.synchronize()
        token_list: list[int] = sampled.host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if sampled.logprob_rows:
            top_vals, top_ids, sampled_vals = (t.tolist() for t in sampled.host[1:])
            for r, i in enumerate(sampled.logprob_rows):
                k = seqs[i].sampling_params.logprobs or 0
                entry = dict(zip(top_ids[r][:k], top_vals[r][:k]))
                entry.setdefault(token_list[i], sampled_vals[r])
                logprobs[i] = entry
        return SamplerOutput(token_list, logprobs)

    def _sample(self, x: Tensor, seqs: list[Sequence]) -> Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race.

        x: (S, V) penalised logits of the non-greedy rows. Returns (S,) token ids."""
        dev, vocab_size = x.device, x.shape[1]
        ps = [s.sampling_params for s in seqs]
        temp = to_device([p.temperature for p in ps], dev)[:, None]
        x = x / temp
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
        top_p = [p.top_p for p in ps]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            x = apply_top_k_top_p(x, to_device(top_k, dev),
                                  to_device(top_p, dev))
        probs = torch.softmax(x, dim=-1).nan_to_num_(nan=0.0)             # (S, V)
        min_p = [p.min_p for p in ps]
        if any(m > 0.0 for m in min_p):
            threshold = to_device(min_p, dev)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)

        q = self._exponential(seqs, vocab_size, dev).clamp_min_(torch.finfo(torch.float32).tiny)
        scores = torch.where(probs > 0, probs / q, -1.0)                   # prob 0 never wins
        token_ids = scores.argmax(dim=-1)
        # A row whose distribution degenerated (all -inf or NaN logits) falls back to argmax.
        dead = probs.sum(dim=-1) <= 0
        return torch.where(dead, x.argmax(dim=-1), token_ids)

    def _exponential(self, seqs: list[Sequence], vocab_size: int, dev: torch.device) -> Tensor:
        """(S, V) Exponential(1) draws: seeded rows from their own generator, others in one call."""
        q = torch.empty(len(seqs), vocab_size, device=dev)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling_params.seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab_size, device=dev)
            draws.exponential_(generator=self._engine_generator(dev))
            q[to_device(unseeded, dev)] = draws
        for i, seq in enumerate(seqs):
            seed = seq.sampling_params.seed
            if seed is None:
                continue
            if seq.generator is None:
                seq.generator = torch.Generator(device=dev).manual_seed(seed)
            q[i].exponential_(generator=seq.generator)
        return q

    def _engine_generator(self, dev: torch.device) -> torch.Generator:
        gen = self._generators.get(dev)
        if gen is None:
            gen = self._generators[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        return gen


def apply_min_tokens(x: Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
                     unread: int = 0) -> None:
    """In place: -inf on eos and stop token ids of rows that have fewer than min_tokens outputs."""
    vocab_size = x.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.sampling_params
        if len(seq.output_token_ids) + unread >= p.min_tokens:
            continue
        banned = {*eos_token_ids, *seq.eos_token_ids, *p.stop_token_ids}
        for t in banned:
            if 0 <= t < vocab_size:
                rows.append(i)
                cols.append(t)
    if rows:
        x[to_device(rows, x.device), to_device(cols, x.device)] = float("-inf")


def apply_penalties(x: Tensor, seqs: list[Sequence], pending: Tensor | None = None) -> None:
    """In place: repetition penalty (prompt and output tokens), frequency and presence penalties
    (output tokens only), on the rows that ask for any. pending (B,): one more output token of
    each row, on the device only."""
    rows = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    if not rows:
        return
    dev, vocab_size = x.device, x.shape[1]
    ps = [seqs[i].sampling_params for i in rows]
    rep = to_device([p.repetition_penalty for p in ps], dev)[:, None]
    freq = to_device([p.frequency_penalty for p in ps], dev)[:, None]
    pres = to_device([p.presence_penalty for p in ps], dev)[:, None]
    output_counts = _token_counts([seqs[i].output_token_ids for i in rows], vocab_size, dev)
    prompt_counts = _token_counts([seqs[i].penalty_prompt_ids for i in rows], vocab_size, dev)
    idx = to_device(rows, dev)
    if pending is not None:
        unread = pending[idx][:, None]
        output_counts.scatter_add_(1, unread, torch.ones_like(unread, dtype=output_counts.dtype))
    sub = x[idx]                                                      # (R, V)
    seen = (prompt_counts > 0) | (output_counts > 0)
    scaled = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, scaled, sub)
    sub = sub - freq * output_counts - pres * (output_counts > 0).float()
    x[idx] = sub


def _has_penalty(seq: Sequence) -> bool:
    p = seq.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(token_lists: list[list[int]], vocab_size: int, dev: torch.device) -> Tensor:
    """(R, V) float counts of each token id per row, via scatter_add over a padded id tensor.

    Padding and out-of-range ids (e.g. placeholder ids of embedding prompts) land in an extra
    bin V that is dropped.
    """
    width = max((len(t) for t in token_lists), default=0)
    padded = [t + [vocab_size] * (width - len(t)) for t in token_lists]
    ids = to_device(padded, dev, torch.long).view(len(token_lists), width)
    ids = torch.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=dev)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _top_logprobs(raw: Tensor, seqs: list[Sequence], rows: list[int], token_ids: Tensor
                  ) -> list[Tensor]:
    """On the device, for the rows that asked: the top-N logprobs of the raw (unprocessed)
    logits (values, ids) and the sampled token's."""
    idx = to_device(rows, raw.device)
    logprobs = torch.log_softmax(raw[idx], dim=-1)                        # (R, V)
    n = max(seqs[i].sampling_params.logprobs or 0 for i in rows)
    top_vals, top_ids = logprobs.topk(min(n, raw.shape[1]), dim=-1)
    sampled_vals = logprobs.gather(1, token_ids[idx][:, None])[:, 0]
    return [top_vals, top_ids, sampled_vals]


def _copy_to_host(tensors: list[Tensor]) -> tuple[list[Tensor], torch.cuda.Event | None]:
    """Copies of device tensors into pinned host memory, started now on the current stream
    (ordered behind the kernels that make them, not behind later steps), and an event that
    marks them done; CPU tensors as they are."""
    if not tensors[0].is_cuda:
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
