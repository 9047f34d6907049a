"""Sequence parallelism for diffusion transformers (issue 18): one forward's token sequence
split over the Ulysses x ring ranks of its stage, and the attention that still sees all of it.

    sequence-parallel index  s = ring_i * ulysses + ulysses_i        (P = ulysses * ring)

A DiT's sequence is made of segments (Qwen-Image, FLUX: [text, image]). Every segment is
split over the P ranks as evenly as it goes, the first `len % P` ranks one token more, so no
length needs padding and no padding needs a mask; rank s holds its part of each segment, the
parts concatenated:

    text T=5: | t0 t1 t2 | t3 t4 |     image N=4: | i0 i1 | i2 i3 |
    rank 0 holds [t0 t1 t2 i0 i1]      rank 1 holds [t3 t4 i2 i3]

Everything but attention works per token and runs on the local part (rotary tables are sliced
to the same positions). Attention (`SequenceSplit.attend`):

  Ulysses  all-to-all in the ulysses group, sequence <-> heads: each rank gets its group's
           whole sequence for 1/u of its heads; attention; all-to-all back.
  Ring     the K/V of the ring chunks travel around the ring group; each rank attends its
           queries to one chunk at a time and merges the partial results by their log-sum-exp
           (online softmax).

The keys arrive rank-major ([t0 t1 t2 i0 i1 t3 t4 i2 i3] above), not in sequence order;
attention does not depend on key order as long as the key mask follows it, and every query
comes back to the rank that owns it. With one rank every step is the identity and `attend` is
plain scaled-dot-product attention.

What the local attention runs (`SequenceRanks.attention`) is fixed when a model is built:
"sdpa", or "fp8" (layers/fp8_attention.py) for a model built inside `dit_attention("fp8")`,
which a stage with `quantization: {attention: fp8}` wraps around its loading. Ring attention
(which needs each part's log-sum-exp) has no fp8 form: such a stage is refused at load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from omnistage.layers.groups import stage_ranks
from omnistage.layers.parallel import TPGroup


def split_sizes(n: int, parts: int) -> list[int]:
    """n tokens over `parts` ranks: as even as possible, the first n % parts one larger."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def check_heads(num_heads: int, what: str = "num_attention_heads") -> None:
    """Every rank needs whole heads: H divisible by ulysses x tensor-parallel size."""
    ranks = stage_ranks()
    u, tp = ranks.ulysses.world_size, ranks.tp.world_size
    if num_heads % (u * tp):
        raise ValueError(f"{what} ({num_heads}) is not divisible by ulysses_degree x "
                         f"tensor_parallel_size ({u} x {tp})")


ATTENTION_METHODS = ("sdpa", "fp8")


@dataclass(slots=True)
class DitAttention:
    """The attention the models built inside `dit_attention` take, and how many took it."""

    method: str = "sdpa"
    num_models: int = 0


_building = DitAttention()


@contextlib.contextmanager
def dit_attention(method: str) -> Iterator[DitAttention]:
    """Models built inside attend with `method` (one of ATTENTION_METHODS); the record
    counts the models that did (`num_models`: 0 when none attends through SequenceSplit)."""
    global _building
    assert method in ATTENTION_METHODS, method
    prev, _building = _building, DitAttention(method)
    try:
        yield _building
    finally:
        _building = prev


@dataclass(frozen=True, slots=True)
class SequenceRanks:
    ulysses: TPGroup
    ring: TPGroup
    attention: str = "sdpa"             # the local attention (module docstring)

    @staticmethod
    def current() -> SequenceRanks:
        ranks = stage_ranks()
        _building.num_models += 1
        return SequenceRanks(ranks.ulysses, ranks.ring, _building.method)

    @property
    def degree(self) -> int:
        return self.ulysses.world_size * self.ring.world_size

    @property
    def index(self) -> int:
        return self.ring.rank * self.ulysses.world_size + self.ulysses.rank


