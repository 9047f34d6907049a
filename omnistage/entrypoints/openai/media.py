"""Loading the media a request points at: images, audio and video from `data:` URLs, from local
files under the allowed folders, or from http(s) URLs when the server allows remote media
(audio also as OpenAI's `input_audio`: base64 data and its format).

    data:image/png;base64,....    always (the request body's size limit applies first)
    file:///srv/media/cat.png     only under --allowed-media-dirs (symlinks resolved first)
    https://example.com/cat.png   only with --allow-remote-media (on by default where the
                                  server answers as vLLM-Omni: api_server.py), public hosts
                                  only (remote_media.py)

Every failure is an `APIError` naming the request field (`param`) and saying what to change:
a 400 for a URL that is malformed, not allowed or not decodable, a 413 for one too large.
Decoding runs in the caller's thread; routes call these from the preparation pool
(prep_pool.py). Videos are sampled at VIDEO_FPS frames per second (what Qwen-Omni's processor
expects by default), or, with vLLM's `video_url.num_frames`, that many frames spread evenly
over the video; a video's audio track comes with its frames when asked (Qwen-Omni's
`use_audio_in_video`).

Nothing is decoded before its header is checked against the policy's limits, and a request's
`MediaBudget` is charged from the header first, then again as decoding goes (a header may
lie: decoding stops at the limit):

    image   width x height <= max_image_pixels; all images and sampled video frames of a
            request <= max_request_pixels
    video   each frame as an image; at most max_video_frames sampled, each charged
    audio   all parts of a request <= max_audio_seconds (the header's duration, then the
            samples decoded), a rate of MIN_SAMPLE_RATE (utils/audio.py) .. MAX_AUDIO_RATE,
            <= MAX_AUDIO_CHANNELS channels
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnistage.entrypoints.openai import remote_media
from omnistage.entrypoints.openai.errors import APIError, bad_request

VIDEO_FPS = 2.0                 # frames per second sampled from a video
MAX_AUDIO_RATE = 96_000        # chat parts: stricter than utils/audio.py's MAX_SAMPLE_RATE
MAX_AUDIO_CHANNELS = 8
# frames decoded per frame sampled at most (a 120 fps video sampled at 2 fps: 60): bounds the
# decoding work of a video whose timestamps never advance
MAX_DECODED_PER_SAMPLE = 64


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    allowed_dirs: tuple[Path, ...] = ()
    allow_remote: bool = False
    max_bytes: int = 20 << 20             # one part's file
    timeout_s: float = 10.0
    max_image_pixels: int = 1 << 25       # one image or video frame (33.5 M: 8K UHD fits)
    max_request_pixels: int = 1 << 26     # every image and sampled video frame of a request
    max_audio_seconds: float = 300.0      # every audio part of a request
    max_video_frames: int = 256           # sampled from one video
    max_media_parts: int = 16             # media parts of a request
    max_message_parts: int = 64           # content parts of one message


@dataclass(frozen=True, slots=True)
class VideoClip:
    frames: list[Image.Image]
    fps: float                              # the rate the sampled frames span
    audio: tuple[np.ndarray, int] | None    # the audio track (mono float32, rate), if asked


class MediaBudget:
    """What one request's media may still take; every part is charged from its header
    before it is decoded, and its decoded size after."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.pixels = policy.max_request_pixels
        self.seconds = policy.max_audio_seconds
        self.max_pixels, self.max_seconds = policy.max_request_pixels, policy.max_audio_seconds

    def charge_pixels(self, pixels: int, param: str) -> None:
        if pixels > self.pixels:
            raise self.too_many_pixels(param)
        self.pixels -= pixels

    def too_many_pixels(self, param: str) -> APIError:
        return bad_request(f"{param}: the request's images and video frames would have more "
                           f"than {self.max_pixels} pixels (the server's --max-request-pixels)",
                           param, "media_too_large")

    def charge_seconds(self, seconds: float, param: str) -> None:
        if seconds > self.seconds:
            raise self.too_long(param)
        self.seconds -= seconds

    def too_long(self, param: str) -> APIError:
        return bad_request(f"{param}: the request's audio would last more than "
                           f"{self.max_seconds:g} s (the server's --max-audio-seconds)",
                           param, "audio_too_long")


