"""Batch to tensors, one forward pass, logits to tokens.

The runner knows tensors and nothing about queues: it turns a `ScheduledBatch` into a flattened
input (prefill chunks and decodes together), publishes the attention metadata, runs the model
once, samples where a sequence reached its last token, and slices out the hidden states a
downstream stage asked for.

On CUDA, steps where every sequence decodes one output token replay a CUDA graph instead
(`DecodeGraphs`, cuda_graphs.py): one graph per batch-size bucket, captured at start-up over
static input buffers, the batch padded up to the bucket. Decodes fed embeddings (stream rows
added, the model's feedback embeddings) build their input rows eagerly and replay a variant
that reads them from a static buffer. Sampling and the feedback hook stay outside the graph.
Steps with prompt rows (prefill chunks) run eagerly. `launch_decode` / `resolve` split a
graph-replayed decode step in two for the engine's async scheduling: launch and sample on the
device (the tokens' copies to the host started behind them), then read.

The plain graphs (no hidden-state outputs, fed token ids) are captured when the runner is
built; the variants with hidden-state outputs or fed embeddings when the stage asks for them
at start-up (`AREngine.capture_decode_graphs`), or else by the first step that needs each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from omnistage.ar.cuda_graphs import DecodeGraphs
from omnistage.ar.kv_cache import KVCacheLayout
from omnistage.ar.sampler import DeviceSample, Sampler, TokenLogprobs
from omnistage.ar.scheduler import ScheduledBatch
from omnistage.ar.sequence import Sequence
from omnistage.layers.attention import (Attention, AttentionMetadata, forward_context,
                                        get_attention_backend)
from omnistage.models.causal_lm import CausalLM
from omnistage.utils import trace
from omnistage.utils.host import int_matrix, int_tensor


@dataclass(slots=True)
class PendingStep:
    """A decode step launched on the device whose sampled tokens are not read yet."""
    seqs: list[Sequence]
    sampled: DeviceSample                      # token ids on the device, copies under way

    @property
    def token_ids(self) -> Tensor:
        return self.sampled.token_ids


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[int | None]                      # per batch row: new token or None (mid-prompt)
    logprobs: list[TokenLogprobs | None]
    hidden_states: list[dict[int, Tensor] | None]  # per row: layer -> (n, hidden) new positions
    extras: list[dict[str, Tensor] | None] | None = None  # per row: the feedback hook's outputs


def capture_key(layers: Iterable[int]) -> tuple[int, ...]:
    """The hidden layers a step captures, as its CUDA graphs are keyed: sorted, each once."""
    return tuple(sorted(set(layers)))


class ModelRunner:
    def __init__(self, model: CausalLM, layout: KVCacheLayout, device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto", seed: int = 0, *,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 enforce_eager: bool = False) -> None:
        """enforce_eager: never use CUDA graphs. max_num_seqs / max_model_len size the graphs'
        static buffers (the largest batch, the longest block table)."""
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(seed)
        self.eos_token_ids: tuple[int, ...] = ()
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if len(self.attn_layers) != layout.num_layers:    # each gets a whole cache: say so early
            raise RuntimeError(f"the model has {len(self.attn_layers)} paged attention layers, "
                               f"its KV cache layout {layout.num_layers}")
        group = (self.attn_layers[0].num_heads // self.attn_layers[0].num_kv_heads
                 if self.attn_layers else 1)
        self.backend = get_attention_backend(attention_backend, device, layout.block_size, group,
                                             layout.num_kv_heads)
        backend = self.backend
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        for layer in self.attn_layers:
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.backend = backend
        self.graphs: DecodeGraphs | None = None
        if (device.type == "cuda" and not enforce_eager
                and getattr(backend, "supports_cuda_graphs", False)):
            max_blocks = layout.num_blocks if max_model_len is None else min(
                layout.num_blocks, -(-max_model_len // layout.block_size))
            graphs = DecodeGraphs(model, backend, layout.block_size, max_num_seqs, max_blocks,
                                  device, model.uses_mrope)
            self.graphs = graphs if graphs.capture_all() else None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        capture = capture_key(i for s in batch.seqs
                              for i in s.sampling_params.output_hidden_layers)
        rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        graphed = None
        if self.graphs is not None and self.graphs.can_run(batch):
            # decodes fed embeddings (a talker's stream rows, feedback embeddings) replay the
            # graph variant that reads a static embedding buffer, built here eagerly
            embeds = self._decode_embeds(batch) if DecodeGraphs.needs_embeds(batch) else None
            graphed = self.graphs.run(batch, capture, embeds)
        if graphed is not None:
            hidden, captured = graphed                          # (B, hidden): one row a seq
            qsl = list(range(len(batch.seqs) + 1))
            last = hidden if len(rows) == len(batch.seqs) else hidden[rows]
        else:
            input_ids, positions, md, embeds, extra = self._prepare(batch)
            self.backend.prepare(md, has_cache=True)
            with forward_context(md):
                hidden, captured = self.model(input_ids, positions, embeds, capture, **extra)
            qsl = md.query_start_loc_cpu
            if rows:
                last = hidden[torch.tensor([qsl[i + 1] - 1 for i in rows], device=self.device)]

        sampled: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(batch.seqs)
        extras = None
        if rows:
            seqs = [batch.seqs[i] for i in rows]
            logits = self.model.compute_logits(last)
            on_device = self.sampler.sample(logits, seqs, self.eos_token_ids, inplace=True)
            feedback = self.model.feedback
            if feedback is not None:
                # the model decides what its sampled tokens feed back (and may emit more per
                # row), launched behind the sampling: the host waits once, for both
                w0 = time.time()
                embeds_out, extra_rows = feedback(last, on_device.token_ids, seqs)
                trace.span("feedback", w0, rows=len(rows))
                extras = [None] * len(batch.seqs)
                for j, i in enumerate(rows):
                    batch.seqs[i].output_embeds.append(embeds_out[j])
                    extras[i] = extra_rows[j]
            out = self.sampler.to_host(on_device, seqs)
            for j, i in enumerate(rows):
                sampled[i] = out.token_ids[j]
                logprobs[i] = out.logprobs[j]
        hidden_out = self._slice_hidden(batch, qsl, captured, copy=graphed is not None)
        return RunnerOutput(sampled, logprobs, hidden_out, extras)

    @torch.inference_mode()
    def launch_decode(self, batch: ScheduledBatch, prev_tokens: Tensor | None = None
                      ) -> PendingStep:
        """Launch a decode step from its CUDA graph and sample on the device, reading nothing
        back (`resolve` does). prev_tokens: the step is the one after a launched step whose
        tokens (B,) are still on the device: they are its inputs, one position further on
        (the caller allocated the blocks). Only for batches `DecodeGraphs.can_run` takes,
        without embeddings, hidden-state outputs or a feedback hook."""
        graphed = self.graphs.run(batch, (), None, prev_tokens)    # type: ignore[union-attr]
        assert graphed is not None
        logits = self.model.compute_logits(graphed[0])
        return PendingStep(batch.seqs, self.sampler.sample(
            logits, batch.seqs, self.eos_token_ids, inplace=True, pending=prev_tokens))

    def resolve(self, pending: PendingStep) -> RunnerOutput:
        """Read a launched step's tokens (waiting for the device) and logprobs."""
        out = self.sampler.to_host(pending.sampled, pending.seqs)
        return RunnerOutput(out.token_ids, out.logprobs, [None] * len(pending.seqs))

    def _prepare(self, batch: ScheduledBatch
                 ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor | None, dict]:
        bs = self.layout.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        embed_rows: list[tuple[int, Tensor]] = []   # (first row in batch, (n, hidden)): replace
        stream_rows: list[tuple[int, Tensor]] = []  # (first row in batch, (n, hidden)): add
        mrope = self.model.uses_mrope
        pos3: list[Tensor] = []                     # (3, n) per row when the model uses M-RoPE
        deep_rows: list[Tensor] = []                # deepstack: batch rows and their features
        deep_feats: list[Tensor] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids += _token_ids(seq, start, n)
            pos.extend(range(start, start + n))
            _add_slots(slots, seq.block_table, start, n, bs)
            _embed_rows(seq, start, n, qsl[-1], embed_rows, stream_rows)
            if mrope:
                pos3.append(_mrope_rows(seq, start, n))
            deep = _deepstack_rows(seq, start, n)
            if deep is not None:
                deep_rows.append(deep[0] + qsl[-1])
                deep_feats.append(deep[1])
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)

        tables = [s.block_table for s in batch.seqs]
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=int_tensor(slots).to(dev),
            query_start_loc=int_tensor(qsl, torch.int32).to(dev),
            seq_lens=int_tensor(seq_lens, torch.int32).to(dev),
            block_tables=int_matrix(tables, max(map(len, tables))).to(dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens))
        input_ids = int_tensor(ids).to(dev)
        if mrope:
            positions = torch.cat(pos3, dim=1).to(dev)                     # (3, T)
        else:
            positions = int_tensor(pos).to(dev)
        extra: dict = {}
        if deep_rows:
            extra["deepstack"] = (torch.cat(deep_rows).to(dev),
                                  torch.cat(deep_feats, dim=1).to(dev, self.dtype))
        embeds = None
        if embed_rows or stream_rows:
            embeds = self._embed(input_ids, embed_rows, stream_rows)
        return input_ids, positions, md, embeds, extra

    def _embed(self, input_ids: Tensor, embed_rows: list[tuple[int, Tensor]],
               stream_rows: list[tuple[int, Tensor]]) -> Tensor:
        """The token embeddings of input_ids with `embed_rows` replacing and `stream_rows`
        added to the rows they start at."""
        embeds = self.model.embed_input_ids(input_ids)
        for row, e in embed_rows:
            embeds[row:row + e.shape[0]] = e.to(device=embeds.device, dtype=embeds.dtype)
        for row, e in stream_rows:
            embeds[row:row + e.shape[0]] += e.to(device=embeds.device, dtype=embeds.dtype)
        return embeds

    def _decode_embeds(self, batch: ScheduledBatch) -> Tensor:
        """(B, hidden) input embeddings of a decode-only batch, as `_prepare` builds them."""
        ids: list[int] = []
        embed_rows: list[tuple[int, Tensor]] = []
        stream_rows: list[tuple[int, Tensor]] = []
        for i, seq in enumerate(batch.seqs):
            p = seq.num_computed_tokens
            ids.append(seq.output_token_ids[p - seq.num_prompt_tokens])
            _embed_rows(seq, p, 1, i, embed_rows, stream_rows)
        return self._embed(int_tensor(ids).to(self.device), embed_rows, stream_rows)

    @staticmethod
    def _slice_hidden(batch: ScheduledBatch, qsl: list[int], captured: dict[int, Tensor],
                      copy: bool = False) -> list[dict[int, Tensor] | None]:
        """Hidden states of positions not sent before (recompute after preemption re-runs
        positions that were already sent; a downstream stage must see each exactly once).
        copy: the rows live in a CUDA graph's output buffer, which the next replay overwrites."""
        out: list[dict[int, Tensor] | None] = []
        for i, seq in enumerate(batch.seqs):
            layers = seq.sampling_params.output_hidden_layers
            if not layers:
                out.append(None)
                continue
            start = seq.num_computed_tokens
            skip = max(0, seq.num_hidden_emitted - start)
            lo, hi = qsl[i] + skip, qsl[i + 1]
            if lo >= hi:
                out.append(None)
                continue
            out.append({layer: captured[layer][lo:hi].clone() if copy else captured[layer][lo:hi]
                        for layer in layers})
            seq.num_hidden_emitted = start + (hi - qsl[i])
        return out


