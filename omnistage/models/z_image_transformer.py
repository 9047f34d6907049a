"""Z-Image (and Z-Image-Turbo) diffusion transformer, a native port of diffusers'
`ZImageTransformer2DModel` (transformer_z_image.py) with the same parameter names, so a
diffusers `transformer/` folder loads by name, and the same numerics.

One stream of tokens per image, "single-stream" DiT:

    image (C,F,H,W) -> patches (Nx, pF*p*p*C) -> x_embedder -> noise_refiner (adaLN on t)
    caption (Lc, cap_feat_dim) -> cap_embedder -> context_refiner (no modulation)
    [x tokens | caption tokens] -> layers (adaLN on t) -> final layer -> unpatchify -> (C,F,H,W)

Both streams are padded to a multiple of SEQ_MULTI_OF tokens; padded rows become a learned
pad token. 3-axis RoPE positions (f, h, w): caption token k sits at (1+k, 0, 0), the image at
(Lc_padded+1+f, h, w), image pad tokens at (0, 0, 0). Items in a batch may differ in image size
and caption length; shorter sequences are masked out of attention.

Only the basic text-to-image mode is ported: the Omni mode (nested image lists, SigLIP features,
per-token noise masks) raises NotImplementedError.

Tensor parallelism (issue 18), from the stage's group current at construction: q/k/v
column-parallel (this rank's heads), the output projection row-parallel, the SwiGLU MLP column
(w1, w3) / row (w2), each block's modulation split and gathered; embedders, refiners' norms
and the final layer whole.

Sequence parallelism (Ulysses and ring, layers/sequence_parallel.py): the main layers' padded
joint batch (B, S) is split along S over the sequence-parallel ranks, its key mask (requests of
other lengths) split with it, and gathered after the last layer. The refiners, two layers on
each stream alone, run whole on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from omnistage.layers.parallel import ColumnParallelLinear, RowParallelLinear, tp_group
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import build_from_folder, read_config

ARCHITECTURE = "ZImageTransformer2DModel"
ADALN_EMBED_DIM = 256
SEQ_MULTI_OF = 32

# Step caching: no fitted polynomial for Z-Image is known to us, so the relative L1 change is
# used as is (identity rescaling); thresholds are then in units of that change.
TEACACHE_COEFFICIENTS = (1.0, 0.0)


@dataclass(frozen=True, slots=True)
class ZImageConfig:
    """diffusers' constructor arguments, as written in the transformer's config.json."""
    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30        # unused by diffusers too: every layer has n_heads k/v heads
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.dim // self.n_heads != sum(self.axes_dims):
            raise ValueError(f"head_dim {self.dim}/{self.n_heads} must equal sum(axes_dims) "
                             f"{list(self.axes_dims)}")
        if len(self.all_patch_size) != len(self.all_f_patch_size):
            raise ValueError("all_patch_size and all_f_patch_size differ in length")
        if self.siglip_feat_dim is not None:
            raise NotImplementedError("siglip_feat_dim: Z-Image Omni is not ported")

    @classmethod
    def from_dict(cls, raw: dict) -> ZImageConfig:
        known = {f.name for f in fields(cls)}
        cfg = {k: v for k, v in raw.items() if not k.startswith("_")}   # _class_name, ...
        if unknown := sorted(cfg.keys() - known):
            raise ValueError(f"ZImageTransformer2DModel config: unknown keys {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """diffusers' RMSNorm numerics: the variance is float32, the input is not upcast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:                              # x: (..., dim)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class TimestepEmbedder(nn.Module):
    def __init__(self, out_size: int, mid_size: int = 1024, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, mid_size), nn.SiLU(),
                                 nn.Linear(mid_size, out_size))

    def forward(self, t: Tensor, max_period: float = 10000.0) -> Tensor:  # t: (B,), * t_scale
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(max_period)
                          * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]                          # (B, half)
        t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)   # (B, freq_dim)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))             # (B, out_size)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """x: (B, S, H, D) real; freqs_cis: (B, S, D/2) complex64. Rotates in float32."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))   # (B, S, H, D/2)
    return torch.view_as_real(xc * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


class ZImageAttention(nn.Module):
    """diffusers' `Attention` with `ZSingleStreamAttnProcessor`: bias-free q/k/v/out, per-head
    RMSNorm on q and k, RoPE, full (non-causal) attention over the padded batch."""

    def __init__(self, cfg: ZImageConfig) -> None:
        super().__init__()
        self.heads = cfg.n_heads // tp_group().world_size               # this rank's
        self.to_q = ColumnParallelLinear(cfg.dim, cfg.dim)
        self.to_k = ColumnParallelLinear(cfg.dim, cfg.dim)
        self.to_v = ColumnParallelLinear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.head_dim, eps=1e-5) if cfg.qk_norm else None
        self.norm_k = RMSNorm(cfg.head_dim, eps=1e-5) if cfg.qk_norm else None
        self.to_out = nn.ModuleList([RowParallelLinear(cfg.dim, cfg.dim)])

    def forward(self, x: Tensor, mask: Tensor | None, freqs_cis: Tensor,
                seq: SequenceSplit | None = None) -> Tensor:
        """seq: x holds this rank's part of a sequence split over ranks (its mask in `seq`)."""
        q = self.to_q(x).unflatten(-1, (self.heads, -1))                 # (B, S, H, D)
        k = self.to_k(x).unflatten(-1, (self.heads, -1))
        v = self.to_v(x).unflatten(-1, (self.heads, -1))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        if seq is not None:
            return self.to_out[0](seq.attend(q, k, v).flatten(2).to(q.dtype))
        if mask is not None:
            mask = mask[:, None, None, :]                                # (B, 1, 1, S) keys kept
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask)  # (B, H, S, D)
        out = out.transpose(1, 2).flatten(2).to(q.dtype)                 # (B, S, H*D)
        return self.to_out[0](out)                                       # (B, S, dim)