class MediaLoader:
    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.allowed = tuple(Path(os.path.realpath(d)) for d in policy.allowed_dirs)

    # -- bytes -----------------------------------------------------------------------------------
    def fetch(self, url: str, param: str) -> bytes:
        """The bytes behind a data:, file: or http(s): URL, within the size limit."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, param)
        if scheme == "file":
            return self._file(url, param)
        if scheme in ("http", "https"):
            return self._remote(url, param)
        raise bad_request(f"{param}: unsupported URL {_short(url)!r}; use a data: URL (base64)"
                          + (", a file: URL under the allowed media folders" if self.allowed
                             else "")
                          + (" or an http(s) URL" if self.policy.allow_remote else ""),
                          param, "invalid_media_url")

    def _too_large(self, param: str, size: int) -> APIError:
        return APIError(413, f"{param}: the media is {size} bytes, the limit is "
                             f"{self.policy.max_bytes}", param=param, code="media_too_large")

    def _data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise bad_request(f"{param}: a data URL must be data:<mime type>;base64,<data>",
                              param, "invalid_media_url")
        if len(payload) * 3 // 4 > self.policy.max_bytes:
            raise self._too_large(param, len(payload) * 3 // 4)
        return decode_b64(payload, param)

    def _file(self, url: str, param: str) -> bytes:
        if not self.allowed:
            raise bad_request(f"{param}: local files are not allowed on this server (start it "
                              "with --allowed-media-dirs to allow some)", param,
                              "media_not_allowed")
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"{param}: a file URL names no host: file:///path",
                              param, "invalid_media_url")
        name = urllib.parse.unquote(parsed.path)
        if "\x00" in name:                     # no file system takes it: not a path at all
            raise bad_request(f"{param}: a file URL's path holds a NUL character", param,
                              "invalid_media_url")
        path = Path(os.path.realpath(name))   # the messages name the path as given: never
        if not any(path.is_relative_to(d) for d in self.allowed):   # where a link leads
            raise bad_request(f"{param}: {_tail(name)} is outside the allowed media folders",
                              param, "media_not_allowed")
        if not path.is_file():
            raise bad_request(f"{param}: no such file: {_tail(name)}", param,
                              "media_not_found")
        size = path.stat().st_size
        if size > self.policy.max_bytes:
            raise self._too_large(param, size)
        return path.read_bytes()

    def _remote(self, url: str, param: str) -> bytes:
        if not self.policy.allow_remote:
            raise bad_request(f"{param}: this server fetches no http(s) URL; start it with "
                              "--allow-remote-media (public addresses only; on by default with "
                              "--api-dialect vllm-omni or --omni), or send the media as a "
                              "data: URL", param, "media_not_allowed")
        try:
            data = remote_media.fetch(url, self.policy.max_bytes, self.policy.timeout_s)
        except remote_media.FetchError as exc:
            raise bad_request(f"{param}: cannot fetch {_short(url)!r}: {exc}", param,
                              "media_fetch_failed") from None
        if len(data) > self.policy.max_bytes:
            raise self._too_large(param, len(data))
        return data

    # -- decoded media ---------------------------------------------------------------------------
    def image(self, url: str, param: str, budget: MediaBudget | None = None
              ) -> tuple[Image.Image, bytes]:
        """The decoded image (its header checked first) and its file bytes. `budget`: the
        request's (None: this part alone)."""
        budget = budget or MediaBudget(self.policy)
        data = self.fetch(url, param)
        image = open_image(data, param, self.policy.max_image_pixels)
        budget.charge_pixels(image.width * image.height, param)
        return load_image(image, param), data

    def audio(self, b64: str, fmt: str, param: str, budget: MediaBudget | None = None
              ) -> tuple[np.ndarray, int]:
        """An `input_audio` part: base64 bytes in `fmt` -> mono float32 (num_samples,), rate."""
        if len(b64) * 3 // 4 > self.policy.max_bytes:
            raise self._too_large(param, len(b64) * 3 // 4)
        return _decode_audio(decode_b64(b64, param), fmt, param,
                             budget or MediaBudget(self.policy))

    def audio_url(self, url: str, param: str, budget: MediaBudget | None = None
                  ) -> tuple[np.ndarray, int]:
        """vLLM's `audio_url` part: the file behind the URL, in any container PyAV reads
        (wav, flac, mp3, ogg, m4a, ...) -> mono float32 (num_samples,), rate."""
        return _decode_audio(self.fetch(url, param), None, param,
                             budget or MediaBudget(self.policy))

    def video(self, url: str, param: str, budget: MediaBudget | None = None,
              fps: float = VIDEO_FPS) -> tuple[list[Image.Image], float]:
        """Frames sampled at `fps` (the first frame at or after each tick), at most
        `max_video_frames` of them, and that rate; refused from the stream's header when its
        frames are too large or the frames it would yield overrun the budget."""
        clip = self.video_clip(url, param, budget, fps=fps)
        return clip.frames, clip.fps

    def video_clip(self, url: str, param: str, budget: MediaBudget | None = None, *,
                   fps: float = VIDEO_FPS, num_frames: int | None = None,
                   with_audio: bool = False) -> VideoClip:
        """A video part's frames: sampled at `fps`, or `num_frames` of them spread evenly over
        the whole video (vLLM's `video_url.num_frames`; the rate is then the one they span);
        with its audio track (mono, its own rate) when `with_audio` and the file has one."""
        import av

        budget = budget or MediaBudget(self.policy)
        most = self.policy.max_video_frames
        if num_frames is not None and not 1 <= num_frames <= most:
            raise bad_request(f"{param}: num_frames={num_frames}; from 1 to {most} (the "
                              "server's --max-input-video-frames)", param, "invalid_video")
        data = self.fetch(url, param)
        try:
            with av.open(io.BytesIO(data), "r") as container:
                if not container.streams.video:
                    raise bad_request(f"{param}: the file holds no video stream", param,
                                      "invalid_video")
                stream = container.streams.video[0]
                has_audio = bool(container.streams.audio)
                if num_frames is None:
                    self._check_video_header(stream, param, budget, fps)
                    frames = self._sample(container.decode(stream), param, budget, fps)
                else:
                    frames, fps = self._sample_evenly(data, container, stream, param, budget,
                                                      num_frames)
        except av.FFmpegError as exc:
            raise bad_request(f"{param}: not a readable video ({exc})", param,
                              "invalid_video") from exc
        if not frames:
            raise bad_request(f"{param}: the video has no frames", param, "invalid_video")
        audio = _decode_audio(data, None, param, budget) if with_audio and has_audio else None
        return VideoClip(frames, fps, audio)

    def _sample_evenly(self, data: bytes, container: Any, stream: Any, param: str,
                       budget: MediaBudget, num_frames: int) -> tuple[list[Image.Image], float]:
        """`num_frames` frames at indices floor(k * total / num_frames) (transformers' video
        processors' `sample_frames`; every frame when the video has fewer), counted from the
        packets before a frame is decoded, and the rate they span."""
        import av

        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, param, self.policy.max_image_pixels, "a video frame")
        cap = MAX_DECODED_PER_SAMPLE * self.policy.max_video_frames
        with av.open(io.BytesIO(data), "r") as counting:
            total = 0
            for packet in counting.demux(counting.streams.video[0]):
                total += packet.size > 0
                if total > cap:
                    raise bad_request(f"{param}: more than {cap} frames in the video", param,
                                      "video_too_large")
        num = min(num_frames, total)
        if num * width * height > budget.pixels:
            raise budget.too_many_pixels(param)
        wanted = {k * total // num for k in range(num)} if num else set()
        frames: list[Image.Image] = []
        for idx, frame in enumerate(container.decode(stream)):
            if idx in wanted:
                _check_pixels(frame.width, frame.height, param, self.policy.max_image_pixels,
                              "a video frame")
                budget.charge_pixels(frame.width * frame.height, param)
                frames.append(frame.to_image())
                if len(frames) == num:
                    break
        rate = stream.average_rate or stream.guessed_rate
        fps = len(frames) * float(rate) / total if rate and total else VIDEO_FPS
        return frames, fps

    def _check_video_header(self, stream: Any, param: str, budget: MediaBudget,
                            fps: float) -> None:
        """Frame size and (when the container says how long it is) the pixels of the frames
        that sampling would keep, before a frame is decoded."""
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, param, self.policy.max_image_pixels, "a video frame")
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
            sampled = min(self.policy.max_video_frames, max(1, math.ceil(seconds * fps)))
            if sampled * width * height > budget.pixels:
                raise budget.too_many_pixels(param)

    def _sample(self, decoded: Iterator[Any], param: str, budget: MediaBudget, fps: float
                ) -> list[Image.Image]:
        frames: list[Image.Image] = []
        next_t, most = 0.0, self.policy.max_video_frames
        for num_decoded, frame in enumerate(decoded, 1):
            if num_decoded > MAX_DECODED_PER_SAMPLE * most:
                raise bad_request(f"{param}: more than {MAX_DECODED_PER_SAMPLE * most} frames "
                                  "decoded without reaching the video's end", param,
                                  "video_too_large")
            t = float(frame.time) if frame.time is not None else next_t
            if t + 1e-6 < next_t:
                continue
            _check_pixels(frame.width, frame.height, param, self.policy.max_image_pixels,
                          "a video frame")
            budget.charge_pixels(frame.width * frame.height, param)
            frames.append(frame.to_image())
            next_t += 1.0 / fps
            if len(frames) == most:
                break
        return frames


