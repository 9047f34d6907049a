"""Media loading for chat parts: data URLs, files under the allowed folders only (symlinks
resolved), remote URLs only when allowed and only to public addresses, size limits, and
decoding of images, audio and video with errors that name the request field."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from PIL import Image

from omnistage.entrypoints.openai import remote_media
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.media import MediaLoader, MediaPolicy
from omnistage.utils.audio import encode_audio


def png(size: tuple[int, int] = (12, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def mp4(num_frames: int = 20, fps: int = 10) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((16, 32, 3), 10 * i, np.uint8),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def refused(fn, *args: object) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args)
    assert err.value.param == "p" and err.value.message.startswith("p: ")
    return err.value


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(png())
    (outside / "secret.png").write_bytes(png())
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    return allowed, outside


def test_data_urls_decode_and_are_checked() -> None:
    loader = MediaLoader(MediaPolicy(max_bytes=1000))
    image, raw = loader.image(data_url(png()), "p")
    assert image.size == (12, 8) and raw == png()
    assert refused(loader.fetch, "data:image/png,notbase64", "p").code == "invalid_media_url"
    assert refused(loader.fetch, "data:image/png;base64,@@@", "p").code == "invalid_base64"
    assert refused(loader.image, data_url(b"not an image"), "p").code == "invalid_image"
    too_big = refused(loader.fetch, data_url(bytes(2000)), "p")
    assert too_big.status == 413 and too_big.code == "media_too_large"
    assert refused(loader.fetch, "ftp://host/x.png", "p").code == "invalid_media_url"


def test_files_only_under_allowed_folders(folders: tuple[Path, Path]) -> None:
    allowed, outside = folders
    assert refused(MediaLoader(MediaPolicy()).fetch, f"file://{allowed}/cat.png",
                   "p").code == "media_not_allowed"
    loader = MediaLoader(MediaPolicy(allowed_dirs=(allowed,)))
    assert loader.fetch(f"file://{allowed}/cat.png", "p") == png()
    for url in (f"file://{outside}/secret.png", f"file://{allowed}/../outside/secret.png",
                f"file://{allowed}/escape.png"):             # a symlink out is still out
        assert refused(loader.fetch, url, "p").code == "media_not_allowed", url
    message = refused(loader.fetch, f"file://{allowed}/escape.png", "p").message
    assert "escape.png" in message and "secret" not in message    # not where a link leads
    assert refused(loader.fetch, f"file://{allowed}/none.png", "p").code == "media_not_found"
    small = MediaLoader(MediaPolicy(allowed_dirs=(allowed,), max_bytes=10))
    assert refused(small.fetch, f"file://{allowed}/cat.png", "p").status == 413


def test_a_nul_in_a_file_path_is_a_bad_url(folders: tuple[Path, Path]) -> None:
    """No file system takes a NUL: a 400 naming the part, not the OSError's 500."""
    loader = MediaLoader(MediaPolicy(allowed_dirs=(folders[0],)))
    for url in (f"file://{folders[0]}/cat.png\x00.txt", f"file://{folders[0]}/cat%00.png"):
        err = refused(loader.fetch, url, "p")
        assert (err.status, err.code, err.param) == (400, "invalid_media_url", "p"), url


@pytest.fixture
def http_server(folders: tuple[Path, Path]) -> Iterator[str]:
    """A local file server; /to/URL answers 302 to URL."""
    allowed, _ = folders

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, directory=str(allowed), **kw)

        def do_GET(self) -> None:
            if self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path[len("/to/"):])
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


