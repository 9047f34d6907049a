"""CosyVoice3's token-to-mel flow: speech tokens -> mel by a flow-matching DiT, conditioned on
a prompt's mel (the voice to clone) and its speaker x-vector.

    tokens (B, N) = [prompt tokens | tokens] -> embedding -> PreLookaheadLayer (conv over the
    next pre_lookahead_len tokens, then causal) -> repeat x token_mel_ratio -> mu (B, T, mel)
    x-vector (B, 192) -> L2 normalise -> affine -> spks (B, mel)
    cond (B, T, mel) = the prompt's mel, zeros after it

The estimator (`DiT`) predicts the velocity of x (B, T, mel) at flow time t in [0, 1] (0:
noise, 1: mel):

    [x | cond | mu | spks] -> proj -> + causal conv position embedding -> L x block
    block: AdaLN-zero(t) -> attention (rotary on the first head only, interleaved, as trained;
           streaming: a frame sees its chunk of static_chunk_size frames and all before)
           -> AdaLN-modulated tanh-GELU MLP
    -> AdaLN(t) -> proj_out -> velocity (B, T, mel)

Classifier-free guidance runs the unconditional half in the same batch (mu, spks and cond all
zero): v = (1 + w) v_c - w v_u. The ODE solver (cosine-scheduled Euler) lives in
diffusion/solvers/cosine_euler.py; the loop that runs it in diffusion/pipelines/cosyvoice3.py.
Parameter names follow the released flow.pt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import AdaLayerNormContinuous, AdaLayerNormZero
from omnistage.layers.rotary import rotate_half
from omnistage.models.cosyvoice3.config import DiTConfig, FlowConfig
from omnistage.models.qwen2_5_omni.token2wav import DiTTimestepEmbedding


class CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: Tensor) -> Tensor:                         # (B, T, D) -> (B, T, D)
        h = self.conv1(F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0)))
        return self.conv2(F.pad(h, (self.kernel_size - 1, 0))).transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim * 2 + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat((x, cond, mu, spks), dim=-1))
        return self.conv_pos_embed(h) + h


class Attention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim_head
        inner = cfg.heads * cfg.dim_head
        self.to_q = nn.Linear(cfg.dim, inner)
        self.to_k = nn.Linear(cfg.dim, inner)
        self.to_v = nn.Linear(cfg.dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, cfg.dim), nn.Identity()])

    def forward(self, x: Tensor, cos_sin: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """x (B, T, D); cos/sin (T, head_dim); mask (B, 1, T, T) bool, True where a frame
        may look."""
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))            # (B, H, T, Dh)
        q = torch.cat([_rotate_first_head(q[:, :1], *cos_sin), q[:, 1:]], dim=1)
        k = torch.cat([_rotate_first_head(k[:, :1], *cos_sin), k[:, 1:]], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


def _rotate_first_head(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The checkpoint's interleaved rotary (x-transformers' partial rotary over the first
    head_dim features, i.e. head 0) as rotate-half over de-interleaved features: q and k get
    the same permutation, so q.k is unchanged."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return x * cos + rotate_half(x) * sin


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU("tanh")),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim)
        self.attn = Attention(cfg)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: Tensor, temb: Tensor, cos_sin: tuple[Tensor, Tensor], mask: Tensor,
                valid: Tensor) -> Tensor:
        """valid (B, T, 1): the attention output of padded frames is zeroed, as upstream's."""
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, temb)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm, cos_sin, mask) * valid
        norm = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale_mlp[:, None]) \
            + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


