"""Voxtral-TTS's generation head: the backbone's last hidden state h -> one frame of 37 codes,
and the packed audio table that turns a frame back into the next position's input.

    semantic: semantic_codebook_output(h), [EMPTY_AUDIO] and the padding masked, argmax
              ([END_AUDIO] = 1 ends the utterance; that frame's acoustic codes are not used)
    acoustic: x0 = noise (B, 36); Euler on t = 0, 1/n, ..., 1 of the velocity
              v = a v(x, t, h) + (1 - a) v(x, t, 0)     (both halves in one forward)
              v(x, t, h) = acoustic_codebook_output(norm(transformer(
                  [input_projection(x), time_projection(sinusoid(t)), llm_projection(h)]))[0])
              (3 tokens, bidirectional, no positions); clamp to [-1, 1], round to the levels
    codes are returned in the LLM's space (+2 specials), as the packed table reads them.

Checkpoint names are the release's `acoustic_transformer.*` and
`mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight`."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.layers.norm import RMSNorm
from omnistage.models.voxtral_tts.codec import _FeedForward
from omnistage.models.voxtral_tts.config import EMPTY_AUDIO, END_AUDIO, N_SPECIALS, HeadConfig, \
    load_consolidated, load_into, read_params


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.d = c.n_heads, c.n_kv_heads, c.head_dim
        self.wq = Linear(c.dim, c.n_heads * c.head_dim, bias=c.use_biases)
        self.wk = Linear(c.dim, c.n_kv_heads * c.head_dim)
        self.wv = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.use_biases)
        self.wo = Linear(c.n_heads * c.head_dim, c.dim, bias=c.use_biases)

    def forward(self, x: Tensor) -> Tensor:                                 # (B, S, dim)
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.wk(x).view(b, n, self.hkv, self.d).transpose(1, 2)
        v = self.wv(x).view(b, n, self.hkv, self.d).transpose(1, 2)
        if self.h != self.hkv:
            k = k.repeat_interleave(self.h // self.hkv, dim=1)
            v = v.repeat_interleave(self.h // self.hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, n, self.h * self.d))


class _Block(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.feed_forward = _FeedForward(c.dim, c.hidden_dim)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class VoxtralFlowHead(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        if c.input_dim != c.dim:
            raise NotImplementedError("Voxtral head: the semantic layer reads h with in_features"
                                      f" = dim; input_dim {c.input_dim} != dim {c.dim}")
        self.cfg = c
        half = c.dim // 2
        inv = torch.exp(-math.log(10000.0) * torch.arange(half).float() / half)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.input_projection = Linear(c.n_acoustic_codebook, c.dim)
        self.time_projection = Linear(c.dim, c.dim)
        self.llm_projection = Linear(c.input_dim, c.dim)
        self.semantic_codebook_output = Linear(c.dim, c.semantic_out_size, bias=c.use_biases)
        self.acoustic_codebook_output = Linear(c.dim, c.n_acoustic_codebook)
        self.layers = nn.ModuleDict({str(i): _Block(c) for i in range(c.n_layers)})
        self.norm = RMSNorm(c.dim, c.norm_eps)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str = "cpu") -> VoxtralFlowHead:
        _, head_cfg, _ = read_params(folder)
        model = cls(head_cfg).to(device)
        state = load_consolidated(folder, "acoustic_transformer.", device)
        load_into(model, state, f"{folder}: acoustic_transformer")
        return model.eval()

    def semantic(self, h: Tensor) -> Tensor:
        """(B, D) -> the semantic code (B,) in the LLM's space (0..1 specials, 2.. codes)."""
        logits = self.semantic_codebook_output(h).float()
        logits[:, EMPTY_AUDIO] = float("-inf")
        logits[:, N_SPECIALS + self.cfg.semantic_codebook_size:] = float("-inf")
        return logits.argmax(dim=-1)

    def time_embedding(self, t: Tensor) -> Tensor:                          # (B, 1) -> (B, dim)
        emb = t * self.inv_freq[None]
        return torch.cat([emb.cos(), emb.sin()], dim=-1)

    def velocity(self, x: Tensor, h: Tensor, t_emb: Tensor) -> Tensor:
        """The velocity of x (B, n) given h (B, D) and the sinusoid of t (B, D)."""
        seq = torch.stack([self.input_projection(x.to(h.dtype)), self.time_projection(t_emb),
                           self.llm_projection(h)], dim=1)
        for layer in self.layers.values():
            seq = layer(seq)
        return self.acoustic_codebook_output(self.norm(seq)[:, 0])

    def acoustic(self, h: Tensor, cfg_alpha: Tensor, noise: Tensor) -> Tensor:
        """7 (n_decoding_steps) Euler steps with CFG -> levels (B, n) in 0..levels-1."""
        b, steps = h.shape[0], self.cfg.n_decoding_steps
        ts = torch.linspace(0, 1, steps + 1, device=h.device).to(h.dtype)
        alpha = cfg_alpha.to(device=h.device, dtype=h.dtype)[:, None]
        both = torch.cat([h, torch.zeros_like(h)], dim=0)
        x = noise.to(h.dtype)
        for i in range(steps):
            t_emb = self.time_embedding(ts[i].view(1, 1).expand(b, 1)).to(h.dtype)
            v = self.velocity(torch.cat([x, x]), both, torch.cat([t_emb, t_emb]))
            x = x + (alpha * v[:b] + (1 - alpha) * v[b:]) * (ts[i + 1] - ts[i])
        levels = self.cfg.acoustic_codebook_size
        return ((x.clamp(-1, 1) + 1) / 2 * (levels - 1)).round().long()

    @torch.no_grad()
    def forward(self, h: Tensor, cfg_alpha: Tensor, noise: Tensor) -> Tensor:
        """h (B, D), cfg_alpha (B,), noise (B, n_acoustic) -> one frame (B, 1 + n_acoustic)
        in the LLM's space; an [END_AUDIO] row's acoustic levels are set to [EMPTY_AUDIO] (0)
        before the +2 shift, so they read 2, as vLLM-Omni's do."""
        sem = self.semantic(h)
        ac = self.acoustic(h, cfg_alpha, noise)
        ac = torch.where((sem == END_AUDIO)[:, None], EMPTY_AUDIO, ac)   # then shifted like
        # the rest, as upstream (a where, not a masked store: no host sync, so it graphs)
        return torch.cat([sem[:, None], ac + N_SPECIALS], dim=1)


class VoxtralAudioEmbedding(nn.Module):
    """The packed table of the 37 codebooks (each with its 2 specials, offsets by cumsum):
    a frame's codes (..., 37) in the LLM's space -> the sum of their rows (..., D)."""

    def __init__(self, c: HeadConfig, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.packed_table_size, dim), requires_grad=False)
        sizes = c.codebook_sizes
        offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str = "cpu") -> VoxtralAudioEmbedding:
        params, head_cfg, _ = read_params(folder)
        model = cls(head_cfg, params["dim"]).to(device)
        key = "mm_audio_embeddings.audio_codebook_embeddings.embeddings."
        load_into(model, load_consolidated(folder, key, device), f"{folder}: {key}")
        return model.eval()

    def forward(self, codes: Tensor) -> Tensor:
        return F.embedding(codes + self.offsets, self.weight).sum(dim=-2)
