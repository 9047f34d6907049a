"""Audio encoding for the API: a float waveform plus its sample rate to wav, pcm16, flac, mp3
or opus bytes, and decoding back (the API's audio inputs, and the tests' round trips).

A waveform is float in [-1, 1], shaped (num_samples,) for mono or (channels, num_samples).
wav and flac are 16-bit PCM written by soundfile; pcm16 is the raw little-endian samples with
no header (what OpenAI streams); mp3 (libmp3lame) and opus (libopus in an Ogg container) are
encoded by PyAV, resampled first when the codec does not take the rate as is (opus: 8, 12, 16,
24 or 48 kHz).
"""

from __future__ import annotations

import base64
import io

import numpy as np
from torch import Tensor

FORMATS = ("wav", "pcm16", "flac", "mp3", "opus")
MIME = {"wav": "audio/wav", "pcm16": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
        "opus": "audio/ogg"}
_AV = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus")}


def as_waveform(wave: np.ndarray | Tensor) -> np.ndarray:
    """float32 (channels, num_samples), clipped to [-1, 1]."""
    if isinstance(wave, Tensor):
        wave = wave.detach().float().cpu().numpy()
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim == 1:
        wave = wave[None, :]
    if wave.ndim != 2 or wave.shape[0] > 8:
        raise ValueError(f"a waveform is (num_samples,) or (channels, num_samples), got shape "
                         f"{wave.shape}")
    return np.clip(np.nan_to_num(wave), -1.0, 1.0)


def to_pcm16(wave: np.ndarray | Tensor) -> bytes:
    """Raw 16-bit little-endian PCM, channels interleaved."""
    w = as_waveform(wave)                                       # (C, N)
    return (w.T * 32767.0).round().astype("<i2").tobytes()     # (N, C) interleaved


def encode_audio(wave: np.ndarray | Tensor, sample_rate: int, fmt: str = "wav") -> bytes:
    if fmt not in FORMATS:
        raise ValueError(f"audio format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate={sample_rate}: must be > 0")
    if fmt == "pcm16":
        return to_pcm16(wave)
    w = as_waveform(wave)
    if fmt in ("wav", "flac"):
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, w.T, sample_rate, format=fmt.upper(), subtype="PCM_16")
        return buf.getvalue()
    return _encode_av(w, sample_rate, fmt)


def encode_audio_b64(wave: np.ndarray | Tensor, sample_rate: int, fmt: str = "wav") -> str:
    return base64.b64encode(encode_audio(wave, sample_rate, fmt)).decode("ascii")


def _encode_av(w: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    import av

    container_name, codec_name = _AV[fmt]
    codec = av.codec.Codec(codec_name, "w")
    rates = codec.audio_rates or ()
    rate = sample_rate if not rates or sample_rate in rates else (
        min((r for r in rates if r >= sample_rate), default=max(rates)))
    layout = "mono" if w.shape[0] == 1 else "stereo"
    if w.shape[0] > 2:
        raise ValueError(f"{fmt}: at most 2 channels, got {w.shape[0]}")
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_name) as out:
        stream = out.add_stream(codec_name, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray((w * 32767.0).round().astype(np.int16)
                                           .T.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate = sample_rate
        # one resampler does rate, sample format and frame size for the encoder
        resampler = av.AudioResampler(format=stream.codec_context.format, layout=layout,
                                      rate=rate, frame_size=stream.codec_context.frame_size or None)
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(piece):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def decode_audio(data: bytes, fmt: str | None = None, sample_rate: int | None = None
                 ) -> tuple[np.ndarray, int]:
    """Bytes of any container PyAV reads (wav, flac, mp3, ogg/opus, ...) -> float32
    (channels, num_samples) and the rate. Raw pcm16 needs `fmt="pcm16"` and its rate (mono)."""
    if fmt == "pcm16":
        if sample_rate is None:
            raise ValueError("pcm16 has no header: its sample rate must be given")
        samples = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2")
        return (samples.astype(np.float32) / 32767.0)[None, :], sample_rate
    import av

    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.audio:
                raise ValueError("the data holds no audio stream")
            stream = container.streams.audio[0]
            pieces = [f.to_ndarray() for f in container.decode(stream)]
            rate = stream.codec_context.sample_rate
            channels = stream.codec_context.channels
            planar = stream.codec_context.format.is_planar
            kind = stream.codec_context.format.name
    except av.FFmpegError as exc:
        raise ValueError(f"cannot decode the audio: {exc}") from exc
    if not pieces:
        raise ValueError("the audio holds no samples")
    # planar frames are (C, n); packed frames (1, n * C), interleaved
    wave = np.concatenate([p if planar else p.reshape(-1, channels).T for p in pieces], axis=1)
    if kind.startswith("s16"):
        wave = wave.astype(np.float32) / 32768.0
    elif kind.startswith("s32"):
        wave = wave.astype(np.float32) / 2147483648.0
    return wave.astype(np.float32), rate