def decode_b64(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{param}: not valid base64 ({exc})", param, "invalid_base64") from exc


def _decode_audio(data: bytes, fmt: str | None, param: str, budget: MediaBudget
                  ) -> tuple[np.ndarray, int]:
    """Mono float32 and rate; the header's rate, channels and duration checked first, the
    decoding stopped where the request's audio budget ends."""
    from omnistage.utils.audio import MIN_SAMPLE_RATE, AudioTooLong, decode_audio, probe_audio

    try:
        info = probe_audio(data)
    except ValueError as exc:
        raise bad_request(f"{param}: not a readable {fmt or 'audio'} file ({exc})", param,
                          "invalid_audio") from exc
    if (not MIN_SAMPLE_RATE <= info.sample_rate <= MAX_AUDIO_RATE
            or not 0 < info.channels <= MAX_AUDIO_CHANNELS):
        raise bad_request(f"{param}: {info.sample_rate} Hz, {info.channels} channels: "
                          f"{MIN_SAMPLE_RATE} to {MAX_AUDIO_RATE} Hz and at most "
                          f"{MAX_AUDIO_CHANNELS} channels", param, "invalid_audio")
    if info.seconds is not None and info.seconds > budget.seconds:
        raise budget.too_long(param)                   # refused before a sample is decoded
    try:
        wave, rate = decode_audio(data, fmt, max_seconds=budget.seconds, mono=True)
    except AudioTooLong:                               # the header said less than it holds
        raise budget.too_long(param) from None
    except ValueError as exc:
        raise bad_request(f"{param}: not a readable {fmt or 'audio'} file ({exc})", param,
                          "invalid_audio") from exc
    budget.charge_seconds(wave.shape[1] / rate, param)
    return wave[0], rate


def open_image(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """The image opened from its header (no pixel decoded): 400 for no image or one over
    `max_pixels`."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        if isinstance(exc, Image.DecompressionBombError):
            raise bad_request(f"{param}: {exc}", param, "image_too_large") from None
        raise bad_request(f"{param}: not an image in a format this server reads (PNG, JPEG, "
                          "WebP, GIF, BMP, ...)", param, "invalid_image") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise bad_request(f"{param}: not a readable image ({type(exc).__name__}: {exc})",
                          param, "invalid_image") from exc
    _check_pixels(image.width, image.height, param, max_pixels, "the image")
    return image


def load_image(image: Image.Image, param: str) -> Image.Image:
    """Decode an image `open_image` checked; RGB unless it is RGB or L already."""
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise bad_request(f"{param}: not a readable image ({type(exc).__name__}: {exc})",
                          param, "invalid_image") from exc
    return image.convert("RGB") if image.mode not in ("RGB", "L") else image


def _check_pixels(width: int, height: int, param: str, max_pixels: int, what: str) -> None:
    if width * height > max_pixels:
        raise bad_request(f"{param}: {what} is {width}x{height}, more than {max_pixels} pixels "
                          "(the server's --max-image-pixels)", param, "image_too_large")
    if width * height == 0:
        raise bad_request(f"{param}: {what} is empty ({width}x{height})", param,
                          "invalid_image")


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


def _tail(path: str) -> str:
    """A client's path as it gave it, its end kept (the file's name)."""
    return path if len(path) <= 80 else "..." + path[-77:]
