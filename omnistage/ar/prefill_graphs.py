"""CUDA graphs of steps with prompt rows (`PrefillGraphs`): prefills, prefill chunks, and
decodes mixed in with them, replayed by the model runner.

Such a step launches the same few hundred small kernels as a decode step, over more rows: a
prompt of 40 tokens is host-bound (Qwen3-Omni's thinker prefilling 8 prompts: 18 to 20 ms of
launches for under 10 ms on the GPU; Qwen3-TTS's prompt 20 ms for 6 ms), and every new request
waits on it for its first token. So a step of up to `max_tokens` rows replays a graph too: one
per token-count bucket (`prefill_token_sizes`: 16, 32, 64, ... then every 256), captured over
static buffers that each step rewrites, its rows padded up to the bucket:

    input_ids, slot_mapping    (T,) int64      padding rows: id 0, slot -1 (no cache write)
    positions                  (T,) or (3, T)  int64 (M-RoPE models: rows t, h, w)
    query_start_loc            (S+2,) int32    the batch's, then its end repeated
    seq_lens                   (S+1,) int32    the batch's, then 0
    block_tables               (S+1, max_blocks) int32; only [:B, :width] is rewritten
    work                       the attention's program table (`TritonPagedAttention.
                               prefill_work`): every program a bucket's graph launches takes a
                               (sequence, first query) of the batch, the rest take sequence B,
                               a padding sequence with no query and no context
    embeds                     (T, hidden), the embedding-fed variant only: the rows built
                               eagerly (a prompt's embeddings, a stream's additions)

S is the runner's max_num_seqs. Padding rows compute garbage that no output reads: every
operation but attention is row by row, and attention reaches a row only through a sequence.
Graphs are keyed (bucket, captured layers, embedding-fed) and captured largest first into one
memory pool. Logits, sampling and the feedback hook stay outside, as for decodes. A step with
deepstack features (visual rows of a multimodal prompt) runs eagerly, as does one with more
rows or sequences than the buffers hold.

The plan is the `ForwardPlan` rank 0 shares with the other ranks of a tensor-parallel stage,
so every rank replays the same bucket from the same inputs (the collectives inside pair up).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor, nn

from omnistage.ar.cuda_graphs import BucketGraphs
from omnistage.ar.step_plan import ForwardPlan
from omnistage.layers import graph_capture
from omnistage.layers.attention import AttentionBackend, AttentionMetadata, forward_context
from omnistage.utils.host import array_tensor, int_array

logger = logging.getLogger(__name__)

MIN_TOKENS = 16


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """Token-count buckets: powers of two from 16 to 256, then every 256 up to max_tokens
    (which is always one): at most a third of a large step is padding."""
    sizes = []
    n = MIN_TOKENS
    while n < min(max_tokens, 256):
        sizes.append(n)
        n *= 2
    sizes += list(range(256, max_tokens, 256))
    return sizes + [max_tokens]


class PrefillGraphs(BucketGraphs):
    """CUDA graphs of the forward pass of steps with prompt rows, one per token bucket (see
    the module docstring). `capture_all` captures the plain variant (token ids in, no hidden
    states out) and says whether the model can be captured at all; `capture_variant` the
    others a stage knows it needs; `run` captures any other on first use."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int,
                 max_num_seqs: int, max_blocks: int, max_tokens: int, device: torch.device,
                 mrope: bool, pool: tuple[int, int] | None = None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.mrope = mrope
        self.sizes = prefill_token_sizes(max(max_tokens, MIN_TOKENS))
        n, s = self.sizes[-1], max_num_seqs
        self._ints = torch.zeros((5 if mrope else 3) * n, dtype=torch.int64, device=device)
        self.input_ids = self._ints[:n]
        self.slot_mapping = self._ints[n:2 * n]
        self.positions = self._ints[2 * n:].view(3, n) if mrope else self._ints[2 * n:]
        # | query_start_loc (S+2) | seq_lens (S+1) | work (2P) |, one host-to-device copy
        self.num_programs = {t: backend.max_prefill_programs(t, s + 1)  # type: ignore[attr-defined]
                             for t in self.sizes}
        self._meta = torch.zeros(2 * s + 3 + 2 * self.num_programs[n], dtype=torch.int32,
                                 device=device)
        self.query_start_loc = self._meta[:s + 2]
        self.seq_lens = self._meta[s + 2:2 * s + 3]
        self.block_tables = torch.zeros(s + 1, max_blocks, dtype=torch.int32, device=device)
        self.embeds: Tensor | None = None
        self.failed: set[tuple[tuple[int, ...], bool]] = set()   # variants left eager
        self.graphs: dict[tuple[int, tuple[int, ...], bool],
                          tuple[object, Tensor, dict[int, Tensor]]] = {}
        self.pool = pool
        self.num_replays = 0

    # -- capture -----------------------------------------------------------------------------
    def _work(self, tokens: int) -> Tensor:
        base = 2 * self.max_seqs + 3
        return self._meta[base:base + 2 * self.num_programs[tokens]]

    def _metadata(self, tokens: int) -> AttentionMetadata:
        s = self.max_seqs
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables,
            query_start_loc_cpu=[0] * (s + 2), seq_lens_cpu=[0] * (s + 1),
            max_query_len=tokens, max_seq_len=self.max_blocks * self.block_size)
        md.backend_state = self.backend.static_prefill_state(  # type: ignore[attr-defined]
            self._work(tokens))
        return md

    def _forward(self, tokens: int, md: AttentionMetadata, capture: tuple[int, ...],
                 embeds: bool) -> tuple[Tensor, dict[int, Tensor]]:
        positions = self.positions[:, :tokens] if self.mrope else self.positions[:tokens]
        state = md.backend_state
        with forward_context(md):
            out = self.model(self.input_ids[:tokens], positions,
                             self.embeds[:tokens] if embeds else None, capture)
        if md.backend_state is not state:     # the backend re-planned from host lists
            raise RuntimeError("the attention backend re-planned a captured step")
        return out

    def _blank(self) -> None:
        """Inputs a capture's warm-up can run on: no sequence, no cache write."""
        self.slot_mapping.fill_(-1)
        self._meta.zero_()         # every program: sequence 0, which has no query

    def capture_all(self) -> bool:
        """Capture every bucket of the plain variant; False if the model's forward pass
        synchronises with the host at these sizes (nothing captured then)."""
        top = self.sizes[-1]
        self._blank()
        md = self._metadata(top)
        self._forward(top, md, (), False)           # compiles kernels
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._forward(top, md, (), False)
        except RuntimeError as exc:
            logger.info("no prefill CUDA graphs: the forward pass synchronises with the host "
                        "(%s)", str(exc).splitlines()[0])
            return False
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        start = time.perf_counter()
        try:
            self._capture_buckets((), False)
        except Exception:
            logger.warning("steps with prompt rows run without CUDA graphs: capture failed",
                           exc_info=True)
            self.graphs.clear()
            return False
        logger.info("captured CUDA graphs for steps of up to %s tokens in %.2f s", self.sizes,
                    time.perf_counter() - start)
        return True

    @torch.inference_mode()
    def capture_variant(self, capture: tuple[int, ...],
                        embeds: tuple[int, torch.dtype] | None = None) -> bool:
        """As `DecodeGraphs.capture_variant`: every bucket of one variant now. False if it
        cannot be captured: those steps run eagerly (never fatal: an eager prompt costs
        only time)."""
        fed = embeds is not None
        if (capture, fed) in self.failed:
            return False
        if fed:
            self._embeds_buffer(*embeds)   # type: ignore[misc]
        try:
            self._capture_buckets(capture, fed)
        except Exception:
            self._fail(capture, fed)
            return False
        return True

    def _fail(self, capture: tuple[int, ...], fed: bool) -> None:
        logger.warning("steps with prompt rows (hidden layers %s, fed embeddings: %s) run "
                       "without CUDA graphs: capture failed", list(capture), fed, exc_info=True)
        self.failed.add((capture, fed))
        for key in [k for k in self.graphs if k[1:] == (capture, fed)]:
            del self.graphs[key]

    def _capture(self, tokens: int, capture: tuple[int, ...], embeds: bool) -> None:
        # the warm-up really runs: blank inputs write no cache slot and attend nowhere
        self._blank()
        md = self._metadata(tokens)
        graph, (hidden, captured) = graph_capture.capture_graph(
            lambda: self._forward(tokens, md, capture, embeds), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(tokens, capture, embeds)] = (graph, hidden, captured)

    # -- replay ------------------------------------------------------------------------------
    def can_run(self, plan: ForwardPlan) -> bool:
        """A step these buffers hold (rows, sequences, block-table width), without deepstack
        features, of a variant that did not fail to capture."""
        return (len(plan.input_ids) <= self.sizes[-1] and len(plan.seq_lens) <= self.max_seqs
                and plan.width <= self.max_blocks and plan.deepstack is None
                and (plan.capture, plan.embed_rows is not None) not in self.failed)

    def run(self, plan: ForwardPlan, embeds: Tensor | None
            ) -> tuple[Tensor, dict[int, Tensor]] | None:
        """Replay the step's bucket on the plan's inputs (embeds (T, H): its rows' input
        embeddings, for the embedding-fed variant) -> hidden (T, H), captured layers (T, H),
        views of the graph's outputs valid until the next replay; None if the bucket cannot
        be captured (the caller runs the step eagerly, and later ones of that variant too)."""
        num_tokens = len(plan.input_ids)
        tokens = next(t for t in self.sizes if t >= num_tokens)
        key = (tokens, plan.capture, embeds is not None)
        if embeds is not None:
            self._embeds_buffer(embeds.shape[1], embeds.dtype)[:num_tokens].copy_(embeds)
        if key not in self.graphs:
            logger.info("capturing the CUDA graph of prefill key %s on first use", key)
            try:
                self._capture(*key)
            except Exception:
                self._fail(*key[1:])
                return None
        graph, hidden, captured = self.graphs[key]
        self._write_inputs(plan, tokens)
        graph.replay()  # type: ignore[attr-defined]
        self.num_replays += 1
        return hidden[:num_tokens], {layer: h[:num_tokens] for layer, h in captured.items()}

    def _write_inputs(self, plan: ForwardPlan, tokens: int) -> None:
        num_tokens, num_seqs, top = len(plan.input_ids), len(plan.seq_lens), self.sizes[-1]
        pad = top - num_tokens
        positions = plan.positions
        if self.mrope:
            rows = positions if isinstance(positions, Tensor) else array_tensor(positions)
            pos = torch.zeros(3, top, dtype=torch.int64)
            pos[:, :num_tokens] = rows.view(3, num_tokens)
            pos_list = pos.flatten().tolist()
        else:
            pos_list = list(positions) + [0] * pad    # type: ignore[arg-type]
        ints = int_array(list(plan.input_ids) + [0] * pad + list(plan.slot_mapping)
                         + [-1] * pad + pos_list)
        self._ints.copy_(array_tensor(ints), non_blocking=True)
        qsl = plan.query_start_loc
        s = self.max_seqs
        programs = self.num_programs[tokens]
        work = self.backend.prefill_work(qsl, programs, num_seqs)  # type: ignore[attr-defined]
        meta = (qsl + [qsl[-1]] * (s + 2 - len(qsl)) + plan.seq_lens + [0] * (s + 1 - num_seqs)
                + work)
        self._meta[:len(meta)].copy_(array_tensor(int_array(meta, torch.int32)),
                                     non_blocking=True)
        self.block_tables[:num_seqs, :plan.width].copy_(
            array_tensor(plan.block_tables).view(num_seqs, plan.width), non_blocking=True)
