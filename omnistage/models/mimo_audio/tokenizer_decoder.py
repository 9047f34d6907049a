"""MiMo-Audio-Tokenizer's decoder: RVQ ids (channels, T) -> waveform, one utterance at a time.

    codebooks: sum over channels of codebook_c[ids_c]                         (T, d_model)
    dconv1 (when avg_pooler > 1): transposed conv k = s = avg_pooler, GroupNorm(1)
    transformer: pre-LayerNorm layers, rotary (neox halves), window attention
                 (key j seen by query i iff i - left <= j <= i + right; causal: right = 0),
                 GELU MLP; final LayerNorm
    dconv2: transposed conv to n_mels (k, s), GroupNorm(1), the last k - s frames cut
    vocoder: Linear(n_mels) -> the same transformer (non-causal, its own window) -> LayerNorm
             -> Linear to n_fft + 2 -> log-magnitude (exp, clipped at 100) and phase
             -> inverse STFT with "same" padding (hann window, envelope-normalised)

Parameter names are upstream MiMoAudioTokenizer's (`decoder.*`, and the codebooks
`encoder.quantizer.vq.layers.{c}._codebook.embed`); the encoder: tokenizer_encoder.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear

M = TypeVar("M", bound=nn.Module)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _rope(n: int, dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    freqs = torch.arange(n, device=device).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]                     # (n, 1, dim)
    return emb.cos(), emb.sin()


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.v_proj = Linear(dim, dim, bias=True), Linear(dim, dim, bias=True)
        self.k_proj = Linear(dim, dim, bias=False)
        self.out_proj = Linear(dim, dim, bias=True)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask)
        return self.out_proj(o.transpose(0, 1).reshape(n, -1))


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = _Attention(dim, heads)
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc1, self.fc2 = Linear(dim, ffn, bias=True), Linear(ffn, dim, bias=True)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), rope, mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class _Stack(nn.Module):
    """Layers + window mask + rotary, over one sequence (n, dim)."""

    def __init__(self, dim: int, heads: int, ffn: int, n: int, window: list[int],
                 causal: bool, theta: float, skip: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(dim, heads, ffn) for _ in range(n))
        self.layer_norm = nn.LayerNorm(dim)
        self.left, self.right = window[0], 0 if causal else window[1]
        self.head_dim, self.theta = dim // heads, theta
        self.skip = skip            # layer k's output joins the last one's (the encoder's)

    def run(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        i = torch.arange(n, device=x.device)[:, None]
        j = torch.arange(n, device=x.device)[None, :]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device)
        if self.left >= 0:
            mask &= j >= i - self.left
        if self.right >= 0:
            mask &= j <= i + self.right
        rope = _rope(n, self.head_dim, self.theta, x.device)
        skipped: Tensor | float = 0.0
        for k, layer in enumerate(self.layers, 1):
            x = layer(x, rope, mask)
            if k == self.skip:
                skipped = x
        return self.layer_norm(x + skipped)


class _UpConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, s: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.ConvTranspose1d(cin, cout, k, s), nn.GroupNorm(1, cout)
        self.cut = max(0, k - s)

    def forward(self, x: Tensor) -> Tensor:                      # (n, cin) -> (m, cout)
        y = self.norm(self.conv(x.T[None]))[0].T
        return y[: y.shape[0] - self.cut]


class _Vocoder(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        d = c["vocoder_dim"]
        self.embeddings = Linear(c["n_mels"], d, bias=False)
        self.stack = _Stack(d, c["vocoder_attention_heads"], c["vocoder_intermediate_dim"],
                            c["vocoder_num_layers"], c["vocoder_attn_window_size"] or [-1, -1],
                            False, c["rope_theta"])
        self.out = Linear(d, c["nfft"] + 2, bias=True)
        self.nfft, self.hop = c["nfft"], c["hop_length"]
        self.register_buffer("window", torch.hann_window(self.nfft), persistent=False)

    def forward(self, mel: Tensor) -> Tensor:                    # (frames, n_mels) -> (samples,)
        x = self.out(self.stack.run(self.embeddings(mel))).T.float()       # (nfft + 2, frames)
        mag, phase = x.chunk(2, dim=0)
        spec = mag.exp().clip(max=1e2) * torch.polar(torch.ones_like(phase), phase)
        frames = torch.fft.irfft(spec, self.nfft, dim=0) * self.window[:, None]
        n, pad = frames.shape[1], (self.nfft - self.hop) // 2
        size = (n - 1) * self.hop + self.nfft

        def overlap_add(cols: Tensor) -> Tensor:
            return F.fold(cols[None], (1, size), (1, self.nfft), stride=(1, self.hop))[0, 0, 0]
        y = overlap_add(frames)
        env = overlap_add(self.window.square()[:, None].expand(-1, n))
        return (y / env)[pad:-pad]


def _right_reach(c: dict, mels_per_frame: int) -> int:
    """How many code frames after a frame its samples depend on, leaving aside the GroupNorms
    (statistics of the whole sequence): the vocoder's attention window to the right in every
    layer, and the inverse STFT's half window (the decoder is causal, dconv2 looks back only).
    41 for the released tokenizer (16 layers x 10 mel frames + 2, over 4 mels a code);
    upstream's StreamingConfig.right_overlap is 40. An unbounded vocoder window or a
    non-causal decoder: upstream's 40."""
    right = (c["vocoder_attn_window_size"] or [-1, -1])[1]
    if right < 0 or not c.get("decoder_causal", True):
        return 40
    reach = c["vocoder_num_layers"] * right + -(-c["nfft"] // 2 // c["hop_length"])
    return -(-reach // mels_per_frame)


def tokenizer_config(path: str | Path) -> dict:
    """The tokenizer folder's config.json with upstream's defaults for the keys it may omit."""
    return {"avg_pooler": 1, "rope_theta": 10000, "decoder_causal": True,
            **json.loads((Path(path) / "config.json").read_text())}


def load_tokenizer_part(model: M, path: str | Path, device: torch.device | str,
                        source_name: Callable[[str], str]) -> M:
    """Each parameter of `model` (the encoder or the decoder) from the folder's safetensors,
    by its upstream name; ValueError naming the first one missing."""
    from safetensors.torch import load_file

    model = model.to(device)
    state: dict[str, Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(f, device=str(device)))
    for name, param in model.named_parameters():
        src = source_name(name)
        if src not in state:
            raise ValueError(f"{path}: missing {src}")
        with torch.no_grad():
            param.copy_(state[src])
    return model.eval()


class MiMoAudioTokenizerDecoder(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        for key, ok in (("ln_type", "LayerNorm"), ("rope_type", "default"),
                        ("vocoder_padding", "same"), ("activation_function", "gelu")):
            if c.get(key, ok) != ok:
                raise NotImplementedError(f"MiMo-Audio tokenizer: {key}={c[key]!r} (only "
                                          f"{ok!r} is ported)")
        d, pool = c["d_model"], c.get("avg_pooler", 1)
        self.codebooks = nn.ParameterList(nn.Parameter(torch.empty(n, d), requires_grad=False)
                                          for n in c["codebook_size"][: c["num_quantizers"]])
        self.dconv1 = _UpConv(d, d, pool, pool) if pool != 1 else None
        self.stack = _Stack(d, c["decoder_attention_heads"], c["decoder_ffn_dim"],
                            c["decoder_layers"], c["decoder_attn_window_size"] or [-1, -1],
                            c.get("decoder_causal", True), c["rope_theta"])
        self.dconv2 = _UpConv(d, c["n_mels"], c["decoder_kernel_size"], c["decoder_stride_size"])
        self.vocoder = _Vocoder(c)
        self.sample_rate = c["sampling_rate"]
        mels_per_frame = pool * c["decoder_stride_size"]
        self.frame_samples = mels_per_frame * c["hop_length"]     # waveform samples per code
        self.right_reach_frames = _right_reach(c, mels_per_frame)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu"
                        ) -> MiMoAudioTokenizerDecoder:
        return load_tokenizer_part(cls(tokenizer_config(path)), path, device, cls._source_name)

    @staticmethod
    def _source_name(name: str) -> str:
        if name.startswith("codebooks."):
            return f"encoder.quantizer.vq.layers.{name.split('.')[1]}._codebook.embed"
        name = name.replace("stack.layer_norm", "layer_norm").replace("stack.layers", "layers")
        name = name.replace("vocoder.out.", "vocoder.head.out.")
        return "decoder." + name

    @torch.no_grad()
    def forward(self, codes: Tensor) -> Tensor:
        """codes (channels, T) -> waveform (samples,), float32."""
        h = sum(book[ids] for book, ids in zip(self.codebooks, codes))
        if self.dconv1 is not None:
            h = self.dconv1(h)
        mel = self.dconv2(self.stack.run(h))
        return self.vocoder(mel)
