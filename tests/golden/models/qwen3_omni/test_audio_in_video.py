"""Qwen3-Omni's `use_audio_in_video` against transformers on the tiny random checkpoint: a
video part that brings its audio track gives the token ids `Qwen3OmniMoeProcessor` makes of
the same prompt (video and audio tokens merged token by token by time), and the positions of
the thinker's `get_rope_index(use_audio_in_video=True)`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.models.qwen3_omni.audio_in_video import by_chunks, merge_by_time
from omnistage.models.qwen3_omni.processing import InputProcessor
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni
from tests.helpers.audio_in_video import frames, hf_processor, tone


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The released audio chunking (n_window=50: the reference processor's token count
    assumes it)."""
    path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni_aiv"))
    config = json.loads((path / "config.json").read_text())
    config["thinker_config"]["audio_config"].update(n_window=50, n_window_infer=200)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def processor(omni_path: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(omni_path)


@pytest.fixture(scope="module")
def hf_thinker(omni_path: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_path, dtype=torch.float32)
    return model.thinker.eval()


@pytest.mark.parametrize("fps, num_frames, seconds, standalone", [
    (2.0, 6, 3.0, True),       # 3 temporal patches, 25 positions apart (tiny config)
    (1.0, 4, 1.2, False),      # 2 s a patch: the audio ends before the second patch
    (2.0, 2, 4.5, True),       # one patch, then audio only
])
def test_matches_hf_processor_and_rope_index(processor: InputProcessor, hf_thinker, fps: float,
                                             num_frames: int, seconds: float,
                                             standalone: bool) -> None:
    from transformers import Qwen3OmniMoeProcessor

    track = tone(seconds, seed=2)
    parts = [{"type": "video", "video": frames(num_frames, 24, 16), "fps": fps,
              "audio": (track, 16000)}, {"type": "text", "text": "What happens?"}]
    audios, slots = [track], [0]
    if standalone:
        before = tone(0.7, seed=1)
        parts.insert(0, {"type": "audio", "audio": (before, 16000)})
        audios, slots = [before, track], [None, 0]
    ours = processor([{"role": "user", "content": parts}])
    hf = hf_processor(Qwen3OmniMoeProcessor, processor, ours)
    ref = hf(text=[ours.prompt], audio=audios, videos=[parts[-2]["video"]],
             audio_from_video_indices=slots, use_audio_in_video=True,
             videos_kwargs={"fps": fps}, n_window=processor.n_window,
             position_id_per_seconds=processor.position_id_per_seconds, return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.audio_feature_lens, ref["feature_attention_mask"].sum(-1))

    positions, delta = hf_thinker.model.get_rope_index(
        ours.input_ids[None], video_grid_thw=ours.video_grid_thw,
        attention_mask=torch.ones_like(ours.input_ids)[None], use_audio_in_video=True,
        audio_seqlens=ours.audio_feature_lens, second_per_grids=ours.video_second_per_grid)
    assert torch.equal(ours.positions, positions[:, 0].long())
    assert ours.rope_delta == int(delta)


def test_interleavings() -> None:
    times = [0, 0, 25, 25]                           # two patches of two tokens, 25 apart
    assert merge_by_time(times, 30) == [(True, 2), (False, 25), (True, 2), (False, 5)]
    assert merge_by_time(times, 0) == [(True, 4)]
    # chunks of 20 positions: video 0,0 | 25,25; audio 0..19 | 20..29
    assert by_chunks(times, 30, 20) == [(True, 2), (False, 20), (True, 2), (False, 10)]
    assert by_chunks([0, 0], 45, 20) == [(True, 2), (False, 20), (False, 20), (False, 5)]


def test_talker_prompt_positions(processor: InputProcessor, hf_thinker) -> None:
    """The talker's prompt (the user turn's ids, then tts pads) holds the same block: its
    positions need the audio ids too (what stages/qwen3_omni.py's talker prefill must pass)."""
    from omnistage.models.qwen3_omni.mrope import mrope_positions

    inputs = processor([{"role": "user", "content": [
        {"type": "video", "video": frames(6, 24, 16), "audio": (tone(2.5), 16000)},
        {"type": "text", "text": "Hm?"}]}])
    t = processor.tokens
    ids = inputs.input_ids[:-3].tolist() + [t.audio_end] * 4        # any text after the turn
    kw = {"image_token_id": t.image_pad, "video_token_id": t.video_pad,
          "spatial_merge_size": 2, "position_id_per_seconds": processor.position_id_per_seconds,
          "video_grid_thw": inputs.video_grid_thw,
          "video_second_per_grid": inputs.video_second_per_grid}
    with pytest.raises(ValueError, match="video 0 has 6 placeholder tokens"):
        mrope_positions(ids, **kw)
    ours, delta = mrope_positions(ids, audio_token_id=t.audio_pad,
                                  audio_start_token_id=t.audio_start, **kw)
    ref, ref_delta = hf_thinker.model.get_rope_index(
        torch.tensor(ids)[None], video_grid_thw=inputs.video_grid_thw,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long), use_audio_in_video=True,
        audio_seqlens=inputs.audio_feature_lens, second_per_grids=inputs.video_second_per_grid)
    assert torch.equal(ours, ref[:, 0].long()) and delta == int(ref_delta)


def test_thinker_text_equals_transformers(omni_path: Path, processor: InputProcessor,
                                          hf_thinker) -> None:
    """Through the stage runtime (text out): the interleaved prompt's embeddings, deepstack
    rows and positions give the text of the thinker's `generate(use_audio_in_video=True)`."""
    from omnistage import Omni, SamplingParams

    messages = [{"role": "user", "content": [
        {"type": "video", "video": frames(6, 24, 16), "audio": (tone(3.0, seed=5), 16000)},
        {"type": "text", "text": "What do you see and hear?"}]}]
    with Omni(str(omni_path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate({"messages": messages},
                               [SamplingParams(temperature=0.0, max_tokens=8), None, None],
                               output_modalities={"text"})
    assert out.error is None, out.error
    inputs = processor(messages)
    assert out.prompt_token_ids == inputs.input_ids.tolist()
    with torch.no_grad():
        seq = hf_thinker.generate(**inputs.hf_kwargs(), use_audio_in_video=True,
                                  do_sample=False, max_new_tokens=8)
    assert out.token_ids == seq[0, inputs.input_ids.shape[0]:].tolist()


def test_the_talker_speaks_a_prompt_with_a_videos_audio(omni_path: Path) -> None:
    """Speech out for the same prompt: the talker's prefill positions the interleaved block
    with the audio ids (a 500 from the talker before). transformers' own
    generate(return_audio=True, use_audio_in_video=True) fails, so the check is that the
    talker's positions equal the thinker processor's for the user turn (above) and that the
    whole graph answers with audio of the talker's length."""
    from omnistage import Omni, SamplingParams

    messages = [{"role": "user", "content": [
        {"type": "video", "video": frames(6, 24, 16), "audio": (tone(3.0, seed=5), 16000)},
        {"type": "text", "text": "What do you see and hear?"}]}]
    with Omni(str(omni_path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate({"messages": messages},
                               [SamplingParams(temperature=0.0, max_tokens=6),
                                SamplingParams(temperature=0.0, max_tokens=16), None])
    assert out.error is None, out.error
    audio = out.tensors["audio"]
    assert audio.numel() > 0 and audio.abs().max() > 0
