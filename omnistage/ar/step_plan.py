"""What rank 0's model runner hands the other ranks of a tensor-parallel stage before each
piece of device work they must join (issue 18): the host inputs of that work, nothing of
the sequences, queues or sampling behind them.

    rank 0:  schedule -> plan = host inputs -> share_plan(plan) -> forward (collectives) ->
             logits (all-gather) -> sample, feedback, outputs
    rank r:  share_plan() -> plan -> the same forward, the same logits (discarded)

Tensors only rank 0 holds travel after the plan in one broadcast each, on the device: input
embeddings that are not the tokens' own (a prompt's, a stream's, fed-back ones) and deepstack
features. A step launched ahead of its predecessor's read-back (async scheduling) takes rank
0's sampled tokens by a broadcast too, so the other ranks never sample. Integers travel as C
int arrays, which pickle as their bytes.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.ar.cuda_graphs import DecodeInputs
from omnistage.ar.scheduler import ScheduledBatch
from omnistage.ar.sequence import Sequence
from omnistage.utils.host import int_array, int_matrix_array


@dataclass(slots=True)
class EmbedRows:
    """Batch rows whose input embeddings are not (only) their tokens': `replace` rows take
    given embeddings, then `add` rows get given ones added; (first row, number of rows) each.
    The embeddings follow the plan in this order, in one (rows, hidden) broadcast."""
    replace: list[tuple[int, int]]
    add: list[tuple[int, int]]

    @property
    def sizes(self) -> list[int]:
        return [n for _, n in self.replace + self.add]


@dataclass(slots=True)
class ForwardPlan:
    """An eager forward pass over a flattened batch (prefill chunks and decodes mixed)."""
    input_ids: array.array               # (T,) int64
    positions: array.array | Tensor      # (T,) int64, or (3, T) for M-RoPE models
    slot_mapping: array.array            # (T,) int64
    query_start_loc: list[int]           # (B+1,)
    seq_lens: list[int]                  # (B,)
    block_tables: array.array            # (B, width) int32, flattened
    width: int
    embed_rows: EmbedRows | None         # None: every row is its token's embedding
    deepstack: tuple[array.array, tuple[int, ...]] | None   # rows (K,), features' shape
    capture: tuple[int, ...]             # hidden layers the forward returns
    logit_rows: list[int]                # rows of the output whose logits are computed


@dataclass(slots=True)
class DecodePlan:
    """A decode step replayed from a CUDA graph (`DecodeGraphs.run`)."""
    inputs: DecodeInputs
    capture: tuple[int, ...]
    embed_rows: EmbedRows | None         # None: the variant fed token ids
    ahead: bool                          # ids: rank 0's last sampled tokens (a broadcast)
    logit_rows: list[int]


@dataclass(slots=True)
class EmbedPlan:
    """Token embeddings outside a step (a stage embedding a prompt as it arrives): the
    vocabulary-parallel embedding's all-reduce needs every rank."""
    input_ids: array.array               # (T,) int64


# -- building them from rank 0's batch ---------------------------------------------------------

def plan_forward(batch: ScheduledBatch, block_size: int, mrope: bool,
                 capture: tuple[int, ...], sampled: list[int]
                 ) -> tuple[ForwardPlan, list[Tensor], list[Tensor]]:
    """The flattened batch's host inputs (`sampled`: the batch rows whose last position's
    logits are computed), with the embeddings its `embed_rows` take and the deepstack
    features (L, k, hidden) per sequence that has some, still rank 0's."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    embed_rows: list[tuple[int, Tensor]] = []   # (first row in batch, (n, hidden)): replace
    stream_rows: list[tuple[int, Tensor]] = []  # (first row in batch, (n, hidden)): add
    pos3: list[Tensor] = []                     # (3, n) per row when the model uses M-RoPE
    deep_rows: list[Tensor] = []                # deepstack: batch rows and their features
    deep_feats: list[Tensor] = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        ids += _token_ids(seq, start, n)
        pos.extend(range(start, start + n))
        _add_slots(slots, seq.block_table, start, n, block_size)
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
    width = max(map(len, tables))
    deepstack = None
    if deep_rows:
        num_layers, _, hidden = deep_feats[0].shape
        shape = (num_layers, sum(f.shape[1] for f in deep_feats), hidden)
        deepstack = (int_array(torch.cat(deep_rows).tolist()), shape)
    rows = None
    if embed_rows or stream_rows:
        rows = EmbedRows([(r, e.shape[0]) for r, e in embed_rows],
                         [(r, e.shape[0]) for r, e in stream_rows])
    plan = ForwardPlan(
        int_array(ids), torch.cat(pos3, dim=1) if mrope else int_array(pos), int_array(slots),
        qsl, seq_lens, int_matrix_array(tables, width), width, rows, deepstack, capture,
        [qsl[i + 1] - 1 for i in sampled])
    return plan, [e for _, e in embed_rows + stream_rows], deep_feats


def decode_embed_rows(batch: ScheduledBatch) -> tuple[EmbedRows, list[Tensor]]:
    """A decode-only batch's rows fed other embeddings than their tokens' (as `plan_forward`
    finds them), and those embeddings."""
    embed_rows: list[tuple[int, Tensor]] = []
    stream_rows: list[tuple[int, Tensor]] = []
    for i, seq in enumerate(batch.seqs):
        _embed_rows(seq, seq.num_computed_tokens, 1, i, embed_rows, stream_rows)
    rows = EmbedRows([(r, e.shape[0]) for r, e in embed_rows],
                     [(r, e.shape[0]) for r, e in stream_rows])
    return rows, [e for _, e in embed_rows + stream_rows]


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
    """(3, n) multimodal rotary positions: the prompt's own where it has them, the generated
    tokens' own where it gives them (`decode_positions`), else the text position shifted by
    the request's rope delta."""
    mm = seq.mm
    rows3 = (torch.arange(start, start + n) + (mm.rope_delta if mm else 0)).expand(3, n).clone()
    num_prompt = seq.num_prompt_tokens
    if mm is not None and mm.positions is not None and start < num_prompt:
        stop = min(start + n, num_prompt)
        rows3[:, :stop - start] = mm.positions[:, start:stop]
    if mm is not None and mm.decode_positions is not None and start + n > num_prompt:
        first = max(start, num_prompt)
        stop = min(start + n, num_prompt + mm.decode_positions.shape[1])
        if stop > first:
            rows3[:, first - start:stop - start] = \
                mm.decode_positions[:, first - num_prompt:stop - num_prompt]
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
