"""Many Mimi streams stepped at once (issue 45's duplex tick): one `encode` and one `decode` a
tick for every session, each session a row of a fixed pool of streaming state.

    pool (max_rows + 1 slots; the last is scratch, for the rows that pad a batch to its
          graph's bucket): per streaming module, its state stacked on the slot dimension
      StreamConv            (slots, C_in, pad)       the last `pad` inputs (zeros at start);
                                                      replicate mode also `fresh` (slots,):
                                                      the first call pads with its first sample
      StreamConvTranspose   (slots, C_out, overlap)   the overlapping outputs (zeros at start)
      MimiAttention         (slots, W - 1, 2, Hkv, D) the last W - 1 keys and values, already
                                                      rotated (W: the sliding window)
      MimiTransformer       (slots,)                  the row's next position
    step(slots (B,), x)     gather the rows' state, run the layers, scatter the new state back

A row's keys sit at the end of its buffer, the oldest first: key j of L = W - 1 (then the T
new ones) is at position pos - L + j. A query at position p sees the keys in [p - W + 1, p]
that exist (position >= 0), so a row whose window is not yet full is masked, and rows of
different ages batch together with the numbers each gives alone (mimi.py's `encode_step` /
`decode_step` with a per-stream state). `open` resets a slot. Everything is tensor work with
no host synchronisation, so `StreamGraphs` can replay a step from one CUDA graph per bucket.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import graph_capture
from omnistage.layers.rotary import rotate_half
from omnistage.models.moshi.mimi import MimiModel
from omnistage.models.moshi.mimi_layers import (MimiAttention, MimiTransformer, ResnetBlock,
                                                StreamConv, StreamConvTranspose)

Pools = dict[nn.Module, list[Tensor]]


def _new_pools(modules: Iterable[nn.Module], rows: int, device: torch.device,
               dtype: torch.dtype) -> Pools:
    pools: Pools = {}
    for m in modules:
        if isinstance(m, StreamConv) and m.pad > 0:
            pools[m] = [torch.zeros(rows, m.conv.in_channels, m.pad, device=device, dtype=dtype)]
            if m.mode != "constant":
                pools[m].append(torch.ones(rows, dtype=torch.bool, device=device))
        elif isinstance(m, StreamConvTranspose) and m.overlap > 0:
            pools[m] = [torch.zeros(rows, m.conv.out_channels, m.overlap, device=device,
                                    dtype=dtype)]
        elif isinstance(m, MimiAttention):
            pools[m] = [torch.zeros(rows, m.window - 1, 2, m.num_kv_heads, m.head_dim,
                                    device=device, dtype=dtype)]
        elif isinstance(m, MimiTransformer):
            pools[m] = [torch.zeros(rows, dtype=torch.long, device=device)]
    return pools


class _Step:
    """One step's gathered state (`old`) and what it leaves (`new`), per module."""

    def __init__(self, pools: Pools, slots: Tensor) -> None:
        self.old = {m: [t.index_select(0, slots) for t in ts] for m, ts in pools.items()}
        self.new: dict[nn.Module, list[Tensor]] = {}

    def conv(self, m: StreamConv, x: Tensor) -> Tensor:                # (B, C, L) whole strides
        if m not in self.old:
            return m.conv(x)
        past = self.old[m][0]
        if m.mode != "constant":                   # a fresh row pads with its first sample
            fresh = self.old[m][1]
            past = torch.where(fresh[:, None, None], x[..., :1].expand_as(past), past)
            self.new[m] = [None, torch.zeros_like(fresh)]              # type: ignore[list-item]
        x = torch.cat([past, x], dim=-1)
        self.new.setdefault(m, [None])[0] = x[..., x.shape[-1] - m.pad:]
        return m.conv(x)

    def conv_transpose(self, m: StreamConvTranspose, x: Tensor) -> Tensor:
        y = F.conv_transpose1d(x, m.conv.weight, None, m.stride, groups=m.conv.groups)
        keep = x.shape[-1] * m.stride
        if m in self.old:
            tail = self.old[m][0]
            y = torch.cat([y[..., :m.overlap] + tail, y[..., m.overlap:]], dim=-1)
            self.new[m] = [y[..., keep:]]
        y = y[..., :keep]
        return y if m.conv.bias is None else y + m.conv.bias[:, None]

    def layers(self, layers: Iterable[nn.Module], x: Tensor) -> Tensor:
        for layer in layers:
            if isinstance(layer, StreamConv):
                x = self.conv(layer, x)
            elif isinstance(layer, StreamConvTranspose):
                x = self.conv_transpose(layer, x)
            elif isinstance(layer, ResnetBlock):
                x = x + self.layers(layer.block, x)
            else:
                x = layer(x)                                          # ELU
        return x

    def transformer(self, m: MimiTransformer, h: Tensor) -> Tensor:   # (B, T, hidden)
        t = h.shape[1]
        pos = self.old[m][0]                                          # (B,)
        self.new[m] = [pos + t]
        steps = torch.arange(t, device=h.device)
        positions = pos[:, None] + steps                              # (B, T)
        first = m.layers[0].self_attn
        rotary = first.rotary
        cos = rotary.cos_cache[positions].unsqueeze(2).to(h.dtype)    # (B, T, 1, D)
        sin = rotary.sin_cache[positions].unsqueeze(2).to(h.dtype)
        past = first.window - 1
        keys = pos[:, None] - past + torch.arange(past + t, device=h.device)   # (B, L + T)
        q, k = positions[:, :, None], keys[:, None, :]
        mask = (k >= 0) & (k <= q) & (k > q - first.window)           # (B, T, L + T)
        for layer in m.layers:
            attn = self.attention(layer.self_attn, layer.input_layernorm(h), cos, sin,
                                  mask[:, None])
            h = h + layer.self_attn_layer_scale(attn)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
        return h

    def attention(self, m: MimiAttention, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor
                  ) -> Tensor:
        b, t, _ = x.shape
        q = m.q_proj(x).view(b, t, m.num_heads, m.head_dim)
        k = m.k_proj(x).view(b, t, m.num_kv_heads, m.head_dim)
        v = m.v_proj(x).view(b, t, m.num_kv_heads, m.head_dim)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        past = self.old[m][0]                                         # (B, L, 2, Hkv, D)
        k = torch.cat([past[:, :, 0], k], dim=1)                      # (B, L + T, Hkv, D)
        v = torch.cat([past[:, :, 1], v], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=m.num_kv_heads != m.num_heads)                 # (B, H, T, D)
        self.new[m] = [torch.stack([k, v], dim=2)[:, t:]]
        return m.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def scatter(self, pools: Pools, slots: Tensor) -> None:
        assert self.new.keys() == pools.keys(), "a streaming module was not stepped"
        for m, ts in pools.items():
            for pool, value in zip(ts, self.new[m]):
                pool.index_copy_(0, slots, value)