class FeedForward(nn.Module):
    """SwiGLU, column-parallel w1 / w3 and row-parallel w2."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, hidden_dim)
        self.w2 = RowParallelLinear(hidden_dim, dim)
        self.w3 = ColumnParallelLinear(dim, hidden_dim)

    def forward(self, x: Tensor) -> Tensor:                              # x: (B, S, dim)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageTransformerBlock(nn.Module):
    """Sandwich-norm block; with `modulation` the timestep scales the pre-norms (1 + scale) and
    tanh-gates the residual branches (no shift, no SiLU before adaLN_modulation)."""

    def __init__(self, cfg: ZImageConfig, modulation: bool) -> None:
        super().__init__()
        dim, eps = cfg.dim, cfg.norm_eps
        self.attention = ZImageAttention(cfg)
        self.feed_forward = FeedForward(dim, int(dim / 3 * 8))
        self.attention_norm1, self.attention_norm2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.ffn_norm1, self.ffn_norm2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.Sequential(ColumnParallelLinear(
                min(dim, ADALN_EMBED_DIM), 4 * dim, bias=True, gather_output=True))

    def forward(self, x: Tensor, mask: Tensor | None, freqs_cis: Tensor,
                adaln_input: Tensor | None = None, seq: SequenceSplit | None = None
                ) -> Tensor:                                             # x: (B, S, dim)
        if not self.modulation:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), mask, freqs_cis))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        mod = self.adaLN_modulation(adaln_input).unsqueeze(1)            # (B, 1, 4*dim)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=2)   # each (B, 1, dim)
        attn_out = self.attention(self.attention_norm1(x) * (1.0 + scale_msa), mask, freqs_cis,
                                  seq)
        x = x + gate_msa.tanh() * self.attention_norm2(attn_out)
        ffn_out = self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_mlp))
        return x + gate_mlp.tanh() * self.ffn_norm2(ffn_out)


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, ADALN_EMBED_DIM), dim))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:                   # x: (B, S, dim), c: (B, A)
        scale = 1.0 + self.adaLN_modulation(c).unsqueeze(1)              # (B, 1, dim)
        return self.linear(self.norm_final(x) * scale)                   # (B, S, p*p*pF*C)


class RopeEmbedder:
    """Per-axis complex64 tables (built in float64 on the CPU, as diffusers does), looked up by
    integer (f, h, w) positions and concatenated: ids (N, 3) -> (N, head_dim/2)."""

    def __init__(self, theta: float, axes_dims: tuple[int, ...],
                 axes_lens: tuple[int, ...]) -> None:
        self.theta, self.axes_dims, self.axes_lens = theta, axes_dims, axes_lens
        self.tables: list[Tensor] | None = None

    def _build(self) -> list[Tensor]:
        tables = []
        for d, n in zip(self.axes_dims, self.axes_lens):
            exps = torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d
            inv = 1.0 / (self.theta ** exps)
            angles = torch.outer(torch.arange(n, dtype=torch.float64, device="cpu"), inv).float()
            tables.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
        return tables                                                    # each (axis_len, d/2)

    def __call__(self, ids: Tensor) -> Tensor:                           # ids: (N, 3) int
        if self.tables is None or self.tables[0].device != ids.device:
            self.tables = [t.to(ids.device) for t in (self.tables or self._build())]
        return torch.cat([t[ids[:, i]] for i, t in enumerate(self.tables)], dim=-1)


def _coordinate_grid(size: tuple[int, ...], start: tuple[int, ...], device: torch.device) -> Tensor:
    axes = [torch.arange(s0, s0 + n, dtype=torch.int32, device=device)
            for s0, n in zip(start, size)]
    grid = torch.stack(torch.meshgrid(axes, indexing="ij"), dim=-1)
    return grid.flatten(0, -2)                                         # (prod(size), 3)


def _patchify(image: Tensor, p: int, pf: int) -> Tensor:
    """(C, F, H, W) -> (F/pf * H/p * W/p, pf*p*p*C): "c (f pf) (h ph) (w pw) -> (f h w) (pf ph
    pw c)"."""
    C, Fr, H, W = image.shape
    Ft, Ht, Wt = Fr // pf, H // p, W // p
    return (image.reshape(C, Ft, pf, Ht, p, Wt, p).permute(1, 3, 5, 2, 4, 6, 0)
            .reshape(Ft * Ht * Wt, pf * p * p * C))


