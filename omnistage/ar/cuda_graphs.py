"""CUDA graphs of decode steps (`DecodeGraphs`), replayed by the model runner.

A decode-only step (every sequence one token past its prompt) runs the same kernels at every
step but for its batch size: one graph per batch-size bucket (`graph_batch_sizes`), captured
over static input buffers that each step rewrites, the batch padded up to its bucket.
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omnistage.ar.scheduler import ScheduledBatch
from omnistage.ar.sequence import Sequence
from omnistage.layers import graph_capture, pdl
from omnistage.layers.attention import AttentionBackend, AttentionMetadata, forward_context
from omnistage.utils.host import array_tensor, int_array, int_matrix_array

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeInputs:
    """A decode-only step's host inputs, as `DecodeGraphs.run` writes them into its buffers:
    built from the sequences by rank 0 (`of`), shared as they are with the other ranks of a
    tensor-parallel stage (C int arrays: they pickle as bytes)."""
    num_seqs: int
    ints: array.array          # | ids | slots | positions (N or 3N) |, N the largest bucket
    seq_lens: array.array      # (N,) int32
    block_tables: array.array  # (num_seqs, width) int32, flattened
    width: int

    @staticmethod
    def of(seqs: list[Sequence], block_size: int, num_rows: int, mrope: bool, ahead: bool
           ) -> DecodeInputs:
        """num_rows: the buffers' (the largest bucket). ahead: the step after one launched but
        not read back (async scheduling): one position further on, its ids (0 here) fed on
        the device."""
        num_seqs, page = len(seqs), block_size
        pad = num_rows - num_seqs
        computed = [s.num_computed_tokens + ahead for s in seqs]
        ids = ([0] * num_seqs if ahead else
               [s.output_token_ids[p - s.num_prompt_tokens] for s, p in zip(seqs, computed)])
        slots = [s.block_table[p // page] * page + p % page for s, p in zip(seqs, computed)]
        if mrope:       # rows t, h, w one after another
            rows = [s.mm.position_of(p, s.num_prompt_tokens) if s.mm else (p, p, p)
                    for s, p in zip(seqs, computed)] + [(0, 0, 0)] * pad
            pos = [r[axis] for axis in range(3) for r in rows]
        else:
            pos = computed + [0] * pad
        tables = [s.block_table for s in seqs]
        width = max(map(len, tables))
        return DecodeInputs(
            num_seqs, int_array(ids + [0] * pad + slots + [-1] * pad + pos),
            int_array([p + 1 for p in computed] + [0] * pad, torch.int32),
            int_matrix_array(tables, width), width)

    @property
    def input_ids(self) -> Tensor:
        """(num_seqs,) host token ids (zeros for a step launched ahead)."""
        return array_tensor(self.ints)[:self.num_seqs]


class BucketGraphs:
    """What the decode graphs and the prefill graphs (prefill_graphs.py) share: graphs keyed
    (bucket, captured layers, embedding-fed), each variant's buckets captured largest first
    (`_capture` per class), and the embedding-fed variant's static buffer."""

    sizes: list[int]
    graphs: dict
    embeds: Tensor | None
    input_ids: Tensor

    def _capture(self, size: int, capture: tuple[int, ...], embeds: bool) -> None:
        raise NotImplementedError

    def _capture_buckets(self, capture: tuple[int, ...], embeds: bool) -> None:
        for size in reversed(self.sizes):
            if (size, capture, embeds) not in self.graphs:
                self._capture(size, capture, embeds)

    def _embeds_buffer(self, hidden_size: int, dtype: torch.dtype) -> Tensor:
        """The static (N, hidden) input embeddings of the embedding-fed variant."""
        if self.embeds is None:
            self.embeds = torch.zeros(self.sizes[-1], hidden_size, dtype=dtype,
                                      device=self.input_ids.device)
        # captured graphs read this buffer: a step's rows must fit it without a cast
        assert self.embeds.shape[1] == hidden_size and self.embeds.dtype == dtype, \
            f"embeddings ({hidden_size}, {dtype}) for a buffer of {tuple(self.embeds.shape)}, " \
            f"{self.embeds.dtype}"
        return self.embeds