class MimiStreams:
    """`max_rows` Mimi streams (encode and decode each), stepped together by slot."""

    def __init__(self, mimi: MimiModel, max_rows: int, num_quantizers: int) -> None:
        self.mimi, self.max_rows, self.num_quantizers = mimi, max_rows, num_quantizers
        self.scratch = max_rows                                       # the padding rows' slot
        p = next(mimi.parameters())
        with torch.inference_mode():
            self.enc = _new_pools([*mimi.encoder.modules(), *mimi.encoder_transformer.modules(),
                                   mimi.downsample], max_rows + 1, p.device, p.dtype)
            self.dec = _new_pools([mimi.upsample, *mimi.decoder_transformer.modules(),
                                   *mimi.decoder.modules()], max_rows + 1, p.device, p.dtype)

    @torch.inference_mode()
    def reset(self, slot: int) -> None:
        """A new stream (encode and decode) in `slot`."""
        assert 0 <= slot < self.max_rows, (slot, self.max_rows)
        for pools in (self.enc, self.dec):
            for ts in pools.values():
                for t in ts:
                    t[slot] = True if t.dtype == torch.bool else 0

    @torch.inference_mode()
    def encode(self, slots: Tensor, wav: Tensor) -> Tensor:
        """slots (B,) long, wav (B, 1, N) whole frames -> codes (B, K, N / frame_size), each
        row continuing its slot's stream."""
        step = _Step(self.enc, slots)
        h = step.layers(self.mimi.encoder.layers, wav)                # (B, H, L)
        h = step.transformer(self.mimi.encoder_transformer, h.transpose(1, 2)).transpose(1, 2)
        codes = self.mimi.quantizer.encode(step.conv(self.mimi.downsample, h),
                                           self.num_quantizers)
        step.scatter(self.enc, slots)
        return codes

    @torch.inference_mode()
    def decode(self, slots: Tensor, codes: Tensor) -> Tensor:
        """slots (B,) long, codes (B, K, T) -> (B, 1, T * frame_size)."""
        step = _Step(self.dec, slots)
        h = step.conv_transpose(self.mimi.upsample, self.mimi.quantizer.decode(codes))
        h = step.transformer(self.mimi.decoder_transformer, h.transpose(1, 2)).transpose(1, 2)
        wav = step.layers(self.mimi.decoder.layers, h)
        step.scatter(self.dec, slots)
        return wav


class StreamGraphs:
    """A pool step `fn(slots, x) -> out` replayed from one CUDA graph per batch-size bucket,
    all captured by `capture_all` with every row on the scratch slot (the warm-up and the
    capture then touch no stream). A call copies its slots and inputs into the first B rows of
    the static buffers, points the bucket's padding rows at the scratch slot, replays, and
    returns the first B rows of the output (a view of the graph's: read it before the next
    call)."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], sizes: list[int], scratch: int,
                 example: Tensor) -> None:
        """example: one row's input (1, ...), its dtype and device those of every call."""
        self.fn, self.sizes, self.scratch = fn, sizes, scratch
        n = sizes[-1]
        self.slots = torch.full((n,), scratch, dtype=torch.long, device=example.device)
        self.x = example.new_zeros(n, *example.shape[1:])
        self.graphs: dict[int, tuple[object, Tensor]] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0

    @torch.inference_mode()
    def capture_all(self) -> None:
        self.slots.fill_(self.scratch)
        for bs in reversed(self.sizes):
            graph, out = graph_capture.capture_graph(
                lambda bs=bs: self.fn(self.slots[:bs], self.x[:bs]), self.pool)
            if self.pool is None:
                self.pool = graph.pool()                              # type: ignore[attr-defined]
            self.graphs[bs] = (graph, out)

    @torch.inference_mode()
    def __call__(self, slots: Tensor, x: Tensor) -> Tensor:
        b = slots.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.slots[:b].copy_(slots)
        self.slots[b:bs].fill_(self.scratch)
        self.x[:b].copy_(x)
        graph, out = self.graphs[bs]
        graph.replay()                                                # type: ignore[attr-defined]
        self.num_replays += 1
        return out[:b]
