"""Audio encoding for the API: a float waveform plus its sample rate to wav, pcm16, flac, mp3
or opus bytes, and decoding back (the API's audio inputs, and the tests' round trips).

A waveform is float in [-1, 1], shaped (num_samples,) for mono or (channels, num_samples).
wav and flac are 16-bit PCM written by soundfile; pcm16 is the raw little-endian samples with
no header (what OpenAI streams); mp3 (libmp3lame), opus (libopus in an Ogg container) and aac
(ADTS) are encoded by PyAV, resampled first when the codec does not take the rate as is (opus:
8, 12, 16, 24 or 48 kHz). `AudioEncoder` writes any of them chunk by chunk, as speech is made.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

FORMATS = ("wav", "pcm16", "flac", "mp3", "opus", "aac")
MIME = {"wav": "audio/wav", "pcm16": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
        "opus": "audio/ogg", "aac": "audio/aac"}
# format -> (container, codec) written by PyAV (wav and flac too, when streamed)
_AV = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "aac": ("adts", "aac"),
       "wav": ("wav", "pcm_s16le"), "flac": ("flac", "flac")}


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
    enc = AudioEncoder(fmt, sample_rate, streamed=False)
    return enc.encode(w) + enc.close()


def encode_audio_b64(wave: np.ndarray | Tensor, sample_rate: int, fmt: str = "wav") -> str:
    return base64.b64encode(encode_audio(wave, sample_rate, fmt)).decode("ascii")


class AudioEncoder:
    """Encodes a waveform chunk by chunk, as it is made: each `encode` returns the bytes the
    file gained (possibly none: codecs and Ogg pages buffer), `close` the rest. The pieces
    joined are one valid file. The muxer writes to a sink it cannot seek, so it never goes
    back to patch a header: a streamed wav says "length unknown", which players and decoders
    read to the end; flac leaves its total unset.

        enc = AudioEncoder("mp3", 24000)
        for chunk in chunks: send(enc.encode(chunk))
        send(enc.close())
    """

    def __init__(self, fmt: str, sample_rate: int, streamed: bool = True) -> None:
        """`streamed=False`: everything comes at `close`, written seekably, so that the muxer
        patches its header (mp3's gapless info: the decoded length is exact)."""
        if fmt not in FORMATS:
            raise ValueError(f"audio format {fmt!r}: choose one of {', '.join(FORMATS)}")
        if sample_rate <= 0:
            raise ValueError(f"sample_rate={sample_rate}: must be > 0")
        self.fmt, self.sample_rate = fmt, sample_rate
        self._whole = None if streamed else io.BytesIO()
        self._pieces: list[bytes] = []
        self._out = self._stream = self._resampler = None
        self._layout = "mono"

    def write(self, data: bytes) -> int:        # the muxer's sink
        self._pieces.append(bytes(data))
        return len(data)

    def seekable(self) -> bool:
        return False

    def encode(self, wave: np.ndarray | Tensor) -> bytes:
        w = as_waveform(wave)                                    # (C, N)
        if self.fmt == "pcm16":
            return to_pcm16(w)
        if self._out is None:
            self._open(w.shape[0])
        import av

        frame = av.AudioFrame.from_ndarray((w * 32767.0).round().astype(np.int16)
                                           .T.reshape(1, -1), format="s16", layout=self._layout)
        frame.sample_rate = self.sample_rate
        self._mux(self._resampler.resample(frame))
        return self._take()

    def close(self) -> bytes:
        if self.fmt == "pcm16":
            return b""
        if self._out is None:
            self._open(1)                      # no audio at all: still a valid (empty) file
        self._mux(self._resampler.resample(None))
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        return self._take() if self._whole is None else self._whole.getvalue()

    def _open(self, channels: int) -> None:
        """The container and encoder; the resampler does rate, sample format and frame size
        for the codec (opus takes 8, 12, 16, 24 or 48 kHz: the next rate up)."""
        import av

        if channels > 2:
            raise ValueError(f"{self.fmt}: at most 2 channels, got {channels}")
        container_name, codec_name = _AV[self.fmt]
        rates = av.codec.Codec(codec_name, "w").audio_rates or ()
        rate = self.sample_rate if not rates or self.sample_rate in rates else (
            min((r for r in rates if r >= self.sample_rate), default=max(rates)))
        self._layout = "mono" if channels == 1 else "stereo"
        self._out = av.open(self if self._whole is None else self._whole, "w",
                            format=container_name)
        self._stream = self._out.add_stream(codec_name, rate=rate, layout=self._layout)
        ctx = self._stream.codec_context
        self._resampler = av.AudioResampler(format=ctx.format, layout=self._layout, rate=rate,
                                            frame_size=ctx.frame_size or None)

    def _mux(self, frames: list) -> None:
        for piece in frames:
            for packet in self._stream.encode(piece):
                self._out.mux(packet)

    def _take(self) -> bytes:
        data, self._pieces = b"".join(self._pieces), []
        return data


class AudioTooLong(ValueError):
    """More audio than `decode_audio`'s max_seconds."""


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """What an audio file's header says, read without decoding a sample."""
    seconds: float | None          # None: the container does not say (a streamed wav, ...)
    sample_rate: int
    channels: int


def probe_audio(data: bytes) -> AudioInfo:
    """The header of bytes of any container PyAV reads; ValueError if it is no audio file."""
    import av

    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.audio:
                raise ValueError("the data holds no audio stream")
            stream = container.streams.audio[0]
            seconds = None
            if stream.duration is not None and stream.time_base is not None:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                seconds = container.duration / 1e6            # av.time_base: microseconds
            return AudioInfo(seconds, stream.codec_context.sample_rate,
                             stream.codec_context.channels)
    except av.FFmpegError as exc:
        raise ValueError(f"cannot read the audio header: {exc}") from exc


def decode_audio(data: bytes, fmt: str | None = None, sample_rate: int | None = None,
                 max_seconds: float | None = None, mono: bool = False
                 ) -> tuple[np.ndarray, int]:
    """Bytes of any container PyAV reads (wav, flac, mp3, ogg/opus, ...) -> float32
    (channels, num_samples) and the rate. Raw pcm16 needs `fmt="pcm16"` and its rate (mono).
    `max_seconds`: ValueError as soon as more is decoded (whatever the header claimed), so
    memory stays within max_seconds x rate x channels x 4 bytes; `mono`: channels averaged
    frame by frame, (1, num_samples)."""
    if fmt == "pcm16":
        if sample_rate is None:
            raise ValueError("pcm16 has no header: its sample rate must be given")
        samples = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2")
        if max_seconds is not None and len(samples) > max_seconds * sample_rate:
            raise AudioTooLong(f"the audio is longer than {max_seconds:g} s")
        return (samples.astype(np.float32) / 32767.0)[None, :], sample_rate
    import av

    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.audio:
                raise ValueError("the data holds no audio stream")
            stream = container.streams.audio[0]
            ctx = stream.codec_context
            rate, channels = ctx.sample_rate, ctx.channels
            limit = None if max_seconds is None else max_seconds * rate
            pieces, num_samples = [], 0
            for frame in container.decode(stream):
                piece = _as_float(frame.to_ndarray(), ctx.format.is_planar,
                                  ctx.format.name, channels)            # (C, n)
                pieces.append(piece.mean(axis=0, keepdims=True) if mono else piece)
                num_samples += piece.shape[1]
                if limit is not None and num_samples > limit:
                    raise AudioTooLong(f"the audio is longer than {max_seconds:g} s")
    except av.FFmpegError as exc:
        raise ValueError(f"cannot decode the audio: {exc}") from exc
    if not pieces:
        raise ValueError("the audio holds no samples")
    return np.concatenate(pieces, axis=1).astype(np.float32, copy=False), rate


def _as_float(piece: np.ndarray, planar: bool, kind: str, channels: int) -> np.ndarray:
    """One decoded frame -> float32 (C, n): planar frames are (C, n), packed ones (1, n * C),
    interleaved; integer samples scaled to [-1, 1]."""
    wave = piece if planar else piece.reshape(-1, channels).T
    if kind.startswith("s16"):
        return wave.astype(np.float32) / 32768.0
    if kind.startswith("s32"):
        return wave.astype(np.float32) / 2147483648.0
    return wave.astype(np.float32, copy=False)


# the sample rates audio may have anywhere it enters (chat parts, realtime, voices, offline
# inputs): below 1 kHz nothing is speech, above 384 kHz no converter records
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 384_000
# the polyphase filter bank (one filter per output phase) is built when it has at most this many
# taps; beyond it, rates sharing few factors (8001 -> 24000 Hz: 8000 phases of 2681 taps) are
# resampled by evaluating the same filter at each output sample
MAX_BANK_TAPS = 1 << 18
BLOCK_TAPS = 1 << 18          # weights evaluated at once by the direct path (2 MiB of float64)


def check_sample_rate(rate: int, what: str = "sample rate") -> int:
    """`rate` if MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE, else ValueError naming `what`."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what}: {rate} Hz is outside {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz")
    return rate


def resample(waveform: np.ndarray, orig_sr: int, target_sr: int, zero_crossings: int = 6,
             rolloff: float = 0.99) -> np.ndarray:
    """Band-limited resampling of a 1-D waveform (our windowed sinc: Hann window, 6 zero
    crossings, 0.99 roll-off, torchaudio's defaults): a Hann-windowed sinc low-pass at
    rolloff * min(orig_sr, target_sr) / 2. Output length ceil(len * target / orig).

    Rates with a small filter bank (16000 -> 24000, 44100 -> 16000, ...) use the bank with a
    strided conv; any other pair (coprime ones: 7919 -> 24000) evaluates the same filter at each
    output sample, in blocks. Either way memory and time grow with the audio's length times
    the filter's (12 / rolloff input samples, or as many output samples when downsampling),
    whatever the rates; both rates must be within MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE."""
    check_sample_rate(orig_sr, "the input's sample rate")
    check_sample_rate(target_sr, "the target sample rate")
    if orig_sr == target_sr:
        return waveform.astype(np.float32, copy=False)
    g = math.gcd(orig_sr, target_sr)
    up, down = target_sr // g, orig_sr // g        # every `down` inputs make `up` outputs
    cutoff = min(up, down) * rolloff               # in units of the reduced input rate
    half_width = math.ceil(zero_crossings * down / cutoff)   # filter half-length, input samples
    if up * (2 * half_width + down) <= MAX_BANK_TAPS:
        return _resample_bank(waveform, up, down, half_width, zero_crossings, cutoff)
    return _resample_direct(waveform, up, down, half_width, zero_crossings, cutoff / down)


def _windowed_sinc(t: Tensor | np.ndarray, zero_crossings: int) -> Tensor | np.ndarray:
    """The filter at `t` (in zero crossings of the cut-off): sinc(t) x a Hann window of
    2 x zero_crossings, zero outside it."""
    lib = torch if isinstance(t, Tensor) else np
    t = lib.clip(t, -zero_crossings, zero_crossings)
    window = lib.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    safe = lib.where(t == 0, 1.0, t)
    return lib.where(t == 0, 1.0, lib.sin(safe) / safe) * window


def _resample_bank(waveform: np.ndarray, up: int, down: int, half_width: int,
                   zero_crossings: int, cutoff: float) -> np.ndarray:
    """A polyphase filter bank (one filter per output phase, up x (2 half_width + down) taps),
    applied with a strided conv."""
    # phase p (output sample p of each block) sits at input offset p * down / up
    taps = torch.arange(-half_width, half_width + down, dtype=torch.float64) / down
    t = (taps[None, :] - torch.arange(up, dtype=torch.float64)[:, None] / up) * cutoff
    kernels = (_windowed_sinc(t, zero_crossings) * cutoff / down).float()   # (up, taps)

    x = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))
    x = F.pad(x[None, None], (half_width, half_width + down))   # (1, 1, n + pad)
    y = F.conv1d(x, kernels[:, None, :], stride=down)            # (1, up, blocks)
    y = y[0].T.reshape(-1)                                       # interleave the phases
    return y[: math.ceil(up * waveform.shape[0] / down)].numpy()


def _resample_direct(waveform: np.ndarray, up: int, down: int, half_width: int,
                     zero_crossings: int, cutoff: float) -> np.ndarray:
    """The same filter evaluated at each output sample: output j sits at input position
    j * down / up = base + frac and takes inputs base - half_width .. base + half_width + 1,
    at t = (k - frac) x cutoff for offsets k (`cutoff` per input sample). Blocks of outputs
    keep the weights at BLOCK_TAPS values whatever the rates.

    No sine per tap: sin(pi t) and the window's cos(pi t / zero_crossings) are expanded by
    angle addition into a table over k (once) times one over frac (per output)."""
    x = np.ascontiguousarray(waveform, dtype=np.float32)
    num_out = math.ceil(up * x.shape[0] / down)
    k = np.arange(-half_width, half_width + 2)                           # (K,)
    a, b = math.pi * cutoff, math.pi * cutoff / zero_crossings
    sin_ak, cos_ak, sin_bk, cos_bk = np.sin(a * k), np.cos(a * k), np.sin(b * k), np.cos(b * k)
    x = np.pad(x, (half_width, half_width + 2))                # index m + half_width: input m
    out = np.empty(num_out, dtype=np.float32)
    block = max(1, BLOCK_TAPS // len(k))
    for start in range(0, num_out, block):
        j = np.arange(start, min(start + block, num_out), dtype=np.int64)
        base, rem = np.divmod(j * down, up)                              # (B,)
        frac = (rem / up)[:, None]                                       # (B, 1)
        pi_t = (k - frac) * a                                            # (B, K)
        sin_pi_t = sin_ak * np.cos(a * frac) - cos_ak * np.sin(a * frac)
        window = 0.5 + 0.5 * (cos_bk * np.cos(b * frac) + sin_bk * np.sin(b * frac))
        sinc = np.divide(sin_pi_t, pi_t, out=np.ones_like(pi_t), where=pi_t != 0)
        weights = np.where(np.abs(pi_t) < math.pi * zero_crossings, sinc * window * cutoff, 0.0)
        taps = x[base[:, None] + k + half_width]                         # (B, K)
        out[start: start + len(j)] = np.einsum("bk,bk->b", weights, taps)
    return out
