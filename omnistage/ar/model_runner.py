"""Batch to tensors, one forward pass, logits to tokens.

The runner knows tensors and nothing about queues: it turns a `ScheduledBatch` into a flattened
input (prefill chunks and decodes together), publishes the attention metadata, runs the model
once, samples where a sequence reached its last token, and slices out the hidden states a
downstream stage asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omnistage.ar.kv_cache import KVCacheLayout
from omnistage.ar.sampler import Sampler, TokenLogprobs
from omnistage.ar.scheduler import ScheduledBatch
from omnistage.layers.attention import (Attention, AttentionMetadata, forward_context,
                                        get_attention_backend)


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[int | None]                      # per batch row: new token or None (mid-prompt)
    logprobs: list[TokenLogprobs | None]
    hidden_states: list[dict[int, Tensor] | None]  # per row: layer -> (n, hidden) new positions
    extras: list[dict[str, Tensor] | None] | None = None  # per row: the feedback hook's outputs


class ModelRunner:
    def __init__(self, model: nn.Module, layout: KVCacheLayout, device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto", seed: int = 0) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(seed)
        self.eos_token_ids: tuple[int, ...] = ()
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.backend = get_attention_backend(attention_backend, device, layout.block_size)
        backend = self.backend
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        for layer in self.attn_layers:
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.backend = backend

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        input_ids, positions, md, embeds, extra = self._prepare(batch)
        capture = sorted({i for s in batch.seqs for i in s.sampling_params.output_hidden_layers})
        self.backend.prepare(md, has_cache=True)
        with forward_context(md):
            hidden, captured = self.model(input_ids, positions, embeds, tuple(capture), **extra)

        rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        sampled: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(batch.seqs)
        if rows:
            last_idx = torch.tensor([md.query_start_loc_cpu[i + 1] - 1 for i in rows],
                                    device=self.device)
            logits = self.model.compute_logits(hidden[last_idx])
            out = self.sampler(logits, [batch.seqs[i] for i in rows], self.eos_token_ids)
            for j, i in enumerate(rows):
                sampled[i] = out.token_ids[j]
                logprobs[i] = out.logprobs[j]
        extras = None
        feedback = getattr(self.model, "feedback", None)
        if rows and feedback is not None:
            # the model decides what its sampled tokens feed back (and may emit more per row)
            seqs = [batch.seqs[i] for i in rows]
            embeds_out, extra_rows = feedback(hidden[last_idx], torch.tensor(
                [sampled[i] for i in rows], device=self.device), seqs)
            extras = [None] * len(batch.seqs)
            for j, i in enumerate(rows):
                batch.seqs[i].output_embeds.append(embeds_out[j])
                extras[i] = extra_rows[j]
        return RunnerOutput(sampled, logprobs, self._slice_hidden(batch, md, captured), extras)

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
        mrope = getattr(self.model, "uses_mrope", False)
        pos3: list[Tensor] = []                     # (3, n) per row when the model uses M-RoPE
        deep_rows: list[Tensor] = []                # deepstack: batch rows and their features
        deep_feats: list[Tensor] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            table = seq.block_table
            for p in range(start, start + n):
                ids.append(seq.token_id_at(p))
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            num_prompt = seq.num_prompt_tokens
            if seq.prompt_embeds is not None and start < num_prompt:
                stop = min(start + n, num_prompt)
                embed_rows.append((qsl[-1], seq.prompt_embeds[start:stop]))
            if seq.output_embeds and start + n > num_prompt:
                # fed-back outputs the model embedded itself (its feedback hook)
                t0 = max(start, num_prompt) - num_prompt
                t1 = min(start + n - num_prompt, len(seq.output_embeds))
                if t1 > t0:
                    embed_rows.append((qsl[-1] + (t0 + num_prompt - start),
                                       torch.stack(seq.output_embeds[t0:t1])))
            if start + n > num_prompt and (seq.stream_embeds is not None
                                           or seq.stream_pad is not None):
                # decode inputs P + t get upstream's t-th stream embedding added (past a
                # closed stream's end: its pad embedding)
                num_stream = 0 if seq.stream_embeds is None else seq.stream_embeds.shape[0]
                t0 = max(start, num_prompt) - num_prompt
                t1 = min(start + n - num_prompt, num_stream)
                if t1 > t0:
                    row = qsl[-1] + (t0 + num_prompt - start)
                    stream_rows.append((row, seq.stream_embeds[t0:t1]))
                if seq.stream_pad is not None and not seq.stream_open:
                    p0 = max(t0, num_stream)
                    p1 = start + n - num_prompt
                    if p1 > p0:
                        row = qsl[-1] + (p0 + num_prompt - start)
                        stream_rows.append((row, seq.stream_pad.expand(p1 - p0, -1)))
            if mrope:
                p = torch.arange(start, start + n)
                rows3 = (p + seq.rope_delta).expand(3, n).clone()
                if seq.mrope_positions is not None and start < num_prompt:
                    stop = min(start + n, num_prompt)
                    rows3[:, :stop - start] = seq.mrope_positions[:, start:stop]
                pos3.append(rows3)
            if seq.deepstack is not None and start < num_prompt:
                at, feats = seq.deepstack                         # (K,), (L, K, hidden)
                keep = (at >= start) & (at < start + n)
                if bool(keep.any()):
                    deep_rows.append(at[keep] - start + qsl[-1])
                    deep_feats.append(feats[:, keep])
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)

        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        if mrope:
            positions = torch.cat(pos3, dim=1).to(dev)                     # (3, T)
        extra: dict = {}
        if deep_rows:
            extra["deepstack"] = (torch.cat(deep_rows).to(dev),
                                  torch.cat(deep_feats, dim=1).to(dev, self.dtype))
        embeds = None
        if embed_rows or stream_rows:
            embeds = self.model.embed_input_ids(input_ids)
            for row, e in embed_rows:
                embeds[row:row + e.shape[0]] = e.to(device=dev, dtype=embeds.dtype)
            for row, e in stream_rows:
                embeds[row:row + e.shape[0]] += e.to(device=dev, dtype=embeds.dtype)
        return input_ids, positions, md, embeds, extra

    @staticmethod
    def _slice_hidden(batch: ScheduledBatch, md: AttentionMetadata,
                      captured: dict[int, Tensor]) -> list[dict[int, Tensor] | None]:
        """Hidden states of positions not sent before (recompute after preemption re-runs
        positions that were already sent; a downstream stage must see each exactly once)."""
        out: list[dict[int, Tensor] | None] = []
        for i, seq in enumerate(batch.seqs):
            layers = seq.sampling_params.output_hidden_layers
            if not layers:
                out.append(None)
                continue
            start = seq.num_computed_tokens
            skip = max(0, seq.num_hidden_emitted - start)
            lo, hi = md.query_start_loc_cpu[i] + skip, md.query_start_loc_cpu[i + 1]
            if lo >= hi:
                out.append(None)
                continue
            out.append({layer: captured[layer][lo:hi] for layer in layers})
            seq.num_hidden_emitted = start + (hi - md.query_start_loc_cpu[i])
        return out
