"""MiMo-Audio's patch decoder as tensor work alone, and its CUDA graphs.

`decode_rows` is `MiMoAudioForCausalLM.decode_patches` without Python in the loop's data
path: B rows through group_size + max(delays) passes of the local transformer over a growing
sequence (lengths 1 .. L), the attention metadata of each (B, length) built once
(`DenseMetas`) and every draw taken from tensors (`RowSampling`): per-row temperature, top-k,
top-p and the Exponential(1) noise of the exponential race, drawn before the decode from
each request's own generator (`row_sampling`) in the order and sizes the per-row draws of
`decode_patches` take them:

    for step t in 0 .. L-1, for channel c with delays[c] <= t < delays[c] + group_size:
        vocab_sizes[c] draws (frame t - delays[c] of channel c)

so a seeded request's ids equal its per-row draws. No host sync and no tensor built from a
list inside: `PatchGraphs` replays it from CUDA graphs, one per batch-size bucket, greedy and
sampled (`RowGraphs`).

    noise (B, group_size, channels, max vocab): row b, frame f, channel c -> the first
    vocab_sizes[c] entries (the rest unused)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from omnistage.layers.attention import AttentionMetadata, forward_context
from omnistage.layers.graph_capture import RowGraphs
from omnistage.layers.sampling import GREEDY_EPS, apply_top_k_top_p
from omnistage.models.qwen2 import Qwen2Model

# `model` below: a MiMoAudioForCausalLM (model.py imports this module)


def dense_metadata(n: int, length: int, dev: torch.device) -> AttentionMetadata:
    """The metadata of N cache-less sequences of one length (read by the dense backends)."""
    qsl = list(range(0, n * length + 1, length))
    return AttentionMetadata(
        slot_mapping=torch.zeros(n * length, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.full((n,), length, dtype=torch.int32, device=dev),
        block_tables=torch.zeros(n, 1, dtype=torch.int32, device=dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=[length] * n, max_query_len=length,
        max_seq_len=length)


class DenseMetas:
    """Per (N, device): the metadata and positions of N sequences of each length 1 .. L, made
    at the first decode of N rows (a graph's warm-up run) and kept."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.metas: dict[tuple[int, torch.device], list[tuple[AttentionMetadata, Tensor]]] = {}

    def get(self, n: int, dev: torch.device) -> list[tuple[AttentionMetadata, Tensor]]:
        key = (n, dev)
        if key not in self.metas:
            self.metas[key] = [(dense_metadata(n, length, dev),
                                torch.arange(length, device=dev).repeat(n))
                               for length in range(1, self.max_length + 1)]
        return self.metas[key]


def forward_dense(model: Qwen2Model, embeds: Tensor, md: AttentionMetadata,
                  positions: Tensor) -> Tensor:
    """embeds (N, L, hidden) with md, positions of `dense_metadata(N, L)` -> the decoder's
    output after its final norm, (N, L, hidden)."""
    n, length, hidden = embeds.shape
    model.layers[0].self_attn.attn.backend.prepare(md, False)
    with forward_context(md):
        h, _ = model(positions, positions, embeds.reshape(n * length, hidden))
    return h.view(n, length, -1)


class RowSampling(NamedTuple):
    """Per row (B,): temperature (float32; < GREEDY_EPS: greedy), top_k (int64; 0: off),
    top_p (float32), and noise (B, group_size, channels, max vocab) float32."""
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    noise: Tensor


def row_sampling(model: nn.Module, seqs: list, dev: torch.device
                 ) -> RowSampling | None:
    """The draws of one decode of `seqs`' rows: None when every row is greedy; else each
    seeded row's noise from its own generator (`seq.generator`, in `decode_patches`' order
    and sizes: g x channels small draws), the unseeded rows' in one draw from the global
    generator; greedy rows' noise is unused."""
    params = [s.sampling_params for s in seqs]
    if all(p.temperature < GREEDY_EPS for p in params):
        return None
    cfg, b = model.cfg, len(seqs)
    noise = torch.ones(b, cfg.group_size, cfg.audio_channels, max(cfg.vocab_sizes),
                       device=dev)
    unseeded = []
    for i, (s, p) in enumerate(zip(seqs, params)):
        gen = getattr(s, "generator", None)
        if p.temperature < GREEDY_EPS:
            continue
        if gen is None:
            unseeded.append(i)
            continue
        for t in range(cfg.group_size + max(cfg.delays)):
            for c, delay in enumerate(cfg.delays):
                if delay <= t < delay + cfg.group_size:
                    noise[i, t - delay, c, :cfg.vocab_sizes[c]].exponential_(generator=gen)
    if unseeded:                   # no order to keep: one draw from the global generator
        noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_()
    return RowSampling(
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev), noise)


