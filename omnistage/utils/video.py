"""Video files from frames and back: uint8 (F, H, W, 3) RGB frames and a frame rate in,
the bytes of an MP4, WebM, animated WebP or GIF out (`encode_video`), and the reverse
(`decode_video`, which tells the container from the file's first bytes).

    format  codec                                         loss
    mp4     H.264 (libx264) where the FFmpeg bundled      lossy, yuv420p (CRF 18)
            with `av` encodes it, else MPEG-4 Part 2
    webm    VP9 (libvpx-vp9), else VP8 (libvpx)           lossy, yuv420p
    webp    animated WebP (Pillow)                        lossless
    gif     GIF (Pillow)                                  exact for frames of <= 256 colours

`mp4_codec()` says which codec this install writes (the first that opens as an encoder).
YUV 4:2:0 halves the colour resolution, so MP4 and WebM need an even width and height. GIF
and WebP store a delay per frame (GIF in 10 ms steps), and both merge a frame into the one
before it when the two are equal (the delay adds up): meant for short clips.

A video may carry a sound track (`SoundTrack`: float32 (channels, samples) in [-1, 1] and its
rate; LTX-2 makes one): MP4 muxes it as AAC, WebM as Opus (both lossy; the encoder's rate is
the track's where the codec takes it, else the next one up); WebP and GIF have no sound and
leave it out. `decode_sound_track` reads it back.
"""

from __future__ import annotations

import functools
import io
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from omnistage.utils.audio import as_waveform, decode_audio

VideoFormat = Literal["mp4", "webm", "webp", "gif"]
FORMATS: tuple[VideoFormat, ...] = ("mp4", "webm", "webp", "gif")
MEDIA_TYPES: dict[str, str] = {"mp4": "video/mp4", "webm": "video/webm", "webp": "image/webp",
                               "gif": "image/gif"}
_MP4_CODECS = ("libx264", "h264", "libopenh264", "mpeg4")
_WEBM_CODECS = ("libvpx-vp9", "libvpx")
_AUDIO_CODECS = {"mp4": ("aac",), "webm": ("libopus", "opus")}
MAX_AUDIO_CHANNELS = 2
# per codec: the encoder options (libx264 near-transparent; libvpx in its fast realtime mode)
_OPTIONS: dict[str, dict[str, str]] = {
    "libx264": {"crf": "18", "preset": "veryfast"},
    "h264": {"crf": "18", "preset": "veryfast"},
    "mpeg4": {"qscale": "2"},
    "libvpx-vp9": {"crf": "24", "b": "0", "deadline": "realtime", "cpu-used": "8"},
    "libvpx": {"crf": "10", "b": "2M", "deadline": "realtime", "cpu-used": "8"},
}


def _first_encoder(names: tuple[str, ...]) -> str:
    import av

    for name in names:
        try:
            av.Codec(name, "w")
        except Exception:       # av raises its own error types per FFmpeg build
            continue
        return name
    raise RuntimeError(f"the FFmpeg bundled with av encodes none of {', '.join(names)}")


@functools.cache
def mp4_codec() -> str:
    """The codec MP4 files are written with here: libx264 (H.264) when the bundled FFmpeg
    has it, else the next of h264, libopenh264, mpeg4 that opens as an encoder."""
    return _first_encoder(_MP4_CODECS)


@functools.cache
def webm_codec() -> str:
    return _first_encoder(_WEBM_CODECS)


@dataclass(frozen=True, slots=True)
class SoundTrack:
    """A video's sound: float32 (channels, num_samples) (or (num_samples,): mono) in [-1, 1]
    at `sample_rate` Hz."""

    samples: np.ndarray
    sample_rate: int

    def __post_init__(self) -> None:
        if self.sample_rate <= 0:
            raise ValueError(f"sample_rate={self.sample_rate}: must be > 0")
        wave = as_waveform(self.samples)                      # (C, N), checked
        if wave.shape[0] > MAX_AUDIO_CHANNELS or not wave.shape[1]:
            raise ValueError(f"sound track: 1 or {MAX_AUDIO_CHANNELS} channels of at least "
                             f"one sample, got shape {tuple(wave.shape)}")
        object.__setattr__(self, "samples", wave)

    @property
    def seconds(self) -> float:
        return self.samples.shape[1] / self.sample_rate


