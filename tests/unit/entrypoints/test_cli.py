"""`omnistage generate` end to end, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.entrypoints.cli.main import main


def test_generate_prints_answers(tiny_qwen3: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", str(tiny_qwen3), "--prompt", "hello", "--prompt", "world",
               "--max-tokens", "4", "--device", "cpu", "--json"])
    assert rc == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [l["prompt"] for l in lines] == ["hello", "world"]
    assert all(1 <= len(l["token_ids"]) <= 4 for l in lines)


def test_generate_bad_input_is_a_clear_error(tiny_qwen3: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", str(tiny_qwen3), "--prompt", "x", "--max-tokens", "0"])
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err
    rc = main(["generate", "/nonexistent/model", "--prompt", "x"])
    assert rc == 2
    assert "/nonexistent/model" in capsys.readouterr().err


def test_generate_with_stage_config_and_overrides(tiny_qwen3: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "graph.yaml"
    cfg.write_text(f"model: {tiny_qwen3}\nbackend: inproc\nconnector: inproc\n"
                   "stages:\n  - {name: llm, kind: ar, final: text}\n")
    rc = main(["generate", "--stage-config", str(cfg), "--stage-override",
               "llm.ar.max_num_seqs=2", "--prompt", "hi", "--max-tokens", "3", "--device", "cpu",
               "--json"])
    assert rc == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert 1 <= len(json.loads(line)["token_ids"]) <= 3
    rc = main(["generate", "--stage-config", str(cfg), "--stage-override", "llm.max_num_seq=2",
               "--prompt", "hi"])
    assert rc == 2
    assert "did you mean ar.max_num_seqs" in capsys.readouterr().err


def test_generate_demo_writes_pngs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from PIL import Image

    rc = main(["generate", "--prompt", "a handwritten 3", "--num-images", "2", "--steps", "8",
               "--device", "cpu", "--output-dir", str(tmp_path), "--stage-override",
               "backend=inproc", "--stage-override", "connector=inproc"])
    assert rc == 0
    paths = capsys.readouterr().out.split()
    assert len(paths) == 2
    assert all(Image.open(p).size == (64, 64) for p in paths)
    rc = main(["generate", "--prompt", "a cat", "--device", "cpu", "--output-dir",
               str(tmp_path), "--stage-override", "backend=inproc", "--stage-override",
               "connector=inproc"])
    assert rc == 1
    assert "names no digit" in capsys.readouterr().err


def test_generate_video_writes_mp4(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The toy video model: an MP4 at the model's frame rate, frames as the toy draws them."""
    import numpy as np

    from omnistage.testing.toy_video import SPEC, build_toy_video, expected_frames
    from omnistage.utils.video import decode_video

    folder, graph = build_toy_video(tmp_path / "toy")
    rc = main(["generate", str(folder), "--stage-config", str(graph), "--prompt", "a kite",
               "--num-frames", "5", "--height", "32", "--width", "48", "--seed", "3",
               "--steps", "2", "--device", "cpu", "--output-dir", str(tmp_path / "out"),
               "--stage-override", "backend=inproc", "--stage-override", "connector=inproc"])
    assert rc == 0
    (path,) = capsys.readouterr().out.split()
    frames, fps = decode_video(Path(path).read_bytes())
    expected = expected_frames("a kite", 3, 5, 32, 48)
    assert frames.shape == expected.shape and fps == pytest.approx(SPEC.fps)
    mse = np.mean((frames.astype(np.float64) - expected) ** 2)
    assert 10 * np.log10(255 ** 2 / mse) > 30     # H.264, 4:2:0 chroma on hard colour edges


def test_generate_video_from_a_first_frame(tmp_path: Path, capsys: pytest.CaptureFixture
                                           ) -> None:
    """--image reaches the pipeline: the toy's background is the first frame's mean colour."""
    from PIL import Image

    from omnistage.testing.toy_video import build_toy_video, expected_frames
    from omnistage.utils.video import decode_video

    folder, graph = build_toy_video(tmp_path / "toy")
    first = Image.new("RGB", (48, 32), (30, 200, 90))
    first.save(tmp_path / "first.png")
    rc = main(["generate", str(folder), "--stage-config", str(graph), "--prompt", "a kite",
               "--image", str(tmp_path / "first.png"), "--num-frames", "1", "--height", "32",
               "--width", "48", "--seed", "3", "--steps", "2", "--device", "cpu",
               "--output-dir", str(tmp_path / "out"), "--stage-override", "backend=inproc",
               "--stage-override", "connector=inproc"])
    assert rc == 0
    (path,) = capsys.readouterr().out.split()
    frames, _ = decode_video(Path(path).read_bytes())
    expected = expected_frames("a kite", 3, 1, 32, 48, first)
    assert abs(frames[0, 0, 0].astype(int) - expected[0, 0, 0]).max() <= 8
    assert abs(frames[0, 0, 0].astype(int) - expected_frames("a kite", 3, 1, 32, 48)[0, 0, 0]
               ).max() > 40                                  # not the text-only background


def test_generate_speech_writes_wav(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Qwen3-Omni checkpoint: the prompt goes through the chat template, the answer's text is
    printed and its speech written as a 24 kHz WAV file; --modalities text writes none."""
    import soundfile

    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path / "omni")
    common = ["generate", str(ckpt), "--prompt", "Hello world", "--max-tokens", "6",
              "--device", "cpu", "--output-dir", str(tmp_path / "out"), "--json",
              "--stage-override", "backend=inproc", "--stage-override", "connector=inproc"]
    assert main(common + ["--speaker", "chelsie"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert len(result["token_ids"]) == 6 and result["prompt"] == "Hello world"
    (wav,) = result["files"]
    audio, rate = soundfile.read(wav)
    assert rate == 24000 and audio.ndim == 1 and len(audio) > 0
    assert main(common + ["--modalities", "text"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == []
    assert main(common + ["--speaker", "nobody"]) == 2
    assert "speaker 'nobody' is unknown" in capsys.readouterr().err


def test_generate_refuses_flags_of_the_other_kind_of_model(tiny_qwen3: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """Checked before anything loads: image flags on a text model, text flags on an image
    model, and a --max-model-len above the model's max_position_embeddings."""
    assert main(["generate", str(tiny_qwen3), "--prompt", "x", "--steps", "4",
                 "--height", "64"]) == 2
    assert ("--steps, --height: image-model flags, and this model's main stage 'llm' is an ar "
            "stage") in capsys.readouterr().err
    assert main(["generate", "--prompt", "a 3", "--max-tokens", "4"]) == 2
    assert "--max-tokens: text-model flag, and this model's main stage 'dit' is a diffusion" \
        in capsys.readouterr().err
    assert main(["generate", str(tiny_qwen3), "--prompt", "x", "--max-model-len", "9999"]) == 2
    assert "above this model's limit of 512 tokens" in capsys.readouterr().err
