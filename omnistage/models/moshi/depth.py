"""Moshi's depth transformer (transformers' `MoshiDepthDecoder`): per 12.5 Hz frame, the K
audio codes, one after another, from the temporal transformer's hidden state and the frame's
text token. Position k has its own weights in every projection (a "flexible" linear: one
matrix per codebook, checkpoint shape (K, out, in)) and no rope:

    pos 0:  text_embed_tokens[text]      + input_projections[0] @ h  -> lm_heads[0] -> code 0
    pos k:  embed_tokens[k - 1][code k-1] + input_projections[k] @ h -> lm_heads[k] -> code k

Greedy (argmax), as transformers' `generate` runs it inside Moshi's with do_sample off, or
sampled per row (temperature, top-k: the released generation config samples, 0.8 / 250) by
the exponential race with noise drawn outside (`draw`). On CUDA, `graphs` and
`sampled_graphs` (`RowGraphs` of `run_codebooks`, set by the duplex stage when asked) replay
`generate` (K codebooks x layers of small launches) as one graph per batch-size bucket.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import graph_capture
from omnistage.layers.activation import SiluAndMul
from omnistage.layers.norm import RMSNorm
from omnistage.layers.sampling import apply_top_k_top_p
from omnistage.models.moshi.config import DepthConfig


class FlexibleLinear(nn.Module):
    """One (out, in) matrix per codebook position."""

    def __init__(self, in_features: int, out_features: int, num: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, out_features, in_features))

    def forward(self, x: Tensor, k: int) -> Tensor:
        return F.linear(x, self.weight[k])


class FlexibleProj(nn.Module):
    """The checkpoint's `q_proj.linear.weight` nesting."""

    def __init__(self, in_features: int, out_features: int, num: int) -> None:
        super().__init__()
        self.linear = FlexibleLinear(in_features, out_features, num)

    def forward(self, x: Tensor, k: int) -> Tensor:
        return self.linear(x, k)


class DepthAttention(nn.Module):
    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        n, h = cfg.num_codebooks, cfg.hidden_size
        self.q_proj = FlexibleProj(h, self.num_heads * self.head_dim, n)
        self.k_proj = FlexibleProj(h, self.num_kv_heads * self.head_dim, n)
        self.v_proj = FlexibleProj(h, self.num_kv_heads * self.head_dim, n)
        self.o_proj = FlexibleProj(self.num_heads * self.head_dim, h, n)

    def forward(self, x: Tensor, k: int, cache: list[Tensor]) -> Tensor:
        """x (B, hidden) at codebook position k; cache: this layer's [keys, values] of the
        positions before k, (B, Hkv, k, D), extended in place."""
        b = x.shape[0]
        q = self.q_proj(x, k).view(b, self.num_heads, 1, self.head_dim)
        key = self.k_proj(x, k).view(b, self.num_kv_heads, 1, self.head_dim)
        val = self.v_proj(x, k).view(b, self.num_kv_heads, 1, self.head_dim)
        if cache:
            key, val = torch.cat([cache[0], key], 2), torch.cat([cache[1], val], 2)
        cache[:] = [key, val]
        out = F.scaled_dot_product_attention(q, key, val,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.reshape(b, -1), k)


class DepthMLP(nn.Module):
    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.fc1 = FlexibleLinear(cfg.hidden_size, cfg.ffn_dim, cfg.num_codebooks)
        self.fc2 = FlexibleLinear(cfg.ffn_dim // 2, cfg.hidden_size, cfg.num_codebooks)
        self.act = SiluAndMul()

    def forward(self, x: Tensor, k: int) -> Tensor:
        return self.fc2(self.act(self.fc1(x, k)), k)


class DepthLayer(nn.Module):
    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DepthAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DepthMLP(cfg)

    def forward(self, h: Tensor, k: int, cache: list[Tensor]) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), k, cache)
        return h + self.mlp(self.post_attention_layernorm(h), k)


class MoshiDepthDecoder(nn.Module):
    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n = cfg.num_codebooks
        self.text_embed_tokens = nn.Embedding(cfg.vocab_size + 1, cfg.hidden_size)
        self.embed_tokens = nn.ModuleList(nn.Embedding(cfg.audio_vocab_size + 1, cfg.hidden_size)
                                          for _ in range(n - 1))
        self.input_projections = FlexibleLinear(cfg.input_size, cfg.hidden_size, n)
        self.layers = nn.ModuleList(DepthLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.lm_heads = FlexibleLinear(cfg.hidden_size, cfg.audio_vocab_size, n)
        self.graphs: graph_capture.RowGraphs | None = None            # greedy frames
        self.sampled_graphs: graph_capture.RowGraphs | None = None    # sampled frames

    def step(self, hidden: Tensor, k: int, token: Tensor, caches: list[list[Tensor]]) -> Tensor:
        """Logits (B, audio_vocab) of code k, given the token before it (the text token for
        k = 0, code k - 1 after) and the temporal hidden state (B, input_size)."""
        embed = self.text_embed_tokens if k == 0 else self.embed_tokens[k - 1]
        h = embed(token) + self.input_projections(hidden, k)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, k, cache)
        return self.lm_heads(h, k)

    @torch.inference_mode()
    def generate(self, hidden: Tensor, text: Tensor,
                 sampling: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """Codes (B, K) of one frame: hidden (B, input_size), text token (B,); greedy, or
        sampled per row (`sampling`: temperature (B,), top_k (B,), Exponential(1) noise
        (B, K, audio_vocab); a row at temperature 0 stays greedy)."""
        graphs = self.graphs if sampling is None else self.sampled_graphs
        if graphs is not None and hidden.shape[0] <= graphs.sizes[-1]:
            return graphs(hidden, text, *(sampling or ()))
        return self.run_codebooks(hidden, text, *(sampling or ()))

    def run_codebooks(self, hidden: Tensor, text: Tensor, temperature: Tensor | None = None,
                      top_k: Tensor | None = None, noise: Tensor | None = None) -> Tensor:
        """`generate` eagerly: tensor work only, no host synchronisation."""
        caches: list[list[Tensor]] = [[] for _ in self.layers]
        token, codes = text, []
        for k in range(self.cfg.num_codebooks):
            logits = self.step(hidden, k, token, caches)
            token = logits.argmax(-1) if temperature is None else \
                draw(logits, temperature, top_k, noise[:, k])
            codes.append(token)
        return torch.stack(codes, dim=1)


def draw(logits: Tensor, temperature: Tensor, top_k: Tensor, noise: Tensor) -> Tensor:
    """Each row's token from logits (B, V): temperature-scaled softmax over its top_k (0: all)
    through the exponential race with its noise (B, V) (argmax of p / q, q ~ Exponential(1):
    a draw from p), or the argmax where the temperature is 0 (the engine sampler's maths)."""
    greedy = temperature <= 0
    x = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    vocab = torch.full_like(top_k, x.shape[-1])
    x = apply_top_k_top_p(x, torch.where(top_k > 0, top_k, vocab), torch.ones_like(temperature))
    sampled = (torch.softmax(x, dim=-1) / noise).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)
