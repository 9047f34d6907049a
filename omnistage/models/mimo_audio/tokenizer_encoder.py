"""MiMo-Audio-Tokenizer's encoder: speech in, as upstream's `MimoAudio.preprocess_input` makes
it (XiaomiMiMo/MiMo-Audio @691ce54, src/mimo_audio/mimo_audio.py and
src/mimo_audio_tokenizer/):

    waveform at the tokenizer's rate -> |STFT| (hann, centred, reflect) -> mel (HTK, no norm)
        -> log(max(., 1e-7))                                                (frames, n_mels)
    in segments of 6000 frames, one zero-padded batch:
    conv1 (k, pad 1) GELU -> conv2 (k, stride, pad 1) GELU -> per segment: the transformer of
    the decoder's kind (rotary from 0 in each segment, window attention, encoder_skip_layer_id's
    output added before the final LayerNorm) -> avg_pooler: conv k = s = avg_pooler, GELU,
    LayerNorm (a segment's last partial group filled as upstream's unpacking fills it: its last
    row repeated to the batch's length, zeros past it)
    -> residual VQ: each codebook's nearest code (upstream's distance expression), the residual
    minus it                                                          ids (num_quantizers, T)
    the first `audio_channels` codebooks, the last frame repeated to whole patches of
    group_size frames

Parameter names are upstream MiMoAudioTokenizer's `encoder.*` (golden:
tests/golden/models/test_mimo_audio_encoder.py against scripts/mimo_audio_encoder_fixtures.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.mimo_audio.tokenizer_decoder import (_Stack, load_tokenizer_part,
                                                           tokenizer_config)

SEGMENT_FRAMES = 6000       # upstream's segment_size


def mel_filters(c: dict) -> Tensor:
    """(n_fft // 2 + 1, n_mels) triangular HTK-mel filters, unnormalised (torchaudio's
    MelSpectrogram defaults), from transformers' audio_utils."""
    from transformers.audio_utils import mel_filter_bank

    sr = c["sampling_rate"]
    return torch.from_numpy(mel_filter_bank(
        num_frequency_bins=c["nfft"] // 2 + 1, num_mel_filters=c["n_mels"],
        min_frequency=float(c.get("fmin") or 0), max_frequency=float(c.get("fmax") or sr // 2),
        sampling_rate=sr, norm=None, mel_scale="htk")).float()


def segment_lengths(frames: int) -> list[int]:
    """Upstream's segments of a waveform's mel frames: 6000 each, the rest last."""
    out = [SEGMENT_FRAMES] * (frames // SEGMENT_FRAMES)
    return out + [frames % SEGMENT_FRAMES] if frames % SEGMENT_FRAMES else out


def conv_rows(frames: int, c: dict) -> int:
    """Rows conv2 gives a segment of `frames` mel frames (upstream's get_output_length)."""
    k = c["kernel_size"]
    return (frames + 3 - k + 2 - k) // c["stride_size"] + 1


def num_speech_frames(samples: int, c: dict) -> int:
    """The audio ids (frames of `num_quantizers` ids) a waveform of `samples` gives, before
    the padding to whole patches: known from the length alone, so the front door can lay out
    a prompt before any encoder runs."""
    pool = c.get("avg_pooler", 1)
    return sum(-(-conv_rows(n, c) // pool)
               for n in segment_lengths(samples // c["hop_length"] + 1))   # centred STFT


class MiMoAudioTokenizerEncoder(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        d, k, pool = c["d_model"], c["kernel_size"], c.get("avg_pooler", 1)
        self.cfg = c
        self.conv1 = nn.Conv1d(c["n_mels"], d, k, padding=1)
        self.conv2 = nn.Conv1d(d, d, k, stride=c["stride_size"], padding=1)
        self.stack = _Stack(d, c["encoder_attention_heads"], c["encoder_ffn_dim"],
                            c["encoder_layers"], c.get("encoder_attn_window_size") or [-1, -1],
                            c.get("encoder_causal", False), c["rope_theta"],
                            c.get("encoder_skip_layer_id"))
        self.pool = pool
        self.down = nn.Conv1d(d, d, pool, pool, bias=False) if pool != 1 else None
        self.down_norm = nn.LayerNorm(d) if pool != 1 else None
        self.codebooks = nn.ParameterList(nn.Parameter(torch.empty(n, d), requires_grad=False)
                                          for n in c["codebook_size"][: c["num_quantizers"]])
        self.register_buffer("filters", mel_filters(c), persistent=False)
        self.register_buffer("window", torch.hann_window(c["window_size"]), persistent=False)
        self.sample_rate = c["sampling_rate"]

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu"
                        ) -> MiMoAudioTokenizerEncoder:
        cfg = tokenizer_config(path)
        for key, ok in (("ln_type", "LayerNorm"), ("rope_type", "default"),
                        ("activation_function", "gelu")):
            if cfg.get(key, ok) != ok:
                raise NotImplementedError(f"MiMo-Audio tokenizer: {key}={cfg[key]!r} (only "
                                          f"{ok!r} is ported)")
        return load_tokenizer_part(cls(cfg), path, device, cls._source_name)

    @staticmethod
    def _source_name(name: str) -> str:
        if name.startswith("codebooks."):
            return f"encoder.quantizer.vq.layers.{name.split('.')[1]}._codebook.embed"
        name = name.replace("stack.layer_norm", "layer_norm").replace("stack.layers", "layers")
        name = name.replace("down.", "down_sample_layer.0.").replace("down_norm.",
                                                                       "down_sample_norm.")
        return "encoder." + name

    def log_mel(self, wav: Tensor) -> Tensor:
        """(samples,) at `sample_rate` -> (frames, n_mels) float32."""
        c = self.cfg
        spec = torch.stft(wav.float(), c["nfft"], c["hop_length"], c["window_size"],
                          self.window, center=True, pad_mode="reflect",
                          return_complex=True).abs()                        # (freq, frames)
        return (spec.T @ self.filters).clamp(min=1e-7).log()

    @torch.no_grad()
    def encode(self, mel: Tensor) -> Tensor:
        """mel (frames, n_mels) -> ids (num_quantizers, T): its segments in one batch."""
        lengths = segment_lengths(mel.shape[0])
        x = torch.zeros(len(lengths), max(lengths), mel.shape[1], device=mel.device)
        for b, seg in enumerate(mel.split(lengths)):
            x[b, :seg.shape[0]] = seg
        h = F.gelu(self.conv2(F.gelu(self.conv1(x.transpose(1, 2))))).transpose(1, 2)
        rows = self.transform([h[b, :conv_rows(n, self.cfg)] for b, n in enumerate(lengths)])
        if self.down is not None:
            rows = self._pool(rows, h.shape[1])
        return torch.cat([self.quantize(r) for r in rows], dim=1)

    def transform(self, rows: list[Tensor]) -> list[Tensor]:
        """The transformer over each segment alone (its own attention, rotary from 0)."""
        return [self.stack.run(r) for r in rows]

    def _pool(self, rows: list[Tensor], width: int) -> list[Tensor]:
        padded = torch.stack([torch.cat([r, r[-1:].expand(width - r.shape[0], -1)])
                              for r in rows])
        padded = F.pad(padded, (0, 0, 0, (-width) % self.pool))
        y = F.gelu(self.down(padded.transpose(1, 2))).transpose(1, 2)
        groups = [(r.shape[0] + self.pool - 1) // self.pool for r in rows]
        return [self.down_norm(y[b, :n]) for b, n in enumerate(groups)]

    def quantize(self, x: Tensor) -> Tensor:
        """(n, d) -> ids (num_quantizers, n), float32, nearest code of each residual."""
        residual, out = x.float(), []
        for book in self.codebooks:
            e = book.float().t()
            dist = -(residual.pow(2).sum(1, keepdim=True) - 2 * residual @ e
                     + e.pow(2).sum(0, keepdim=True))
            ids = dist.max(dim=-1).indices
            residual = residual - book.float()[ids]
            out.append(ids)
        return torch.stack(out)

    def speech_ids(self, wav: Tensor, channels: int, group_size: int) -> Tensor:
        """A waveform at `sample_rate` -> (T, channels) ids, T a multiple of group_size (the
        last frame repeated), as upstream's preprocess_input returns them (flattened there)."""
        ids = self.encode(self.log_mel(wav))[:channels].T
        pad = (-ids.shape[0]) % group_size
        return torch.cat([ids, ids[-1:].expand(pad, -1)]) if pad else ids