@dataclass(frozen=True, slots=True)
class SequenceSplit:
    """One forward's sequence over the sequence-parallel ranks: built by `split`, used by the
    model to take its local tokens (`local`), attend (`attend`) and gather outputs (`gather`)."""

    ranks: SequenceRanks
    sizes: tuple[tuple[int, ...], ...]      # [segment][s]: tokens of the segment on rank s
    chunk_sizes: tuple[int, ...]            # [ring chunk]: tokens of its ulysses group
    chunk_masks: tuple[Tensor | None, ...]  # [ring chunk]: key mask (B, chunk tokens) or None

    @staticmethod
    def split(lengths: Sequence[int], key_masks: Sequence[Tensor | None],
              ranks: SequenceRanks | None = None) -> SequenceSplit:
        """Segments of `lengths` tokens; key_masks[g]: (B, lengths[g]) bool, True on keys to
        attend to, or None (every key of the segment counts)."""
        ranks = ranks or SequenceRanks.current()
        p, u = ranks.degree, ranks.ulysses.world_size
        sizes = tuple(tuple(split_sizes(n, p)) for n in lengths)
        groups = [range(j * u, (j + 1) * u) for j in range(ranks.ring.world_size)]
        chunk_sizes = tuple(sum(seg[s] for seg in sizes for s in g) for g in groups)
        return SequenceSplit(ranks, sizes, chunk_sizes,
                             tuple(_chunk_mask(sizes, key_masks, g) for g in groups))

    def local(self, x: Tensor, segment: int, dim: int = 1) -> Tensor:
        """This rank's tokens of `segment` out of the whole segment `x`."""
        sizes, s = self.sizes[segment], self.ranks.index
        return x.narrow(dim, sum(sizes[:s]), sizes[s])

    def rows(self, idx: Tensor) -> SequenceSplit:
        """The same split for the batch rows `idx` (masks narrowed to them)."""
        return replace(self, chunk_masks=tuple(None if m is None else m[idx.to(m.device)]
                                               for m in self.chunk_masks))

    def gather(self, x: Tensor, segment: int, dim: int = 1) -> Tensor:
        """The whole segment from every rank's local part `x` (along `dim`), in order."""
        sizes, u, i = self.sizes[segment], self.ranks.ulysses.world_size, self.ranks.ring.rank
        x = all_gather_uneven(x, [sizes[i * u + m] for m in range(u)], self.ranks.ulysses, dim)
        chunks = [sum(sizes[j * u:(j + 1) * u]) for j in range(self.ranks.ring.world_size)]
        return all_gather_uneven(x, chunks, self.ranks.ring, dim)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention of the local queries over every key of the sequence. q, k, v: (B, S, H,
        hd) for the S local tokens and H local heads -> (B, S, H, hd)."""
        ulysses, ring = self.ranks.ulysses, self.ranks.ring
        if ulysses.world_size > 1:            # one exchange for q, k and v together
            group = self._ulysses_sizes()
            qkv = seq_to_heads(torch.cat([q, k, v]), group, ulysses)          # (3B, L, H/u, hd)
            q, k, v = qkv.chunk(3)
        if ring.world_size > 1:
            out = ring_attention(q, k, v, self.chunk_masks, self.chunk_sizes, ring)
        else:
            out = sdpa(q, k, v, self.chunk_masks[0], self.ranks.attention)
        if ulysses.world_size > 1:
            out = heads_to_seq(out, group, ulysses)
        return out

    def _ulysses_sizes(self) -> list[int]:
        """Local token counts of the members of this rank's ulysses group, in group order."""
        u, i = self.ranks.ulysses.world_size, self.ranks.ring.rank
        return [sum(seg[i * u + m] for seg in self.sizes) for m in range(u)]


def _chunk_mask(sizes: tuple[tuple[int, ...], ...], key_masks: Sequence[Tensor | None],
                members: range) -> Tensor | None:
    """The key mask of the tokens of sequence-parallel ranks `members`, in their order (each
    rank's segments in turn); None when no segment has a mask."""
    present = [m for m in key_masks if m is not None]
    if not present:
        return None
    batch, device = present[0].shape[0], present[0].device
    parts = []
    for s in members:
        for seg, mask in zip(sizes, key_masks):
            if mask is None:
                parts.append(torch.ones(batch, seg[s], dtype=torch.bool, device=device))
            else:
                parts.append(mask.narrow(1, sum(seg[:s]), seg[s]).to(torch.bool))
    return torch.cat(parts, dim=1)


# ---- collectives ---------------------------------------------------------------------------