def _embed_rows(seq: Sequence, start: int, n: int, row0: int,
                embed_rows: list[tuple[int, Tensor]], stream_rows: list[tuple[int, Tensor]]
                ) -> None:
    """Where positions start .. start+n-1 of seq (batch rows row0 ..) take embeddings other
    than their tokens': (row, rows) appended to embed_rows (replace) and stream_rows (add)."""
    num_prompt = seq.num_prompt_tokens
    if seq.prompt.embeds is not None and start < num_prompt:
        stop = min(start + n, num_prompt)
        embed_rows.append((row0, seq.prompt.embeds[start:stop]))
    if start + n <= num_prompt:
        return
    t0 = max(start, num_prompt) - num_prompt      # output index of the first decode input
    if seq.output_embeds:
        # fed-back outputs the model embedded itself (its feedback hook)
        t1 = min(start + n - num_prompt, len(seq.output_embeds))
        if t1 > t0:
            embed_rows.append((row0 + (t0 + num_prompt - start),
                               torch.stack(seq.output_embeds[t0:t1])))
    stream = seq.stream
    if stream is not None:
        # decode inputs P + t get upstream's t-th stream embedding added (past a closed
        # stream's end: its pad embedding)
        num_stream = stream.num_rows
        t1 = min(start + n - num_prompt, num_stream)
        if t1 > t0:
            stream_rows.append((row0 + (t0 + num_prompt - start), stream.embeds[t0:t1]))
        if stream.pad is not None and not stream.open:
            p0 = max(t0, num_stream)
            p1 = start + n - num_prompt
            if p1 > p0:
                stream_rows.append((row0 + (p0 + num_prompt - start),
                                    stream.pad.expand(p1 - p0, -1)))


