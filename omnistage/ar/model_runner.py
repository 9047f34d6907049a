"""Batch to tensors, one forward pass, logits to tokens.

The runner knows tensors and nothing about queues: it turns a `ScheduledBatch` into a flattened
input (prefill chunks and decodes together), publishes the attention metadata, runs the model
once, samples where a sequence reached its last token, and slices out the hidden states a
downstream stage asked for.

On CUDA, steps where every sequence decodes one output token replay a CUDA graph instead
(`DecodeGraphs`): one graph per batch-size bucket, captured at start-up over static input
buffers, the batch padded up to the bucket. Decodes fed embeddings (stream rows added, the
model's feedback embeddings) build their input rows eagerly and replay a variant that reads
them from a static buffer. Sampling and the feedback hook stay outside the graph. Steps with
prompt rows (prefill chunks) run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omnistage.ar.kv_cache import KVCacheLayout
from omnistage.ar.sampler import Sampler, TokenLogprobs
from omnistage.ar.scheduler import ScheduledBatch
from omnistage.ar.sequence import Sequence
from omnistage.layers.attention import (Attention, AttentionBackend, AttentionMetadata,
                                        forward_context, get_attention_backend)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[int | None]                      # per batch row: new token or None (mid-prompt)
    logprobs: list[TokenLogprobs | None]
    hidden_states: list[dict[int, Tensor] | None]  # per row: layer -> (n, hidden) new positions
    extras: list[dict[str, Tensor] | None] | None = None  # per row: the feedback hook's outputs


class ModelRunner:
    def __init__(self, model: nn.Module, layout: KVCacheLayout, device: torch.device,
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
                                  device, getattr(model, "uses_mrope", False))
            self.graphs = graphs if graphs.capture_all() else None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        capture = tuple(sorted({i for s in batch.seqs
                                for i in s.sampling_params.output_hidden_layers}))
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
        if rows:
            logits = self.model.compute_logits(last)
            out = self.sampler(logits, [batch.seqs[i] for i in rows], self.eos_token_ids,
                               inplace=True)
            for j, i in enumerate(rows):
                sampled[i] = out.token_ids[j]
                logprobs[i] = out.logprobs[j]
        extras = None
        feedback = getattr(self.model, "feedback", None)
        if rows and feedback is not None:
            # the model decides what its sampled tokens feed back (and may emit more per row)
            seqs = [batch.seqs[i] for i in rows]
            embeds_out, extra_rows = feedback(last, torch.tensor(
                [sampled[i] for i in rows], device=self.device), seqs)
            extras = [None] * len(batch.seqs)
            for j, i in enumerate(rows):
                batch.seqs[i].output_embeds.append(embeds_out[j])
                extras[i] = extra_rows[j]
        hidden_out = self._slice_hidden(batch, qsl, captured, copy=graphed is not None)
        return RunnerOutput(sampled, logprobs, hidden_out, extras)

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
            num_prompt = seq.num_prompt_tokens
            if start + n <= num_prompt:
                ids += seq.prompt_token_ids[start:start + n]
            else:
                ids += seq.prompt_token_ids[start:]
                ids += seq.output_token_ids[max(0, start - num_prompt):start + n - num_prompt]
            pos.extend(range(start, start + n))
            table = seq.block_table
            p = start
            while p < start + n:  # one run of slots per block
                block_idx, offset = divmod(p, bs)
                run = min(start + n - p, bs - offset)
                first = table[block_idx] * bs + offset
                slots.extend(range(first, first + run))
                p += run
            _embed_rows(seq, start, n, qsl[-1], embed_rows, stream_rows)
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
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self._embed(input_ids, embed_rows, stream_rows)

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
    if seq.prompt_embeds is not None and start < num_prompt:
        stop = min(start + n, num_prompt)
        embed_rows.append((row0, seq.prompt_embeds[start:stop]))
    if start + n <= num_prompt:
        return
    t0 = max(start, num_prompt) - num_prompt      # output index of the first decode input
    if seq.output_embeds:
        # fed-back outputs the model embedded itself (its feedback hook)
        t1 = min(start + n - num_prompt, len(seq.output_embeds))
        if t1 > t0:
            embed_rows.append((row0 + (t0 + num_prompt - start),
                               torch.stack(seq.output_embeds[t0:t1])))
    if seq.stream_embeds is not None or seq.stream_pad is not None:
        # decode inputs P + t get upstream's t-th stream embedding added (past a closed
        # stream's end: its pad embedding)
        num_stream = 0 if seq.stream_embeds is None else seq.stream_embeds.shape[0]
        t1 = min(start + n - num_prompt, num_stream)
        if t1 > t0:
            stream_rows.append((row0 + (t0 + num_prompt - start), seq.stream_embeds[t0:t1]))
        if seq.stream_pad is not None and not seq.stream_open:
            p0 = max(t0, num_stream)
            p1 = start + n - num_prompt
            if p1 > p0:
                stream_rows.append((row0 + (p0 + num_prompt - start),
                                    seq.stream_pad.expand(p1 - p0, -1)))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every 16 up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """CUDA graphs of the decode-only forward pass, one per batch-size bucket.

    Static device buffers hold what the forward pass reads; a step writes its rows into them,
    pads the batch up to the next bucket and replays that bucket's graph:

        input_ids, slot_mapping   (N,) int64      padding rows: id 0, slot -1 (no cache write)
        positions                 (N,) or (3, N)  int64 (M-RoPE models: rows t, h, w)
        seq_lens                  (N,) int32      padding rows: 0 (attend to nothing)
        block_tables              (N, max_blocks) int32; only [:B, :width] is rewritten, the
                                  kernel never reads past a row's own blocks
        query_start_loc           (N+1,) = 0, 1, ..., N (one query each)
        embeds                    (N, hidden)     only for batches fed embeddings (a talker's
                                  stream rows and feedback): the runner builds the rows
                                  eagerly, the graph variant that reads them replays the layers

    Graphs share one memory pool and are captured largest first. A model whose forward pass
    synchronises with the host (an MoE layer that reads expert counts) cannot be captured:
    `capture_all` finds that out in a warm-up pass run in torch's sync-debug "error" mode and
    returns False. Graphs that also return hidden states of some layers (a downstream stage
    asked for them) and the embedding-fed variants are captured on first use; an embedding-fed
    capture that fails leaves those batches eager.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, mrope: bool) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.mrope = mrope
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        num_pos = 3 * n if mrope else n
        self._ints = torch.zeros(2 * n + num_pos, dtype=torch.int64, device=device)
        self.input_ids = self._ints[:n]
        self.slot_mapping = self._ints[n:2 * n]
        self.positions = self._ints[2 * n:].view(3, n) if mrope else self._ints[2 * n:]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.slot_mapping.fill_(-1)
        self.embeds: Tensor | None = None    # allocated at the first embedding-fed batch
        self.embeds_ok = True
        # (bucket, captured layers, embedding-fed) -> graph, its metadata, hidden (bucket, H),
        # captured states
        self.graphs: dict[tuple[int, tuple[int, ...], bool],
                          tuple[torch.cuda.CUDAGraph, AttentionMetadata, Tensor,
                                dict[int, Tensor]]] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs, max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size)

    def _forward(self, bs: int, md: AttentionMetadata, capture: tuple[int, ...],
                 embeds: bool = False) -> tuple[Tensor, dict[int, Tensor]]:
        positions = self.positions[:, :bs] if self.mrope else self.positions[:bs]
        with forward_context(md):
            return self.model(self.input_ids[:bs], positions,
                              self.embeds[:bs] if embeds else None, capture)

    def capture_all(self) -> bool:
        """Capture every bucket without hidden-state outputs; False if the model can't be."""
        md = self._metadata(self.sizes[-1])
        self.backend.prepare(md, has_cache=True)
        self._forward(self.sizes[-1], md, ())         # compiles kernels, plans the backend
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._forward(self.sizes[-1], md, ())
        except RuntimeError as exc:
            logger.info("no CUDA graphs: the forward pass synchronises with the host (%s)",
                        str(exc).splitlines()[0])
            return False
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        for bs in reversed(self.sizes):
            self._capture(bs, ())
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        return True

    def _capture(self, bs: int, capture: tuple[int, ...], embeds: bool = False) -> None:
        md = self._metadata(bs)
        self.backend.prepare(md, has_cache=True)
        # The warm-up really runs: with the last replay's slots still in the buffer it would
        # write K/V over positions that may since belong to other sequences. Slot -1 writes
        # nothing; `run` fills the real slots before every replay.
        self.slot_mapping.fill_(-1)
        self._forward(bs, md, capture, embeds)        # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: stages of the inproc backend launch work from other threads while
        # a graph is captured mid-run (lazily); only this thread's calls are checked
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden, captured = self._forward(bs, md, capture, embeds)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, capture, embeds)] = (graph, md, hidden, captured)

    @staticmethod
    def needs_embeds(batch: ScheduledBatch) -> bool:
        """Whether some decode input is not just its token's embedding."""
        return any(seq.output_embeds or seq.stream_embeds is not None
                   or seq.stream_pad is not None for seq in batch.seqs)

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Every sequence decodes one token past its prompt."""
        if len(batch.seqs) > self.sizes[-1]:
            return False
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if (n != 1 or seq.num_computed_tokens < seq.num_prompt_tokens
                    or len(seq.block_table) > self.max_blocks):
                return False
        return self.embeds_ok or not self.needs_embeds(batch)

    def run(self, batch: ScheduledBatch, capture: tuple[int, ...], embeds: Tensor | None = None
            ) -> tuple[Tensor, dict[int, Tensor]] | None:
        """Replay the bucket's graph on this batch (embeds (B, H): the inputs' embeddings, for
        the embedding-fed variant): -> hidden (B, H), captured layers (B, H) (views of the
        graph's output buffers, valid until the next replay); None if that variant could not
        be captured (the caller runs the batch eagerly)."""
        num_seqs = len(batch.seqs)
        bs = next(s for s in self.sizes if s >= num_seqs)
        key = (bs, capture, embeds is not None)
        if embeds is not None:
            if self.embeds is None:
                self.embeds = torch.zeros(self.sizes[-1], embeds.shape[1], dtype=embeds.dtype,
                                          device=embeds.device)
            self.embeds[:num_seqs].copy_(embeds)
        if key not in self.graphs:
            try:
                self._capture(*key)
            except Exception:
                if embeds is None:
                    raise
                logger.warning("decodes fed embeddings run without CUDA graphs: capture "
                               "failed", exc_info=True)
                self.embeds_ok = False
                return None
        graph, _, hidden, captured = self.graphs[key]

        n, page = self.sizes[-1], self.block_size
        ids = [0] * n
        slots = [-1] * n
        pos = [0] * n
        lens = [0] * n
        width = 0
        for i, seq in enumerate(batch.seqs):
            p = seq.num_computed_tokens
            ids[i] = seq.output_token_ids[p - seq.num_prompt_tokens]
            slots[i] = seq.block_table[p // page] * page + p % page
            pos[i] = p + seq.rope_delta if self.mrope else p
            lens[i] = p + 1
            width = max(width, len(seq.block_table))
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        host = torch.tensor(ids + slots + (pos * 3 if self.mrope else pos), dtype=torch.int64)
        self._ints.copy_(host, non_blocking=True)
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(torch.tensor(tables, dtype=torch.int32),
                                                   non_blocking=True)
        graph.replay()
        self.num_replays += 1
        return hidden[:num_seqs], {layer: h[:num_seqs] for layer, h in captured.items()}