def _unpatchify(rows: Tensor, size: tuple[int, int, int], p: int, pf: int, C: int) -> Tensor:
    """The image rows of one request (padding after them) -> (C, F, H, W): "f h w pf ph pw c
    -> c (f pf) (h ph) (w pw)"."""
    Fr, H, W = size
    n = (Fr // pf) * (H // p) * (W // p)
    return (rows[:n].reshape(Fr // pf, H // p, W // p, pf, p, p, C)
            .permute(6, 0, 3, 1, 4, 2, 5).reshape(C, Fr, H, W))


def _pad_rows(feat: Tensor) -> tuple[Tensor, Tensor]:
    """Repeat the last row up to a multiple of SEQ_MULTI_OF; also return the pad mask."""
    n = len(feat)
    pad = (-n) % SEQ_MULTI_OF
    is_pad = torch.arange(n + pad, device=feat.device) >= n              # (N_padded,)
    return torch.cat([feat, feat[-1:].expand(pad, -1)]), is_pad


def _pad_batch(seqs: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """Right-pad token lists to (B, S, ...); the mask is None when all lengths agree."""
    lens = [len(s) for s in seqs]
    batch = pad_sequence(seqs, batch_first=True, padding_value=0.0)
    if all(n == lens[0] for n in lens):
        return batch, None
    lens_t = torch.tensor(lens, device=batch.device)
    return batch, torch.arange(batch.shape[1], device=batch.device)[None] < lens_t[:, None]


class ZImageTransformer2DModel(nn.Module):
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the embeddings,
    # the blocks' modulation, the final layers (their modulation and projection)
    fp8_keep = ("all_x_embedder.*", "t_embedder.*", "cap_embedder.*", "*.adaLN_modulation.*",
                "all_final_layer.*")

    def __init__(self, cfg: ZImageConfig) -> None:
        super().__init__()
        check_heads(cfg.n_heads, "n_heads")
        self.cfg = cfg
        self.out_channels = cfg.in_channels
        self.all_x_embedder = nn.ModuleDict({
            f"{p}-{pf}": nn.Linear(pf * p * p * cfg.in_channels, cfg.dim)
            for p, pf in zip(cfg.all_patch_size, cfg.all_f_patch_size)})
        self.all_final_layer = nn.ModuleDict({
            f"{p}-{pf}": FinalLayer(cfg.dim, p * p * pf * cfg.in_channels)
            for p, pf in zip(cfg.all_patch_size, cfg.all_f_patch_size)})
        self.noise_refiner = nn.ModuleList(
            [ZImageTransformerBlock(cfg, modulation=True) for _ in range(cfg.n_refiner_layers)])
        self.context_refiner = nn.ModuleList(
            [ZImageTransformerBlock(cfg, modulation=False) for _ in range(cfg.n_refiner_layers)])
        self.t_embedder = TimestepEmbedder(min(cfg.dim, ADALN_EMBED_DIM), mid_size=1024)
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.cap_feat_dim, eps=cfg.norm_eps),
                                          nn.Linear(cfg.cap_feat_dim, cfg.dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.layers = nn.ModuleList(
            [ZImageTransformerBlock(cfg, modulation=True) for _ in range(cfg.n_layers)])
        self.rope_embedder = RopeEmbedder(cfg.rope_theta, cfg.axes_dims, cfg.axes_lens)
        self.seq_ranks = SequenceRanks.current()

    def _run(self, layers: nn.ModuleList, seqs: list[Tensor], freqs: list[Tensor],
             adaln_input: Tensor | None = None) -> Tensor:
        """A refiner's layers over one stream, whole on every rank."""
        x, mask = _pad_batch(seqs)                                       # (B, S, dim), (B, S)
        freqs_cis, _ = _pad_batch(freqs)                                 # (B, S, head_dim/2)
        for layer in layers:
            x = layer(x, mask, freqs_cis, adaln_input)
        return x

    def _main(self, x: Tensor, mask: Tensor | None, freqs_cis: Tensor, adaln_input: Tensor,
              samples: dict[int, Tensor] | None = None) -> Tensor:
        """The main layers over the padded joint batch (B, S, dim), its S split over the
        sequence-parallel ranks when there are several (controlnet samples split alike)."""
        if self.seq_ranks.degree == 1:
            for idx, layer in enumerate(self.layers):
                x = layer(x, mask, freqs_cis, adaln_input)
                if samples is not None and idx in samples:
                    x = x + samples[idx]
            return x
        seq = SequenceSplit.split([x.shape[1]], [mask], self.seq_ranks)
        h, f = seq.local(x, 0), seq.local(freqs_cis, 0)
        for idx, layer in enumerate(self.layers):
            h = layer(h, None, f, adaln_input, seq)
            if samples is not None and idx in samples:
                h = h + seq.local(samples[idx], 0)
        return seq.gather(h, 0)

    def _run_cached(self, seqs: list[Tensor], freqs: list[Tensor], adaln_input: Tensor,
                    groups: list[CacheGroup]) -> Tensor:
        """The main layers with step caching; a group's rows share one real length (one
        request's images: same caption, same size), the padding may change between steps."""
        x, mask = _pad_batch(seqs)                                       # (B, S, dim), (B, S)
        freqs_cis, _ = _pad_batch(freqs)
        for g in groups:
            lengths = {len(seqs[i]) for i in range(g.rows.start, g.rows.stop)}
            assert len(lengths) == 1, f"rows {g.rows} of one cache group differ in length"
            g.length = lengths.pop()
        first = self.layers[0]
        scale_msa = first.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)[0]
        modulated = first.attention_norm1(x) * (1.0 + scale_msa)         # (B, S, dim)

        def run_blocks(idx: Tensor) -> Tensor:
            return self._main(x[idx], None if mask is None else mask[idx], freqs_cis[idx],
                              adaln_input[idx])

        return run_cached(x, modulated, groups, TEACACHE_COEFFICIENTS, run_blocks)

    def forward(self, x: list[Tensor], t: Tensor, cap_feats: list[Tensor], patch_size: int = 2,
                f_patch_size: int = 1,
                controlnet_block_samples: dict[int, Tensor] | None = None,
                step_cache: list[CacheGroup] | None = None) -> list[Tensor]:
        """x: B latents (C, F, H, W), sizes may differ; t: (B,) in [0, 1]; cap_feats: B caption
        features (L_i, cap_feat_dim). Returns B tensors (C, F, H, W), as diffusers' `.sample`.
        `step_cache`: per request and branch, skip the main layers on steps whose first
        modulated input barely moved (layers/step_cache.py)."""
        key = f"{patch_size}-{f_patch_size}"
        if key not in self.all_x_embedder:
            raise ValueError(f"patch_size={patch_size}, f_patch_size={f_patch_size}: model has "
                             f"{list(self.all_x_embedder)}")
        if isinstance(x[0], list):
            raise NotImplementedError("Z-Image Omni mode (nested image lists) is not ported")
        assert len(x) == len(cap_feats) == len(t), (len(x), len(cap_feats), len(t))
        p, pf, C, device = patch_size, f_patch_size, self.out_channels, x[0].device
        adaln_input = self.t_embedder(t * self.cfg.t_scale).type_as(x[0])  # (B, min(dim, 256))

        # 1. patchify, pad each stream to SEQ_MULTI_OF, assign (f, h, w) positions
        x_tok, x_pad, x_pos, cap_tok, cap_pad, cap_pos, sizes = [], [], [], [], [], [], []
        for image, cap in zip(x, cap_feats):
            cap, is_pad = _pad_rows(cap)                                 # (Lc, cap_feat_dim)
            cap_tok.append(cap), cap_pad.append(is_pad)
            cap_pos.append(_coordinate_grid((len(cap), 1, 1), (1, 0, 0), device))
            _, Fr, H, W = image.shape
            patches, is_pad = _pad_rows(_patchify(image, p, pf))         # (Nx, pF*p*p*C)
            x_tok.append(patches), x_pad.append(is_pad), sizes.append((Fr, H, W))
            pos = _coordinate_grid((Fr // pf, H // p, W // p), (len(cap) + 1, 0, 0), device)
            x_pos.append(torch.cat([pos, pos.new_zeros(len(patches) - len(pos), 3)]))

        # 2. embed (pad rows -> learned pad token) and refine each stream on its own
        x_lens, cap_lens = [len(s) for s in x_tok], [len(s) for s in cap_tok]
        x_emb = self.all_x_embedder[key](torch.cat(x_tok))              # (sum Nx, dim)
        x_emb = torch.where(torch.cat(x_pad)[:, None], self.x_pad_token, x_emb)
        x_freqs = self.rope_embedder(torch.cat(x_pos)).split(x_lens)
        x_ref = self._run(self.noise_refiner, list(x_emb.split(x_lens)), x_freqs, adaln_input)
        cap_emb = self.cap_embedder(torch.cat(cap_tok))                  # (sum Lc, dim)
        cap_emb = torch.where(torch.cat(cap_pad)[:, None], self.cap_pad_token, cap_emb)
        cap_freqs = self.rope_embedder(torch.cat(cap_pos)).split(cap_lens)
        cap_ref = self._run(self.context_refiner, list(cap_emb.split(cap_lens)), cap_freqs)

        # 3. joint stream [image | caption] through the main layers
        seqs = [torch.cat([x_ref[i, :nx], cap_ref[i, :nc]]) for i, (nx, nc)
                in enumerate(zip(x_lens, cap_lens))]
        freqs = [torch.cat([xf, cf]) for xf, cf in zip(x_freqs, cap_freqs)]
        if step_cache is None:
            x_joint, mask = _pad_batch(seqs)                             # (B, S, dim), (B, S)
            out = self._main(x_joint, mask, _pad_batch(freqs)[0], adaln_input,
                             controlnet_block_samples)
        else:
            assert controlnet_block_samples is None, "step caching with a controlnet"
            out = self._run_cached(seqs, freqs, adaln_input, step_cache)
        out = self.all_final_layer[key](out, adaln_input)                # (B, S, p*p*pF*C)

        # 4. unpatchify each request's image rows
        return [_unpatchify(out[i], size, p, pf, C) for i, size in enumerate(sizes)]

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = torch.bfloat16) -> ZImageTransformer2DModel:
        """Load a diffusers `transformer/` folder (config.json plus one safetensors file or
        shards with an index). Strict: every tensor must exist, be expected and fit."""
        path = Path(path)
        return build_from_folder(cls, ZImageConfig.from_dict(read_config(path)), path, device,
                                 dtype)
