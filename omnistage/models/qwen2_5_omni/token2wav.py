"""Qwen2.5-Omni token2wav: codec tokens -> mel by a flow-matching DiT -> waveform by BigVGAN.

The DiT predicts the velocity of a mel sequence of `repeats` frames per code, conditioned on
the codes, the speaker's vector (`cond`) and the speaker's reference mel (through Qwen3-TTS's
ECAPA-TDNN, qwen3_tts/speaker_encoder.py), at flow time t in [0, 1] (0: noise, 1: mel):

    x (B, T, mel), t (B,) -> [x | ECAPA(ref_mel) | code emb | cond] -> proj -> L x block
    block: AdaLN-zero(t) -> attention within blocks of `block_size` frames (layers in
           look_backward_layers also see the block before, in look_ahead_layers the one after;
           rotary on the first head only, over de-interleaved features, as trained)
           -> AdaLN-modulated GELU MLP
    -> AdaLN(t) -> proj_out -> velocity (B, T, mel)

Classifier-free guidance runs the unconditional half in the same batch (no speaker vector, a
zero reference mel, every code 0): v = v_c + (v_c - v_u) * guidance_scale. The ODE solver
that integrates the velocity lives in diffusion/solvers/rk4.py; the stage (generation/
token2wav.py) runs the loop. Parameter names follow the checkpoint's `token2wav.*`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from omnistage.layers.dit import AdaLayerNormContinuous, AdaLayerNormZero
from omnistage.layers.rotary import rotate_half
from omnistage.models.loader import load_component
from omnistage.models.qwen2_5_omni.bigvgan import BigVGAN
from omnistage.models.qwen3_tts.config import SpeakerEncoderConfig
from omnistage.models.qwen3_tts.speaker_encoder import Qwen3TTSSpeakerEncoder


@dataclass(frozen=True, slots=True)
class Token2WavConfig:
    dit: PretrainedConfig            # token2wav_config.dit_config, read by the DiT's modules
    bigvgan: PretrainedConfig

    @property
    def sample_rate(self) -> int:
        return 24000                 # the released vocoder's: 240 samples a mel frame

    @property
    def samples_per_code(self) -> int:
        return self.dit.repeats * math.prod(self.bigvgan.upsample_rates)

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> Token2WavConfig:
        t2w = hf_config.token2wav_config
        return cls(dit=t2w.dit_config, bigvgan=t2w.bigvgan_config)


def time_embedding(t: Tensor, dim: int = 256, scale: float = 1000.0) -> Tensor:
    """(B,) -> (B, dim): sin then cos of scale * t over geometric frequencies."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    args = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((args.sin(), args.cos()), dim=-1).type_as(t)


class DiTTimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.ModuleList([nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)])

    def forward(self, t: Tensor) -> Tensor:                       # (B,) -> (B, dim)
        h = time_embedding(t, self.freq_dim).to(self.time_mlp[0].weight.dtype)
        for layer in self.time_mlp:
            h = layer(h)
        return h


class DiTCodecEmbedding(nn.Module):
    def __init__(self, num_embeds: int, dim: int, repeats: int) -> None:
        super().__init__()
        self.repeats = repeats
        self.codec_embed = nn.Embedding(num_embeds + 1, dim)

    def forward(self, codes: Tensor) -> Tensor:                   # (B, N) -> (B, N * repeats, D)
        return torch.repeat_interleave(self.codec_embed(codes), self.repeats, dim=1)


class DiTInputEmbedding(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim + cfg.enc_dim + cfg.enc_emb_dim + cfg.emb_dim,
                              cfg.hidden_size)
        # Qwen3-TTS's ECAPA-TDNN, here over the reference mel (the same fields, the same names)
        self.spk_encoder = Qwen3TTSSpeakerEncoder(SpeakerEncoderConfig.from_json(cfg.to_dict()))

    def forward(self, x: Tensor, cond: Tensor, speaker: Tensor, code_embed: Tensor) -> Tensor:
        """x (B, T, mel), cond (B, enc_emb_dim), speaker (B, enc_dim) = spk_encoder(ref_mel),
        code_embed (B, T, emb)."""
        dtype = self.proj.weight.dtype      # the DiT's (the speaker encoder's may differ)
        speaker = speaker.to(dtype).unsqueeze(1).expand(-1, x.shape[1], -1)
        cond = cond.to(dtype).unsqueeze(1).expand(-1, x.shape[1], -1)
        return self.proj(torch.cat((x.to(dtype), speaker, code_embed, cond), dim=-1))


class DiTAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        inner = cfg.head_dim * cfg.num_attention_heads
        self.to_q = nn.Linear(cfg.hidden_size, inner)
        self.to_k = nn.Linear(cfg.hidden_size, inner)
        self.to_v = nn.Linear(cfg.hidden_size, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, cfg.hidden_size), nn.Identity()])
        self.to_qkv: nn.Linear | None = None        # fuse_qkv's, in place of the three

    def fuse_qkv(self) -> None:
        """q, k and v from one matmul of their stacked weights (after loading: the
        checkpoint's to_q / to_k / to_v become to_qkv): the same dot products, one launch
        instead of three, and one activation quantization where the linears are quantized."""
        if self.to_qkv is not None:                 # a second generator on the model
            return
        q, k, v = self.to_q, self.to_k, self.to_v
        fused = nn.Linear(q.in_features, 3 * q.out_features, device=q.weight.device,
                          dtype=q.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        del self.to_q, self.to_k, self.to_v
        self.to_qkv = fused

    def forward(self, x: Tensor, cos_sin: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """x (B, T, hidden); cos/sin (T, D); mask (T, T) or (B, 1, T, T) bool, True where a
        frame may look."""
        b, t, _ = x.shape
        if self.to_qkv is not None:
            q, k, v = self.to_qkv(x).view(b, t, 3, self.heads, self.head_dim) \
                .permute(2, 0, 3, 1, 4)                                      # 3 x (B, H, T, D)
        else:
            q, k, v = (proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                       for proj in (self.to_q, self.to_k, self.to_v))      # (B, H, T, D)
        q = torch.cat([_rotate_first_head(q[:, :1], *cos_sin), q[:, 1:]], dim=1)
        k = torch.cat([_rotate_first_head(k[:, :1], *cos_sin), k[:, 1:]], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


def _rotate_first_head(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The checkpoint's interleaved rotary as rotate-half over de-interleaved features (only
    head 0 is rotated, as trained); q and k get the same permutation, so q.k is unchanged."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return x * cos + rotate_half(x) * sin


class DiTMLP(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        self.ff = nn.ModuleList([nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh"),
                                 nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.ff:
            x = layer(x)
        return x


class DiTDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, look_ahead: int, look_back: int) -> None:
        super().__init__()
        self.look_ahead, self.look_back = look_ahead, look_back
        self.attn_norm = AdaLayerNormZero(cfg.hidden_size)
        self.attn = DiTAttention(cfg)
        self.ff = DiTMLP(cfg.hidden_size, cfg.ff_mult)

    def forward(self, x: Tensor, temb: Tensor, cos_sin: tuple[Tensor, Tensor], mask: Tensor
                ) -> Tensor:
        """mask (T, T) or (B, 1, T, T): this layer's (block, the one before if look_back,
        the one after if look_ahead)."""
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, temb)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm, cos_sin, mask)
        norm = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale_mlp[:, None]) \
            + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


class Token2WavDiT(nn.Module):
    # the linears that stay as they are when the DiT's linears are quantized (layers/fp8.py's
    # policy for native DiTs; generation/token2wav.py's `dit_quantization`): the input
    # embeddings (the input projection reads its own weight's dtype; the speaker encoder runs
    # once a request), the timestep MLP, the AdaLN modulations (one row per window) and the
    # output norm and projection (their error lands on the velocity unfiltered). What is
    # quantized: each block's q / k / v / out and MLP projections, nearly all the FLOPs
    fp8_keep = ("time_embed.*", "input_embed.*", "text_embed.*", "*.attn_norm.*",
                "norm_out.*", "proj_out")

    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_embed = DiTTimestepEmbedding(cfg.hidden_size)
        self.text_embed = DiTCodecEmbedding(cfg.num_embeds, cfg.emb_dim, cfg.repeats)
        self.input_embed = DiTInputEmbedding(cfg)
        self.transformer_blocks = nn.ModuleList(
            DiTDecoderLayer(cfg, look_ahead=int(i in cfg.look_ahead_layers),
                            look_back=int(i in cfg.look_backward_layers))
            for i in range(cfg.num_hidden_layers))
        self.norm_out = AdaLayerNormContinuous(cfg.hidden_size)
        self.proj_out = nn.Linear(cfg.hidden_size, cfg.mel_dim)
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def encode_speaker(self, ref_mel: Tensor) -> Tensor:
        """The reference mel's speaker vector, (B, R, mel) -> (B, enc_dim): the same at every
        evaluation of a request, so it is computed once."""
        return self.input_embed.spk_encoder(ref_mel)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor, speaker: Tensor, codes: Tensor,
                lengths: Tensor | None = None) -> Tensor:
        """x (B, T, mel), t (B,), cond (B, enc_emb_dim), speaker (B, enc_dim) (encode_speaker),
        codes (B, T / repeats) -> velocity (B, T, mel). lengths (B,): rows padded on the
        right, each row's first lengths[b] frames see no frame past them (the rest: junk)."""
        temb = self.time_embed(t)
        h = self.input_embed(x, cond, speaker, self.text_embed(codes))
        frames = torch.arange(h.shape[1], device=h.device)
        freqs = frames[:, None].float() * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos_sin = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
        blocks = frames // self.cfg.block_size
        block_diff = blocks[None, :] - blocks[:, None]               # (T, T): key's - query's
        masks = {(back, ahead): (block_diff >= -back) & (block_diff <= ahead)
                 for back in (0, 1) for ahead in (0, 1)}
        if lengths is not None:      # (B, 1, T, T); a padded frame sees itself (no NaN rows)
            real = frames[None, None, None, :] < lengths[:, None, None, None]
            eye = torch.eye(h.shape[1], dtype=torch.bool, device=h.device)
            masks = {k: (m & real) | eye for k, m in masks.items()}
        for block in self.transformer_blocks:
            h = block(h, temb, cos_sin, masks[block.look_back, block.look_ahead])
        return self.proj_out(self.norm_out(h, temb)).to(x.dtype)

    def fuse_qkv(self) -> None:
        """Every block's q / k / v projections as one (DiTAttention.fuse_qkv)."""
        for block in self.transformer_blocks:
            block.attn.fuse_qkv()

    def compute_in(self, dtype: torch.dtype) -> None:
        """Run the transformer in `dtype` (bfloat16: its matmuls and attention, measured
        against float32 by benchmarks/omni25's waveform SNR), its inputs and velocity staying
        in theirs (the ODE state float32); the speaker encoder, run once a request, keeps its
        dtype."""
        spk = self.input_embed.spk_encoder
        for module in self.children():
            if module is not self.input_embed:
                module.to(dtype)
        for module in self.input_embed.children():
            if module is not spk:
                module.to(dtype)

    def guided_velocity(self, x: Tensor, t: Tensor, cond: Tensor, speaker: Tensor,
                        null_speaker: Tensor, codes: Tensor, guidance_scale: float,
                        lengths: Tensor | None = None) -> Tensor:
        """The velocity with classifier-free guidance, both halves in one batch; the
        unconditional half: no speaker vector, null_speaker = encode_speaker(zero reference
        mel), every code 0."""
        if guidance_scale < 1e-5:
            return self(x, t, cond, speaker, codes, lengths)
        both = self(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, torch.zeros_like(cond)]),
                    torch.cat([speaker, null_speaker.expand_as(speaker)]),
                    torch.cat([codes, torch.zeros_like(codes)]),
                    None if lengths is None else torch.cat([lengths, lengths]))
        guided, null = both.chunk(2)
        return guided + (guided - null) * guidance_scale