class DecodeGraphs(BucketGraphs):
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

    Graphs are keyed (bucket, captured layers, embedding-fed), share one memory pool and are
    captured largest first. A model whose forward pass synchronises with the host (an MoE layer
    that reads expert counts) cannot be captured: `capture_all` finds that out in a warm-up pass
    run in torch's sync-debug "error" mode and returns False. `capture_all` captures the plain
    variant (no hidden-state outputs, fed token ids); `capture_variant` captures the others a
    stage knows it will replay (the hidden layers it emits downstream, embedding-fed decodes)
    at start-up, because a capture inside a serving step (its warm-up compiling Triton kernels)
    can take a second. `run` captures any other variant on first use. An embedding-fed capture
    that fails leaves those batches eager.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, mrope: bool) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.mrope = mrope
        self.sizes = graph_capture.graph_batch_sizes(max_num_seqs)
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
        self.embeds: Tensor | None = None    # allocated by the embedding-fed variant's capture
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
        start = time.perf_counter()
        try:
            self._capture_buckets((), False)
        except Exception as exc:
            self.graphs.clear()
            self.pool = None
            if not pdl.is_enabled():
                logger.warning("decodes run without CUDA graphs: capture failed", exc_info=True)
                return False
            # a driver or runtime that cannot record programmatic dependent launches
            logger.warning("CUDA graph capture failed with programmatic dependent launch "
                           "(%s); capturing without it", str(exc).splitlines()[0])
            pdl.set_enabled(False)
            return self.capture_all()
        logger.info("captured CUDA graphs for decode batch sizes %s in %.2f s", self.sizes,
                    time.perf_counter() - start)
        return True

    @torch.inference_mode()        # as `run` captures a variant (inside the runner's execute)
    def capture_variant(self, capture: tuple[int, ...],
                        embeds: tuple[int, torch.dtype] | None = None) -> bool:
        """Capture every bucket of one variant now (those not captured yet), largest first.
        capture: the hidden layers it returns, sorted and unique as `ModelRunner.execute` keys
        them; embeds: (hidden size, dtype) of the model's input embeddings for the
        embedding-fed variant (its static buffer is allocated here), None for the one fed token
        ids. False if an embedding-fed capture failed: those batches run eagerly, as when
        `run` fails to capture one. Any other failure raises."""
        if embeds is not None:
            if not self.embeds_ok:
                return False
            self._embeds_buffer(*embeds)
        fed = embeds is not None
        if all((bs, capture, fed) in self.graphs for bs in self.sizes):
            return True
        start = time.perf_counter()
        try:
            self._capture_buckets(capture, fed)
        except Exception:
            if not fed:
                raise
            logger.warning("decodes fed embeddings run without CUDA graphs: capture failed",
                           exc_info=True)
            self.embeds_ok = False
            for key in [k for k in self.graphs if k[1:] == (capture, True)]:
                del self.graphs[key]
            return False
        logger.info("captured CUDA graphs for decode batch sizes %s (hidden layers %s, fed "
                    "embeddings: %s) in %.2f s", self.sizes, list(capture), fed,
                    time.perf_counter() - start)
        return True

    def _capture(self, bs: int, capture: tuple[int, ...], embeds: bool = False) -> None:
        md = self._metadata(bs)
        self.backend.prepare(md, has_cache=True)
        # The warm-up really runs: with the last replay's slots still in the buffer it would
        # write K/V over positions that may since belong to other sequences. Slot -1 writes
        # nothing; `run` fills the real slots before every replay.
        self.slot_mapping.fill_(-1)
        graph, (hidden, captured) = graph_capture.capture_graph(
            lambda: self._forward(bs, md, capture, embeds), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, capture, embeds)] = (graph, md, hidden, captured)

    @staticmethod
    def needs_embeds(batch: ScheduledBatch) -> bool:
        """Whether some decode input is not just its token's embedding."""
        return any(seq.output_embeds or (seq.stream is not None
                                         and (seq.stream.embeds is not None
                                              or seq.stream.pad is not None))
                   for seq in batch.seqs)

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Every sequence decodes one token past its prompt."""
        if len(batch.seqs) > self.sizes[-1]:
            return False
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if (n != 1 or seq.num_computed_tokens < seq.num_prompt_tokens
                    or len(seq.block_table) > self.max_blocks):
                return False
        return self.embeds_ok or not self.needs_embeds(batch)

    def inputs(self, batch: ScheduledBatch, ahead: bool = False) -> DecodeInputs:
        """The host inputs of a batch `can_run` takes (ahead: see `DecodeInputs.of`)."""
        return DecodeInputs.of(batch.seqs, self.block_size, self.sizes[-1], self.mrope, ahead)

    def run(self, inputs: DecodeInputs, capture: tuple[int, ...], embeds: Tensor | None = None,
            prev_tokens: Tensor | None = None) -> tuple[Tensor, dict[int, Tensor]] | None:
        """Replay the bucket's graph on a batch's inputs (embeds (B, H): the inputs'
        embeddings, for the embedding-fed variant): -> hidden (B, H), captured layers (B, H)
        (views of the graph's output buffers, valid until the next replay); None if that
        variant could not be captured (the caller runs the batch eagerly). prev_tokens (B,):
        the tokens of a step launched but not read back, on the device: this step decodes
        them, one position past what the sequences record (async scheduling, engine.py;
        `inputs` built with ahead)."""
        num_seqs = inputs.num_seqs
        bs = next(s for s in self.sizes if s >= num_seqs)
        key = (bs, capture, embeds is not None)
        if embeds is not None:
            self._embeds_buffer(embeds.shape[1], embeds.dtype)[:num_seqs].copy_(embeds)
        if key not in self.graphs:
            # a variant not captured at start-up (capture_variant): this step pays for it
            logger.info("capturing the CUDA graph of decode key %s on first use", key)
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

        # every row of the buffers: padding rows read id 0, write slot -1, attend to nothing
        self._ints.copy_(array_tensor(inputs.ints), non_blocking=True)
        if prev_tokens is not None:
            self.input_ids[:num_seqs].copy_(prev_tokens)
        self.seq_lens.copy_(array_tensor(inputs.seq_lens), non_blocking=True)
        self.block_tables[:num_seqs, :inputs.width].copy_(
            array_tensor(inputs.block_tables).view(num_seqs, inputs.width), non_blocking=True)
        graph.replay()
        self.num_replays += 1
        return hidden[:num_seqs], {layer: h[:num_seqs] for layer, h in captured.items()}