PUBLIC_IP = "93.184.215.14"         # a public address; the fake network below takes it home


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch, http_server: str) -> tuple[str, list[str]]:
    """Names that resolve as an attacker would make them, and connections to PUBLIC_IP that
    land on the local file server (to 1.1.1.1: a timeout); the file server's URL under a
    public name, and the addresses connected to."""
    port = int(http_server.rsplit(":", 1)[1])
    names = {"media.example": [PUBLIC_IP], "rebind.example": [PUBLIC_IP, "127.0.0.1"],
             "metadata.example": ["169.254.169.254"], "mapped.example": ["::ffff:10.0.0.1"],
             "quiet.example": ["1.1.1.1"]}
    real_resolve, connected = socket.getaddrinfo, []

    def resolve(host: str, port: int, *args: object, **kw: object) -> list:
        if host in names:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in names[host]]
        if host.endswith(".example"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real_resolve(host, port, *args, **kw)

    def connect(address: tuple[str, int], timeout: float, *args: object) -> socket.socket:
        connected.append(address[0])
        if address[0] == "1.1.1.1":
            raise TimeoutError("timed out")
        assert address[0] == PUBLIC_IP, address     # only a checked address is connected to
        return socket.create_connection(("127.0.0.1", address[1]), timeout)

    monkeypatch.setattr(remote_media.socket, "getaddrinfo", resolve)
    monkeypatch.setattr(remote_media, "connect", connect)
    return f"http://media.example:{port}", connected


def test_remote_urls_only_when_allowed(fake_dns: tuple[str, list[str]]) -> None:
    public, connected = fake_dns
    url = f"{public}/cat.png"
    err = refused(MediaLoader(MediaPolicy()).fetch, url, "p")
    assert err.code == "media_not_allowed" and "--allow-remote-media" in err.message
    loader = MediaLoader(MediaPolicy(allow_remote=True, timeout_s=5))
    assert loader.fetch(url, "p") == png() and connected == [PUBLIC_IP]
    assert refused(loader.fetch, f"{public}/missing.png", "p").code == "media_fetch_failed"
    small = MediaLoader(MediaPolicy(allow_remote=True, max_bytes=10))
    assert refused(small.fetch, url, "p").status == 413


def test_remote_media_never_reaches_a_private_address(
        http_server: str, fake_dns: tuple[str, list[str]]) -> None:
    """Loopback, private, link-local (metadata) and IPv4-mapped addresses are refused after
    resolution, a name with one private address among public ones too (DNS rebinding), and
    each redirect hop is checked: nothing but the checked public address is connected to."""
    public, connected = fake_dns
    port = public.rsplit(":", 1)[1]
    loader = MediaLoader(MediaPolicy(allow_remote=True, timeout_s=5))
    for url in (f"{http_server}/cat.png", f"http://localhost:{port}/cat.png",
                f"http://[::1]:{port}/cat.png", f"http://rebind.example:{port}/cat.png",
                "http://metadata.example/latest/meta-data", "http://mapped.example/",
                f"{public}/to/{http_server}/cat.png",
                f"{public}/to/http://metadata.example/latest/meta-data",
                f"{public}/to/http://169.254.169.254/latest/meta-data"):
        err = refused(loader.fetch, url, "p")
        assert (err.status, err.code) == (400, "media_fetch_failed"), url
        assert "not a public address" in err.message, url
    assert set(connected) == {PUBLIC_IP}            # the redirects' first hops only
    assert loader.fetch(f"{public}/to/{public}/cat.png", "p") == png()


def test_remote_media_errors_do_not_tell_which_ports_are_open(
        fake_dns: tuple[str, list[str]]) -> None:
    """Refused, timed out and unresolvable all read the same (past the URL itself)."""
    loader = MediaLoader(MediaPolicy(allow_remote=True, timeout_s=2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]            # nothing listens there
    urls = (f"http://media.example:{closed_port}/a", "http://quiet.example/a",
            "http://nowhere.example/a")
    messages = {refused(loader.fetch, url, "p").message.split("': ", 1)[1] for url in urls}
    assert messages == {remote_media.UNREACHABLE}


@pytest.mark.parametrize("ip, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False),
    ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False), ("::1", False),
    ("fe80::1%eth0", False), ("fd00:ec2::254", False), ("::ffff:127.0.0.1", False),
    ("2002:7f00:1::", False), ("::", False)])
def test_which_addresses_are_public(ip: str, public: bool) -> None:
    assert remote_media.is_public(ip) is public


def test_audio_parts_decode_to_mono_waveforms() -> None:
    loader = MediaLoader(MediaPolicy())
    t = np.arange(8000) / 16000
    stereo = np.stack([np.sin(2 * np.pi * 300 * t), np.sin(2 * np.pi * 300 * t)]) * 0.5
    for fmt in ("wav", "flac", "mp3"):
        b64 = base64.b64encode(encode_audio(stereo, 16000, fmt)).decode()
        wave, rate = loader.audio(b64, fmt, "p")
        assert wave.ndim == 1 and rate == 16000 and len(wave) >= 8000
        assert abs(np.sqrt(np.mean(wave ** 2)) - 0.5 / np.sqrt(2)) < 0.05
    assert refused(loader.audio, base64.b64encode(b"nope").decode(), "wav",
                   "p").code == "invalid_audio"


def test_audio_urls_decode_whatever_the_container(folders: tuple[Path, Path]) -> None:
    """vLLM's audio_url: a data: or file: URL of a wav, flac, mp3 or opus file, no format
    given; mono at the file's rate."""
    allowed, _ = folders
    loader = MediaLoader(MediaPolicy(allowed_dirs=(allowed,)))
    tone = 0.5 * np.sin(2 * np.pi * 300 * np.arange(8000) / 16000)
    for fmt in ("wav", "flac", "mp3", "opus"):
        data = encode_audio(tone, 16000, fmt)
        wave, rate = loader.audio_url(data_url(data, "audio/x"), "p")
        assert wave.ndim == 1 and rate in (16000, 48000) and len(wave) >= 8000 * rate // 16000
        (allowed / f"tone.{fmt}").write_bytes(data)
        from_file, _ = loader.audio_url(f"file://{allowed}/tone.{fmt}", "p")
        np.testing.assert_array_equal(from_file, wave)
    bad = refused(loader.audio_url, data_url(b"not audio", "audio/wav"), "p")
    assert bad.code == "invalid_audio" and bad.param == "p"


def test_video_parts_are_sampled_at_two_frames_per_second() -> None:
    loader = MediaLoader(MediaPolicy())
    frames, fps = loader.video(data_url(mp4(20, 10), "video/mp4"), "p")   # 2 s of video
    assert fps == 2.0 and len(frames) == 4
    assert all(f.size == (32, 16) for f in frames)
    levels = [np.asarray(f).mean() for f in frames]       # frames 0, 5, 10, 15: brighter
    assert levels == sorted(levels) and levels[-1] > levels[0] + 50
    assert refused(loader.video, data_url(b"not a video at all", "video/mp4"),
                   "p").code == "invalid_video"
