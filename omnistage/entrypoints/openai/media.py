"""Loading the media a request points at: images, audio and video from `data:` URLs, from local
files under the allowed folders, or from http(s) URLs when the server allows remote media
(audio also as OpenAI's `input_audio`: base64 data and its format).

    data:image/png;base64,....    always (the request body's size limit applies first)
    file:///srv/media/cat.png     only under --allowed-media-dirs (symlinks resolved first)
    https://example.com/cat.png   only with --allow-remote-media

Every failure is an `APIError` naming the request field (`param`) and saying what to change:
a 400 for a URL that is malformed, not allowed or not decodable, a 413 for one too large.
Decoding runs in the caller's thread; routes call these from a worker thread. Videos are
sampled at VIDEO_FPS frames per second (what Qwen-Omni's processor expects by default).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnistage.entrypoints.openai.errors import APIError, bad_request

MAX_PIXELS = 8192 * 8192
MAX_VIDEO_FRAMES = 256
VIDEO_FPS = 2.0                 # frames per second sampled from a video


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    allowed_dirs: tuple[Path, ...] = ()
    allow_remote: bool = False
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0


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
        path = Path(os.path.realpath(name))
        if not any(path.is_relative_to(d) for d in self.allowed):
            raise bad_request(f"{param}: {path} is outside the allowed media folders",
                              param, "media_not_allowed")
        if not path.is_file():
            raise bad_request(f"{param}: no such file: {path}", param, "media_not_found")
        size = path.stat().st_size
        if size > self.policy.max_bytes:
            raise self._too_large(param, size)
        return path.read_bytes()

    def _remote(self, url: str, param: str) -> bytes:
        if not self.policy.allow_remote:
            raise bad_request(f"{param}: remote URLs are not allowed on this server (send the "
                              "media as a data: URL, or start the server with --allow-remote-media)",
                              param, "media_not_allowed")
        req = urllib.request.Request(url, headers={"User-Agent": "omnistage"})
        try:
            with urllib.request.urlopen(req, timeout=self.policy.timeout_s) as resp:
                data = resp.read(self.policy.max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise bad_request(f"{param}: cannot fetch {_short(url)!r}: {exc}", param,
                              "media_fetch_failed") from exc
        if len(data) > self.policy.max_bytes:
            raise self._too_large(param, len(data))
        return data

    # -- decoded media ---------------------------------------------------------------------------
    def image(self, url: str, param: str) -> tuple[Image.Image, bytes]:
        """The decoded image (checked) and its file bytes."""
        data = self.fetch(url, param)
        return decode_image(data, param), data

    def audio(self, b64: str, fmt: str, param: str) -> tuple[np.ndarray, int]:
        """An `input_audio` part: base64 bytes in `fmt` -> mono float32 (num_samples,), rate."""
        if len(b64) * 3 // 4 > self.policy.max_bytes:
            raise self._too_large(param, len(b64) * 3 // 4)
        return _decode_audio(decode_b64(b64, param), fmt, param)

    def audio_url(self, url: str, param: str) -> tuple[np.ndarray, int]:
        """vLLM's `audio_url` part: the file behind the URL, in any container PyAV reads
        (wav, flac, mp3, ogg, m4a, ...) -> mono float32 (num_samples,), rate."""
        return _decode_audio(self.fetch(url, param), None, param)

    def video(self, url: str, param: str, fps: float = VIDEO_FPS
              ) -> tuple[list[Image.Image], float]:
        """Frames sampled at `fps` (the first frame at or after each tick), at most
        MAX_VIDEO_FRAMES of them, and that rate."""
        import av

        data = self.fetch(url, param)
        frames: list[Image.Image] = []
        try:
            with av.open(io.BytesIO(data), "r") as container:
                if not container.streams.video:
                    raise bad_request(f"{param}: the file holds no video stream", param,
                                      "invalid_video")
                next_t = 0.0
                for frame in container.decode(container.streams.video[0]):
                    t = float(frame.time) if frame.time is not None else next_t
                    if t + 1e-6 < next_t:
                        continue
                    frames.append(frame.to_image())
                    next_t += 1.0 / fps
                    if len(frames) == MAX_VIDEO_FRAMES:
                        break
        except av.FFmpegError as exc:
            raise bad_request(f"{param}: not a readable video ({exc})", param,
                              "invalid_video") from exc
        if not frames:
            raise bad_request(f"{param}: the video has no frames", param, "invalid_video")
        return frames, fps


def decode_b64(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{param}: not valid base64 ({exc})", param, "invalid_base64") from exc


def _decode_audio(data: bytes, fmt: str | None, param: str) -> tuple[np.ndarray, int]:
    from omnistage.utils.audio import decode_audio

    try:
        wave, rate = decode_audio(data, fmt)
    except ValueError as exc:
        raise bad_request(f"{param}: not a readable {fmt or 'audio'} file ({exc})", param,
                          "invalid_audio") from exc
    return wave.mean(axis=0), rate


def decode_image(data: bytes, param: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            raise bad_request(f"{param}: the image is {image.width}x{image.height}, more than "
                              f"{MAX_PIXELS} pixels", param, "image_too_large")
        image.load()
    except UnidentifiedImageError:
        raise bad_request(f"{param}: not an image in a format this server reads (PNG, JPEG, "
                          "WebP, GIF, BMP, ...)", param, "invalid_image") from None
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise bad_request(f"{param}: not a readable image ({type(exc).__name__}: {exc})",
                          param, "invalid_image") from exc
    return image.convert("RGB") if image.mode not in ("RGB", "L") else image


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