def all_gather_uneven(x: Tensor, sizes: list[int], group: TPGroup, dim: int) -> Tensor:
    """Concatenate the members' x along `dim` (member m contributes sizes[m]). Sent padded to
    the largest, since gloo's all_gather takes equal sizes only."""
    if group.world_size == 1:
        return x
    longest = max(sizes)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group.group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def seq_to_heads(x: Tensor, sizes: list[int], group: TPGroup) -> Tensor:
    """All-to-all: (B, S, H, hd), this rank's S = sizes[rank] tokens and H heads -> (B, sum
    sizes, H/u, hd), the group's tokens (member order) and this rank's 1/u of the heads.

        send (u*S, B, H/u, hd): block g = head group g, to member g
        recv (sum sizes, B, H/u, hd): block m = member m's tokens, my head group
    """
    b, s, h, d = x.shape
    u = group.world_size
    send = x.reshape(b, s, u, h // u, d).permute(2, 1, 0, 3, 4).reshape(u * s, b, h // u, d)
    recv = x.new_empty(sum(sizes), b, h // u, d)
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=sizes,
                           input_split_sizes=[s] * u, group=group.group)
    return recv.permute(1, 0, 2, 3)


def heads_to_seq(x: Tensor, sizes: list[int], group: TPGroup) -> Tensor:
    """The inverse of `seq_to_heads`: (B, sum sizes, H/u, hd) -> (B, S, H, hd)."""
    b, _, hu, d = x.shape
    u, s = group.world_size, sizes[group.rank]
    recv = x.new_empty(u * s, b, hu, d)
    dist.all_to_all_single(recv, x.permute(1, 0, 2, 3).contiguous(), output_split_sizes=[s] * u,
                           input_split_sizes=sizes, group=group.group)
    return recv.reshape(u, s, b, hu, d).permute(2, 1, 0, 3, 4).reshape(b, s, u * hu, d)


# ---- attention -----------------------------------------------------------------------------

def sdpa(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, method: str = "sdpa"
         ) -> Tensor:
    """(B, Lq, H, hd) queries over (B, Lk, H, hd) keys; key_mask (B, Lk) -> (B, Lq, H, hd).
    method "fp8": layers/fp8_attention.py (imported here only: it needs Triton)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                          # (B, H, L, hd)
    if method == "fp8":
        from omnistage.layers import fp8_attention
        return fp8_attention.attend(q, k, v, key_mask).transpose(1, 2)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def attention_lse(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None
                  ) -> tuple[Tensor, Tensor]:
    """Attention and its log-sum-exp: (B, Lq, H, hd) x (B, Lk, H, hd) -> out (B, Lq, H, hd)
    float32, lse (B, H, Lq) float32. A query with no key to attend to gets out 0, lse -inf.
    CUDA: the fused kernels (which return the lse); elsewhere the plain formula."""
    if q.is_cuda:
        return _cuda_attention_lse(q, k, v, key_mask)
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))              # (B, H, L, hd)
    scores = (qt @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5               # (B, H, Lq, Lk)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                    # (B, H, Lq)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (probs @ vt).transpose(1, 2), lse


def _cuda_attention_lse(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None
                        ) -> tuple[Tensor, Tensor]:
    """Flash attention for half precision without a mask, else memory-efficient attention
    with an additive bias (its last dimension padded to 16 as SDPA does, for alignment)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))                      # (B, H, L, hd)
    num_q = q.shape[1]
    if key_mask is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    else:
        bias = None
        if key_mask is not None:
            b, num_k = key_mask.shape
            bias = q.new_zeros(b, 1, num_q, num_k + (-num_k) % 16)[..., :num_k]
            bias.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
            bias = bias.expand(b, q.shape[2], num_q, num_k)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, bias, True)[:2]
    out, lse = out.transpose(1, 2).float(), lse[..., :num_q].float()
    if key_mask is not None:         # a row without keys: whatever the kernel made of it
        none = ~key_mask.any(dim=-1)                                         # (B,)
        out = out.masked_fill(none[:, None, None, None], 0.0)
        lse = lse.masked_fill(none[:, None, None], float("-inf"))
    return out, lse


def merge_partial(out: Tensor | None, lse: Tensor | None, part: Tensor, part_lse: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """Online softmax: two attentions of the same queries over disjoint keys -> the one over
    their union. out (B, L, H, hd), lse (B, H, L); -inf lse (no key yet) weighs 0."""
    if out is None:
        return part, part_lse
    new = torch.logaddexp(lse, part_lse)                                     # (B, H, L)
    w_old = torch.exp(lse - new).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)  # (B, L, H, 1)
    w_new = torch.exp(part_lse - new).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    return out * w_old + part * w_new, new


def ring_attention(q: Tensor, k: Tensor, v: Tensor, masks: Sequence[Tensor | None],
                   sizes: Sequence[int], group: TPGroup) -> Tensor:
    """Ring attention: this rank's queries over the keys of every ring chunk. q, k, v (B, L, H,
    hd) of this rank's chunk; masks[j] / sizes[j]: chunk j's key mask and length. At step t
    this rank holds chunk (rank - t) mod R and passes it on to rank + 1 while attending to it.
    -> (B, L, H, hd) in q's dtype."""
    r, i = group.world_size, group.rank
    nxt = dist.get_global_rank(group.group, (i + 1) % r)
    prev = dist.get_global_rank(group.group, (i - 1) % r)
    kv = torch.stack([k, v]).contiguous()                                    # (2, B, L, H, hd)
    out = lse = None
    for t in range(r):
        chunk = (i - t) % r
        pending = []
        if t < r - 1:
            incoming = kv.new_empty(2, kv.shape[1], sizes[(chunk - 1) % r], *kv.shape[3:])
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, nxt, group.group),
                dist.P2POp(dist.irecv, incoming, prev, group.group)])
        out, lse = merge_partial(out, lse, *attention_lse(q, kv[0], kv[1], masks[chunk]))
        for work in pending:
            work.wait()
        if t < r - 1:
            kv = incoming
    return out.to(q.dtype)