def _token_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """The ids of positions start .. start+n-1: prompt, then output tokens."""
    num_prompt = seq.num_prompt_tokens
    if start + n <= num_prompt:
        return seq.prompt_token_ids[start:start + n]
    return [*seq.prompt_token_ids[start:],
            *seq.output_token_ids[max(0, start - num_prompt):start + n - num_prompt]]


def _add_slots(slots: list[int], table: list[int], start: int, n: int, bs: int) -> None:
    """The KV cache slots of positions start .. start+n-1, one run per block."""
    p = start
    while p < start + n:
        block_idx, offset = divmod(p, bs)
        run = min(start + n - p, bs - offset)
        first = table[block_idx] * bs + offset
        slots.extend(range(first, first + run))
        p += run


def _mrope_rows(seq: Sequence, start: int, n: int) -> Tensor:
    """(3, n) multimodal rotary positions: the prompt's own where it has them, else the text
    position shifted by the request's rope delta."""
    mm = seq.mm
    rows3 = (torch.arange(start, start + n) + (mm.rope_delta if mm else 0)).expand(3, n).clone()
    num_prompt = seq.num_prompt_tokens
    if mm is not None and mm.positions is not None and start < num_prompt:
        stop = min(start + n, num_prompt)
        rows3[:, :stop - start] = mm.positions[:, start:stop]
    return rows3


def _deepstack_rows(seq: Sequence, start: int, n: int) -> tuple[Tensor, Tensor] | None:
    """The deepstack features falling in positions start .. start+n-1: (their rows counted
    from start, (L, k, hidden)), or None."""
    if seq.mm is None or seq.mm.deepstack is None or start >= seq.num_prompt_tokens:
        return None
    at, feats = seq.mm.deepstack                                  # (K,), (L, K, hidden)
    keep = (at >= start) & (at < start + n)
    if not bool(keep.any()):
        return None
    return at[keep] - start, feats[:, keep]