class RotaryFrequencies(nn.Module):
    """Holds x-transformers' `inv_freq` buffer, saved in flow.pt."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim_head, 2).float()
                                                         / dim_head))

    def forward(self, num_frames: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = torch.arange(num_frames, device=self.inv_freq.device).float()[:, None] \
            * self.inv_freq[None]                                       # (T, Dh / 2)
        emb = torch.cat((freqs, freqs), dim=-1)                         # de-interleaved order
        return emb.cos().to(dtype), emb.sin().to(dtype)


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_embed = DiTTimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryFrequencies(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormContinuous(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def attention_mask(self, lengths: Tensor, num_frames: int, streaming: Tensor) -> Tensor:
        """(B, 1, T, T): keys within each row's length; rows with streaming (B,) True: also
        only the query's chunk of static_chunk_size frames and every chunk before it."""
        frames = torch.arange(num_frames, device=lengths.device)
        mask = (frames[None, :] < lengths[:, None])[:, None, None, :]    # (B, 1, 1, T)
        mask = mask.expand(-1, 1, num_frames, -1)
        chunk = self.cfg.static_chunk_size
        ends = (frames // chunk + 1) * chunk                              # (T,) per query
        in_chunks = frames[None, :] < ends[:, None]                       # (T, T)
        return mask & (in_chunks | ~streaming[:, None, None, None])

    def forward(self, x: Tensor, t: Tensor, mu: Tensor, spks: Tensor, cond: Tensor,
                lengths: Tensor, streaming: Tensor) -> Tensor:
        """x, mu, cond (B, T, mel), t (B,), spks (B, mel), lengths (B,), streaming (B,) bool
        (upstream's chunk mask) -> velocity (B, T, mel).
        Rows are padded on the right; a row's first lengths[b] frames see none past them.
        The inputs are cast to the DiT's dtype (`compute_in`), the velocity back to x's."""
        dtype = self.proj_out.weight.dtype
        temb = self.time_embed(t)
        h = self.input_embed(x.to(dtype), cond.to(dtype), mu.to(dtype), spks.to(dtype))
        cos_sin = self.rotary_embed(h.shape[1], h.dtype)
        mask = self.attention_mask(lengths, h.shape[1], streaming)
        valid = (torch.arange(h.shape[1], device=h.device)[None, :] < lengths[:, None])
        valid = valid.unsqueeze(-1).to(h.dtype)                            # (B, T, 1)
        for block in self.transformer_blocks:
            h = block(h, temb, cos_sin, mask, valid)
        return self.proj_out(self.norm_out(h, temb)).to(x.dtype)

    def compute_in(self, dtype: torch.dtype) -> None:
        """Run the transformer in `dtype` (bfloat16: its matmuls, convolutions and attention),
        its inputs and velocity staying in theirs (the Euler state float32), as Qwen2.5-Omni's
        `Token2WavDiT.compute_in`; the rotary frequencies stay float32 (their angles reach
        the thousands)."""
        for module in self.children():
            if module is not self.rotary_embed:
                module.to(dtype)


class PreLookaheadLayer(nn.Module):
    def __init__(self, channels_in: int, channels: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels_in, channels, pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels_in, 3)

    def forward(self, x: Tensor) -> Tensor:
        """(B, N, C) -> (B, N, C): each token sees the pre_lookahead_len after it (zeros past
        the end: the whole utterance is here) and, through conv2, the two before."""
        h = F.pad(x.transpose(1, 2), (0, self.pre_lookahead_len))
        h = F.pad(F.leaky_relu(self.conv1(h)), (2, 0))
        return self.conv2(h).transpose(1, 2) + x


class Decoder(nn.Module):
    """Upstream's CausalConditionalCFM holds the estimator; only its name survives here."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.estimator = DiT(cfg)


class CausalMaskedDiffWithDiT(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.lookahead_channels,
                                                     cfg.pre_lookahead_len)
        self.decoder = Decoder(cfg.dit)

    @property
    def estimator(self) -> DiT:
        return self.decoder.estimator

    def encode_tokens(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens (B, N) = prompt tokens then tokens, padded on the right; lengths (B,) ->
        mu (B, N * token_mel_ratio, mel), zero-embedded past each row's length."""
        keep = (torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None])
        h = self.input_embedding(tokens.clamp(min=0)) * keep.unsqueeze(-1).to(
            self.input_embedding.weight.dtype)
        return self.pre_lookahead_layer(h).repeat_interleave(self.cfg.token_mel_ratio, dim=1)

    def compute_in(self, dtype: torch.dtype) -> None:
        """The DiT in `dtype` (`DiT.compute_in`); the token encoder and the speaker
        projection, run once a chunk, keep theirs."""
        self.estimator.compute_in(dtype)

    def speaker(self, xvector: Tensor) -> Tensor:
        """(B, spk_embed_dim) x-vector -> (B, mel)."""
        return self.spk_embed_affine_layer(F.normalize(xvector, dim=1))

    def guided_velocity(self, x: Tensor, t: Tensor, mu: Tensor, spks: Tensor, cond: Tensor,
                        lengths: Tensor, streaming: Tensor) -> Tensor:
        """Both CFG halves in one batch of 2B: the unconditional one has mu, spks, cond zero."""
        w = self.cfg.inference_cfg_rate
        v = self.estimator(torch.cat([x, x]), torch.cat([t, t]),
                           torch.cat([mu, torch.zeros_like(mu)]),
                           torch.cat([spks, torch.zeros_like(spks)]),
                           torch.cat([cond, torch.zeros_like(cond)]),
                           torch.cat([lengths, lengths]), torch.cat([streaming, streaming]))
        cond_v, null_v = v.chunk(2)
        return (1.0 + w) * cond_v - w * null_v