def check_frames(frames: np.ndarray) -> None:
    """ValueError unless uint8 (F, H, W, 3) with F >= 1."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 \
            or not frames.shape[0]:
        raise ValueError(f"frames: expected uint8 (F, H, W, 3) with F >= 1, got "
                         f"{frames.dtype} {tuple(frames.shape)}")


def encode_video(frames: np.ndarray, fps: float, fmt: VideoFormat,
                 sound: SoundTrack | None = None) -> bytes:
    """The file of `frames` (uint8 (F, H, W, 3)) at `fps` frames a second in format `fmt`,
    with `sound` as its audio stream (MP4, WebM; WebP and GIF have none: left out)."""
    check_frames(frames)
    if not fps > 0:
        raise ValueError(f"fps={fps}: must be > 0")
    if fmt in ("mp4", "webm"):
        return _encode_av(frames, fps, fmt, sound)
    if fmt in ("webp", "gif"):
        return _encode_pil(frames, fps, fmt)
    raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")


def _encode_av(frames: np.ndarray, fps: float, fmt: VideoFormat,
               sound: SoundTrack | None) -> bytes:
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"{fmt}: width and height must be even (YUV 4:2:0), got "
                         f"{width}x{height}")
    codec = mp4_codec() if fmt == "mp4" else webm_codec()
    # a file, not memory: MP4's faststart (the index first, so that players start before the
    # whole file arrived) rewrites the file once it is written
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"video.{fmt}"
        _write_av(frames, fps, fmt, codec, path, sound)
        return path.read_bytes()


def _write_av(frames: np.ndarray, fps: float, fmt: VideoFormat, codec: str, path: Path,
              sound: SoundTrack | None) -> None:
    import av

    height, width = frames.shape[1:3]
    options = {"movflags": "+faststart"} if fmt == "mp4" else {}
    with av.open(str(path), "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001),
                                      options=_OPTIONS.get(codec, {}))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # every stream exists before the first packet (the header is written then)
        audio = None if sound is None else _sound_stream(container, sound, fmt)
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))                         # flush the encoder
        if audio is not None and sound is not None:
            for piece in audio[1](sound):
                container.mux(audio[0].encode(piece))
            container.mux(audio[0].encode(None))


def _sound_stream(container: Any, sound: SoundTrack, fmt: VideoFormat
                  ) -> tuple[Any, Callable[[SoundTrack], list[Any]]]:
    """The container's audio stream for `sound` and what turns the track into its frames:
    resampled to the encoder's sample format, frame size and (if it does not take the
    track's) the next rate up."""
    import av

    codec = _first_encoder(_AUDIO_CODECS[fmt])
    rates = av.codec.Codec(codec, "w").audio_rates or ()
    rate = sound.sample_rate if not rates or sound.sample_rate in rates else min(
        (r for r in rates if r >= sound.sample_rate), default=max(rates))
    layout = "mono" if sound.samples.shape[0] == 1 else "stereo"
    stream = container.add_stream(codec, rate=rate, layout=layout)
    ctx = stream.codec_context

    def pieces(track: SoundTrack) -> list[Any]:
        resampler = av.AudioResampler(format=ctx.format, layout=layout, rate=rate,
                                      frame_size=ctx.frame_size or None)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(track.samples),
                                           format="fltp", layout=layout)
        frame.sample_rate = track.sample_rate
        out, start = [*resampler.resample(frame), *resampler.resample(None)], 0
        for piece in out:       # timestamps from 0: the muxer then marks the encoder's
            piece.pts, piece.time_base = start, Fraction(1, rate)    # priming as skipped
            start += piece.samples
        return out

    return stream, pieces


def decode_sound_track(data: bytes) -> SoundTrack | None:
    """The sound track of an MP4 or WebM file `encode_video` wrote, None if it has none; cut
    to the stream's stated duration (the encoder pads its last frame)."""
    import av

    if sniff_format(data) not in ("mp4", "webm"):
        return None
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        stated = stream.duration * stream.time_base if stream.duration else None
    samples, rate = decode_audio(data)
    if stated is not None:
        samples = samples[:, :round(stated * rate)]
    return SoundTrack(samples, rate)


def _encode_pil(frames: np.ndarray, fps: float, fmt: VideoFormat) -> bytes:
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    duration = max(1, round(1000 / fps))                           # ms a frame
    if fmt == "webp":
        images[0].save(buf, "WEBP", save_all=True, append_images=images[1:],
                       duration=duration, loop=0, lossless=True, method=0)
    else:
        images[0].save(buf, "GIF", save_all=True, append_images=images[1:],
                       duration=duration, loop=0, optimize=False, disposal=1)
    return buf.getvalue()


def sniff_format(data: bytes) -> VideoFormat:
    """The container of a file, from its first bytes; ValueError if none of ours."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":                            # EBML: Matroska / WebM
        return "webm"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    raise ValueError("not an MP4, WebM, WebP or GIF file")


def decode_video(data: bytes) -> tuple[np.ndarray, float]:
    """(frames uint8 (F, H, W, 3), fps) of a file `encode_video` can write."""
    fmt = sniff_format(data)
    if fmt in ("mp4", "webm"):
        import av

        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
            fps = float(stream.average_rate or stream.base_rate)
        return np.stack(frames), fps
    from PIL import Image, ImageSequence

    with Image.open(io.BytesIO(data)) as im:
        frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
        duration = im.info.get("duration") or 100
    return np.stack(frames), 1000 / duration