class Token2Wav(nn.Module):
    """The DiT and the vocoder of the checkpoint's `token2wav.*`, run in float32 as the
    reference insists (its generate() casts token2wav to float)."""

    def __init__(self, cfg: Token2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        v = cfg.bigvgan
        self.code2wav_dit_model = Token2WavDiT(cfg.dit)
        self.code2wav_bigvgan_model = BigVGAN(
            v.mel_dim, v.upsample_initial_channel, list(v.upsample_rates),
            list(v.upsample_kernel_sizes), list(v.resblock_kernel_sizes),
            [list(d) for d in v.resblock_dilation_sizes])

    @property
    def dit(self) -> Token2WavDiT:
        return self.code2wav_dit_model

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Token2Wav:
        cfg = Token2WavConfig.from_hf(AutoConfig.from_pretrained(path))
        return load_component(lambda: cls(cfg), Path(path), "token2wav.", device,
                              dtype or torch.float32, packed_modules={})

    def vocode(self, mel: Tensor) -> Tensor:
        """(B, T, mel) -> (B, T * hop) waveform in [-1, 1]."""
        return self.code2wav_bigvgan_model(mel.transpose(1, 2))


@dataclass(frozen=True, slots=True)
class Speaker:
    """One voice of the checkpoint's speaker map (spk_dict.pt): the thinker-vocabulary id the
    talker's text side starts with, and token2wav's conditioning."""

    bos_token: int
    cond: Tensor                     # (1, enc_emb_dim)
    ref_mel: Tensor                  # (1, R, mel)


def load_speakers(path: str | Path) -> dict[str, Speaker]:
    """The checkpoint folder's spk_dict.pt, by lowercase name, in the file's order."""
    file = Path(path) / "spk_dict.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no spk_dict.pt (Qwen2.5-Omni's speaker map)")
    table = torch.load(file, weights_only=True, map_location="cpu")
    return {name.lower(): Speaker(int(s["bos_token"]), s["cond"].float().reshape(1, -1),
                                  s["ref_mel"].float().reshape(1, -1, s["ref_mel"].shape[-1]))
            for name, s in table.items()}
