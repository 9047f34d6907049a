"""The code predictor of Qwen3-Omni's and Qwen3-TTS's talkers: a small dense decoder that
fills codes 1 .. G-1 of a codec frame from the talker's last hidden state and code 0 (see
talker.py for where it sits), run per frame through the engine's Qwen3 decoder layers (their
fused one-row kernels and paged attention) over its own small KV cache (`FrameCache`), and
`CodePredictorGraphs`, its CUDA graphs. Qwen3-TTS's may be narrower than its talker: its
embeddings then have the talker's width and `small_to_mtp_projection` maps every input in."""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
from torch import Tensor, nn

from omnistage.layers import fused, graph_capture
from omnistage.layers.attention import (AttentionMetadata, forward_context,
                                        get_attention_backend)
from omnistage.layers.sampling import GREEDY_EPS, apply_top_k_top_p
from omnistage.layers.linear import Linear
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import get_rope
from omnistage.models.config import ModelConfig
from omnistage.models.qwen2 import Qwen2DecoderLayer

logger = logging.getLogger(__name__)


class CodePredictorModel(nn.Module):
    """Qwen3's decoder layers (the engine's, fused kernels and paged attention included) over
    a frame's tokens: x (T, hidden) at `positions`, inside a `forward_context` of `FrameCache`'s
    metadata -> normed hidden (T, hidden)."""

    def __init__(self, cfg: ModelConfig, num_code_groups: int, embedding_dim: int) -> None:
        super().__init__()
        assert cfg.has_qk_norm, "the code predictor is a Qwen3 decoder (q/k norm)"
        rotary_emb = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_parameters)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, rotary_emb)
                                    for _ in range(cfg.num_hidden_layers))
        for layer in self.layers:
            layer.self_attn.attn.private_cache = True      # FrameCache's, not the engine's
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # embeddings of codes 1 .. G-1 (code 0 is embedded by the talker's codec_embedding)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, embedding_dim,
                         _weight=torch.empty(cfg.vocab_size, embedding_dim))
            for _ in range(num_code_groups - 1))
        for emb in self.codec_embedding:
            emb.weight.requires_grad_(False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        h, residual = x, None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm.add_forward(h, residual)[0]


class FrameCache:
    """The code predictor's paged KV cache for frames of up to `rows` rows, and the attention
    metadata of each round: row i owns the blocks [i n, (i + 1) n), n = ceil(G / block_size);
    round 0 writes positions 0 and 1 (the talker's hidden state and code 0's embedding), round
    r > 0 position r + 1. A frame's metadata depends on its row count alone, so it is built
    once per (rows, round), outside any CUDA graph, and its tensors stay alive with this
    object (a captured graph reads them)."""

    BLOCK_SIZE = 16

    def __init__(self, model: CodePredictorModel, num_code_groups: int, rows: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        attn = model.layers[0].self_attn.attn
        self.rows, self.device = rows, device
        self.blocks_per_row = -(-num_code_groups // self.BLOCK_SIZE)
        shape = (rows * self.blocks_per_row, self.BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device)) for _ in model.layers]
        self.backend = get_attention_backend("auto", device, self.BLOCK_SIZE,
                                             attn.num_heads // attn.num_kv_heads,
                                             attn.num_kv_heads)
        self.rounds: dict[tuple[int, int], tuple[AttentionMetadata, Tensor]] = {}

    def bind(self, model: CodePredictorModel) -> None:
        """Point every layer's attention at this cache (graph replays need no binding)."""
        for layer, (k, v) in zip(model.layers, self.caches):
            attn = layer.self_attn.attn
            attn.k_cache, attn.v_cache, attn.backend = k, v, self.backend

    def round(self, b: int, r: int) -> tuple[AttentionMetadata, Tensor]:
        """(metadata, positions (T,)) of round r of a frame of b rows."""
        key = (b, r)
        if key not in self.rounds:
            assert self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
                "metadata built mid-capture"
            assert b <= self.rows, (b, self.rows)
            span = self.blocks_per_row * self.BLOCK_SIZE
            pos = [0, 1] if r == 0 else [r + 1]
            n = len(pos)
            positions = pos * b
            slots = [i * span + p for i in range(b) for p in pos]
            tables = [[i * self.blocks_per_row + j for j in range(self.blocks_per_row)]
                      for i in range(b)]
            qsl, seq_lens = list(range(0, n * b + 1, n)), [pos[-1] + 1] * b

            def dev(values: list, dtype: torch.dtype) -> Tensor:
                return torch.tensor(values, dtype=dtype).to(self.device)
            md = AttentionMetadata(dev(slots, torch.int64), dev(qsl, torch.int32),
                                   dev(seq_lens, torch.int32), dev(tables, torch.int32), qsl,
                                   seq_lens, n, pos[-1] + 1)
            self.backend.prepare(md, True)
            self.rounds[key] = (md, dev(positions, torch.int64))
        return self.rounds[key]


class CodePredictor(nn.Module):
    """Fills codes 1 .. G-1 of a frame from the talker's last hidden state and code 0; batched
    over B frames (requests), one forward per code group.

    `predict` draws every random number a frame needs first (per row, from the row's own
    generator), then `run_groups` is tensor work only, with no host synchronisation: on CUDA
    `CodePredictorGraphs` replays it as one graph per batch-size bucket instead of G-1 rounds
    of small kernel launches (`graphs`, set by the talker stage when asked)."""

    def __init__(self, cfg: ModelConfig, num_code_groups: int,
                 embedding_dim: int | None = None) -> None:
        """embedding_dim: the talker's width (None: the predictor's own)."""
        super().__init__()
        assert num_code_groups >= 2, f"num_code_groups {num_code_groups} < 2"
        self.cfg = cfg
        self.num_code_groups = num_code_groups
        self.embedding_dim = embedding_dim or cfg.hidden_size
        self.model = CodePredictorModel(cfg, num_code_groups, self.embedding_dim)
        self.lm_head = nn.ModuleList(Linear(cfg.hidden_size, cfg.vocab_size)
                                     for _ in range(num_code_groups - 1))
        # talker width -> predictor width (the reference: a Linear with bias, or identity)
        self.small_to_mtp_projection = (
            Linear(self.embedding_dim, cfg.hidden_size, bias=True)
            if self.embedding_dim != cfg.hidden_size else nn.Identity())
        self.graphs: CodePredictorGraphs | None = None
        self._caches: dict[tuple[int, torch.device, torch.dtype], FrameCache] = {}

    @torch.no_grad()
    def predict(self, past_hidden: Tensor, code0: Tensor, code0_embeds: Tensor, *,
                greedy: bool = True, temperature: float | Tensor = 1.0,
                top_k: int | Tensor = 50, top_p: float | Tensor = 0.8,
                generators: Sequence[torch.Generator | None] | None = None
                ) -> tuple[Tensor, Tensor]:
        """past_hidden (B, H): the talker's final (normed) hidden state of the frame's last
        position; code0 (B,) and its talker embedding code0_embeds (B, H).

        greedy: argmax at every group (the reference with do_sample=False). Otherwise each row
        samples with its temperature / top_k (0: off) / top_p (scalars or (B,) tensors; a row
        with temperature < 1e-5 is greedy) from its own generator (None: torch's global one).
        The reference samples the code predictor with top_k=50, top_p=0.8, the defaults here.

        Returns codes (B, G) with code0 first, and next_input_embeds (B, H) = the sum of the G
        codes' embeddings (talker's for code 0, the predictor's own for the others)."""
        b, dev = past_hidden.shape[0], past_hidden.device
        assert code0.shape == (b,) and code0_embeds.shape == past_hidden.shape, \
            f"past_hidden {tuple(past_hidden.shape)}, code0 {tuple(code0.shape)}, " \
            f"code0_embeds {tuple(code0_embeds.shape)}"
        if generators is not None and len(generators) != b:
            raise ValueError(f"generators: {len(generators)} for {b} rows")
        sampling = None
        if not greedy:
            sampling = (*_row_params(b, dev, temperature, top_k, top_p),
                        self.draw_noise(b, dev, generators))
        if self.graphs is not None and b <= self.graphs.max_batch:
            return self.graphs.run(past_hidden, code0, code0_embeds, sampling)
        return self.run_groups(past_hidden, code0, code0_embeds, sampling)

    def draw_noise(self, b: int, dev: torch.device,
                   generators: Sequence[torch.Generator | None] | None) -> Tensor:
        """(G-1, B, V) Exponential(1) draws for the exponential race of every group: row i's
        from its own generator (None: torch's global one), so a row's codes depend only on its
        seed, never on the batch it shares."""
        q = torch.empty(b, self.num_code_groups - 1, self.cfg.vocab_size, device=dev)
        for i in range(b):
            q[i].exponential_(generator=None if generators is None else generators[i])
        return q.transpose(0, 1)

    def project(self, x: Tensor) -> Tensor:
        """Talker width -> the predictor's (a matrix-vector kernel for one row on CUDA)."""
        proj = self.small_to_mtp_projection
        return fused.linear(proj, x) if isinstance(proj, Linear) else x

    def frame_cache(self, rows: int, device: torch.device, dtype: torch.dtype) -> FrameCache:
        """A KV cache for frames of at least `rows` rows on device: the smallest power of two
        that holds them. Kept for the predictor's life (CUDA graphs read their caches)."""
        cap = 1 << max(0, rows - 1).bit_length()
        key = (cap, device, dtype)
        if key not in self._caches:
            self._caches[key] = FrameCache(self.model, self.num_code_groups, cap, device, dtype)
        return self._caches[key]

    def run_groups(self, past_hidden: Tensor, code0: Tensor, code0_embeds: Tensor,
                   sampling: tuple[Tensor, Tensor, Tensor, Tensor] | None,
                   cache: FrameCache | None = None) -> tuple[Tensor, Tensor]:
        """The G-1 rounds of `predict` on tensors alone. sampling: None (greedy) or (B,)
        temperature, top_k, top_p and the (G-1, B, V) noise of `draw_noise`. cache: the KV
        cache to use (None: `frame_cache`'s for B rows)."""
        b = past_hidden.shape[0]
        cache = cache or self.frame_cache(b, past_hidden.device, past_hidden.dtype)
        cache.bind(self.model)
        codes, embeds = [code0], [code0_embeds]
        x = torch.stack([past_hidden, code0_embeds], dim=1).flatten(0, 1)     # (2B, E)
        for g in range(1, self.num_code_groups):
            md, positions = cache.round(b, g - 1)
            with forward_context(md):
                h = self.model(self.project(x), positions)
            if g == 1:
                h = h[1::2]                                     # each row's last position
            logits = fused.linear(self.lm_head[g - 1], h).float()             # (B, V)
            code = logits.argmax(dim=-1) if sampling is None else \
                _sample(logits, *sampling[:3], sampling[3][g - 1])
            codes.append(code)
            embeds.append(self.model.codec_embedding[g - 1](code))
            x = embeds[-1]                                                     # (B, E)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(dim=1)


class CodePredictorGraphs:
    """CUDA graphs of `CodePredictor.run_groups`: one per (batch-size bucket, greedy or not),
    over static input buffers, all captured at start-up by `capture_all` (a capture inside a
    serving step, its warm-up compiling kernels, would hold that step up), else by the first
    frame to use each. A frame of B rows is copied into the first B rows of the buffers, the
    bucket's graph replays, and the first B rows of its outputs are copied out; padding rows
    keep whatever they held (their codes are dropped)."""

    def __init__(self, predictor: CodePredictor, max_batch: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.predictor = predictor
        self.sizes = graph_capture.graph_batch_sizes(max_batch)
        self.max_batch = n = self.sizes[-1]
        cfg, groups = predictor.cfg, predictor.num_code_groups
        self.past_hidden = torch.zeros(n, predictor.embedding_dim, dtype=dtype, device=device)
        self.code0_embeds = torch.zeros_like(self.past_hidden)
        self.code0 = torch.zeros(n, dtype=torch.int64, device=device)
        self.temperature = torch.ones(n, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, device=device)
        self.noise = torch.ones(groups - 1, n, cfg.vocab_size, device=device)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0
        self.cache = predictor.frame_cache(n, device, dtype)   # every bucket's rows

    def _inputs(self, bs: int, greedy: bool) -> tuple:
        sampling = None if greedy else (self.temperature[:bs], self.top_k[:bs],
                                        self.top_p[:bs], self.noise[:, :bs])
        return self.past_hidden[:bs], self.code0[:bs], self.code0_embeds[:bs], sampling

    @torch.no_grad()               # as `run` captures one (inside `predict`)
    def capture_all(self) -> None:
        """Capture every bucket, greedy and sampled, largest first (those not captured yet)."""
        start = time.perf_counter()
        for bs in reversed(self.sizes):
            for greedy in (True, False):
                if (bs, greedy) not in self.graphs:
                    self._capture(bs, greedy)
        logger.info("captured CUDA graphs of the code predictor for batch sizes %s, greedy and "
                    "sampled, in %.2f s", self.sizes, time.perf_counter() - start)

    def _capture(self, bs: int, greedy: bool) -> None:
        graph, (codes, embeds) = graph_capture.capture_graph(
            lambda: self.predictor.run_groups(*self._inputs(bs, greedy), cache=self.cache),
            self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, greedy)] = (graph, codes, embeds)

    def run(self, past_hidden: Tensor, code0: Tensor, code0_embeds: Tensor,
            sampling: tuple[Tensor, Tensor, Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        b = past_hidden.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.past_hidden[:b].copy_(past_hidden)
        self.code0[:b].copy_(code0)
        self.code0_embeds[:b].copy_(code0_embeds)
        if sampling is not None:
            temperature, top_k, top_p, noise = sampling
            self.temperature[:b].copy_(temperature)
            self.top_k[:b].copy_(top_k)
            self.top_p[:b].copy_(top_p)
            self.noise[:, :b].copy_(noise)
        key = (bs, sampling is None)
        if key not in self.graphs:
            self._capture(*key)
        graph, codes, embeds = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        return codes[:b].clone(), embeds[:b].clone()


def _row_params(b: int, dev: torch.device, temperature: float | Tensor, top_k: int | Tensor,
                top_p: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    def per_row(value: float | int | Tensor, dtype: torch.dtype, name: str) -> Tensor:
        t = torch.as_tensor(value, dtype=dtype, device=dev)
        if t.dim() == 0:
            t = t.expand(b)
        if t.shape != (b,):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected a scalar or ({b},)")
        return t
    return (per_row(temperature, torch.float32, "temperature"),
            per_row(top_k, torch.int64, "top_k"), per_row(top_p, torch.float32, "top_p"))


def _sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
            noise: Tensor) -> Tensor:
    """(B, V) float32 logits -> (B,) codes: temperature, top-k, top-p, then the exponential
    race argmax(probs / q), q ~ Exp(1) from `noise` (B, V), as the engine's sampler draws."""
    vocab = logits.shape[1]
    is_greedy = temperature < GREEDY_EPS
    x = logits / torch.where(is_greedy, 1.0, temperature)[:, None]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    x = apply_top_k_top_p(x, k, top_p)
    probs = torch.softmax(x, dim=-1)
    sampled = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return torch.where(is_greedy, logits.argmax(dim=-1), sampled)
