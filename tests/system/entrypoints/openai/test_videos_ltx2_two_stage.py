"""LTX-2's two-stage recipe through /v1/videos: a server on a tiny random distilled-style
LTX-2 folder with a latent_upsampler/ (tests/helpers/ltx2.py) and `--stage-config
ltx2_two_stage` answers the asked size (the base loop at half of it) with its sound track;
a size that does not halve to multiples of 32 is a 400 naming the side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest

from omnistage.utils.video import decode_sound_track, decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")

BODY = {"prompt": "a dog barks in the rain", "seed": 3, "size": "128x64", "num_frames": 9,
        "fps": 12}


def ltx2_args(path: Path, graph: str, videos: Path) -> list[str]:
    """A tiny LTX-2 server's command line on `graph`, its videos under `videos`."""
    return [str(path), "--served-model-name", "tiny-ltx2", "--stage-config", graph,
            "--videos-dir", str(videos), "--max-video-size", "128"]


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server],
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    from tests.helpers.ltx2 import add_tiny_upsampler, build_tiny_ltx2
    from tests.helpers.ltx2_text import add_tiny_text_encoder

    path: Path = tmp_path_factory.mktemp("tiny_ltx2_two_stage")
    build_tiny_ltx2(path)
    add_tiny_upsampler(path)
    add_tiny_text_encoder(path)
    return start_server(ltx2_args(path, "ltx2_two_stage", tmp_path_factory.mktemp("videos")))


def test_two_stage_answers_the_asked_size_with_sound(server: Server) -> None:
    r = server.post("/v1/videos/sync", json=BODY)
    assert r.status_code == 200, r.text
    frames, fps = decode_video(r.content)
    assert frames.shape == (BODY["num_frames"], 64, 128, 3) and fps == pytest.approx(12)
    track = decode_sound_track(r.content)
    assert track is not None and track.samples.shape[0] == 2


def test_a_size_that_does_not_halve_is_a_400_naming_it(server: Server) -> None:
    r = server.post("/v1/videos/sync", json={**BODY, "size": "96x64"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "width" and "latent upsampler" in error["message"], error


def test_upsample_per_request_on_the_one_stage_graph(start_server: Callable[..., Server],
                                                     tmp_path_factory: pytest.TempPathFactory,
                                                     server: Server) -> None:
    """On the one-stage distilled graph, `upsample: true` runs the two-stage recipe for that request
    alone: the same frames as the two-stage graph's answer; `upsample: false` on the
    two-stage graph, one stage at the asked size (other frames); a folder without an
    upsampler refuses `upsample: true` naming it."""
    from tests.helpers.ltx2 import add_tiny_upsampler, build_tiny_ltx2
    from tests.helpers.ltx2_text import add_tiny_text_encoder

    path: Path = tmp_path_factory.mktemp("tiny_ltx2_upsample_field")
    build_tiny_ltx2(path)
    add_tiny_text_encoder(path)
    plain = start_server(ltx2_args(path, "ltx2_distilled",
                                   tmp_path_factory.mktemp("videos_plain")))
    r = plain.post("/v1/videos/sync", json={**BODY, "upsample": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "upsample", r.json()
    plain.stop()

    add_tiny_upsampler(path)
    one_stage = start_server(ltx2_args(path, "ltx2_distilled",
                                       tmp_path_factory.mktemp("videos_one")))
    asked = one_stage.post("/v1/videos/sync", json={**BODY, "upsample": True})
    plain_answer = one_stage.post("/v1/videos/sync", json=BODY)
    two = server.post("/v1/videos/sync", json=BODY)
    two_off = server.post("/v1/videos/sync", json={**BODY, "upsample": False})
    for r in (asked, plain_answer, two, two_off):
        assert r.status_code == 200, r.text
    frames = {name: decode_video(r.content)[0] for name, r in
              (("asked", asked), ("plain", plain_answer), ("two", two), ("two_off", two_off))}
    assert frames["asked"].shape == frames["plain"].shape == (BODY["num_frames"], 64, 128, 3)
    assert (frames["asked"].astype(int) - frames["two"].astype(int)).__abs__().max() <= 1
    assert (frames["asked"] != frames["plain"]).any()
    assert (frames["two_off"] != frames["two"]).any()