def sample_rows(logits: Tensor, s: RowSampling, noise: Tensor) -> Tensor:
    """(B, V) float32 logits -> (B,) ids, each row as `model._drawer`'s draw takes it alone:
    logits / temperature (on CUDA times its reciprocal, as a division by a host scalar runs
    there), top-k, top-p, softmax, argmax(probs / q) over the tokens left, q = noise (B, V);
    greedy rows the argmax."""
    vocab = logits.shape[1]
    is_greedy = s.temperature < GREEDY_EPS
    temperature = torch.where(is_greedy, 1.0, s.temperature)[:, None]
    x = logits * (1.0 / temperature) if logits.is_cuda else logits / temperature
    x = apply_top_k_top_p(x, torch.where(s.top_k > 0, s.top_k, vocab), s.top_p)
    probs = torch.softmax(x, dim=-1)
    race = torch.where(probs > 0, probs / noise.clamp_min(torch.finfo(noise.dtype).tiny), -1.0)
    return torch.where(is_greedy, logits.argmax(-1), race.argmax(-1))


def decode_rows(model: nn.Module, x: Tensor, sampling: RowSampling | None = None
                ) -> Tensor:
    """x (B, hidden_local) the downcast LLM states -> (B, group_size, channels) audio ids:
    `decode_patches` on tensors alone (sampling None: greedy)."""
    cfg, g = model.cfg, model.cfg.group_size
    b = x.shape[0]
    metas = model.patch_metas.get(b, x.device)
    tokens = torch.zeros(b, g, cfg.audio_channels, dtype=torch.long, device=x.device)
    rows = x.new_zeros(b, len(metas), x.shape[1])
    rows[:, 0] = x
    for t, (md, positions) in enumerate(metas):
        h = forward_dense(model.local_transformer, rows[:, :t + 1], md, positions)[:, -1]
        nxt = torch.zeros_like(x)
        for c, delay in enumerate(cfg.delays):
            if not delay <= t < delay + g:
                continue
            logits = model.local_transformer_lm_heads[c](h).float()             # (B, V)
            logits[:, cfg.empty_ids[c]] = float("-inf")
            tok = logits.argmax(-1) if sampling is None else sample_rows(
                logits, sampling, sampling.noise[:, t - delay, c, :logits.shape[1]])
            tokens[:, t - delay, c] = tok
            e = model.speech_embeddings[c](tok)
            nxt = nxt + (e if model.speech_embeddings_to_local is None
                         else model.speech_embeddings_to_local(e))
        if t + 1 < len(metas):
            rows[:, t + 1] = nxt
    return tokens


@dataclass
class PatchGraphs:
    """`decode_rows` replayed from CUDA graphs: greedy and sampled, one per batch-size bucket
    each (`RowGraphs`: a call's rows copied into static buffers, padding rows computed and
    dropped)."""
    greedy: RowGraphs
    sampled: RowGraphs

    @classmethod
    def build(cls, model: nn.Module, max_batch: int, device: torch.device,
              dtype: torch.dtype) -> PatchGraphs:
        cfg = model.cfg
        x = torch.zeros(1, model.hidden_states_downcast.weight.shape[0], dtype=dtype,
                        device=device)
        examples = (x, torch.zeros(1, device=device),
                    torch.zeros(1, dtype=torch.int64, device=device),
                    torch.ones(1, device=device),
                    torch.ones(1, cfg.group_size, cfg.audio_channels, max(cfg.vocab_sizes),
                               device=device))
        return cls(RowGraphs(lambda x: decode_rows(model, x), (x,), max_batch),
                   RowGraphs(lambda x, *s: decode_rows(model, x, RowSampling(*s)), examples,
                             max_batch))

    @property
    def max_batch(self) -> int:
        return self.greedy.sizes[-1]

    @property
    def num_replays(self) -> int:
        return self.greedy.num_replays + self.sampled.num_replays

    def capture_all(self) -> None:
        self.greedy.capture_all()
        self.sampled.capture_all()

    def __call__(self, x: Tensor, sampling: RowSampling | None) -> Tensor:
        return self.greedy(x) if sampling is None else self.sampled(x, *sampling)
