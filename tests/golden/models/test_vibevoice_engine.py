"""Golden: VibeVoice on the AR engine (generation/vibevoice.py: the CFG negative and token-CFG
contexts as shadow sequences, the frames in the feedback hook) vs transformers' generate on
tiny random checkpoints: ids identical, latents and streamed audio within 1e-4; two requests
joining at different steps, with different guidance, batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.generation.vibevoice import SpeechState, VibeVoiceSpeaker
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.models.vibevoice.prompt import prompt_embeds
from tests.helpers.vibevoice import AUDIO_BOS, AUDIO_TOKEN, build_tiny_vibevoice, reference_generate

PROMPT = [5, 17, 99, 3, 42, 7, AUDIO_BOS]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vibevoice(tmp_path_factory.mktemp("vibevoice0"), 0)


def load(path: Path, device: torch.device, dtype: torch.dtype | None):
    model = VibeVoiceForConditionalGeneration.from_pretrained(path, device, torch.float32)
    return model, model.model_config, None


def make_speaker(root: Path, **sched: int) -> VibeVoiceSpeaker:
    engine = AREngine(ARConfig(model=str(root), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4, num_blocks=64),
                               scheduler=SchedulerConfig(**sched)), loader=load)
    return VibeVoiceSpeaker(engine)


def add(speaker: VibeVoiceSpeaker, rid: str, ids: list[int], seed: int, g: float, steps: int,
        max_new: int) -> None:
    embeds = prompt_embeds(speaker.model, torch.tensor(ids), [])
    speaker.add(rid, embeds, ids[-1], max_new, torch.Generator().manual_seed(seed), g, steps)


def run(speaker: VibeVoiceSpeaker) -> None:
    while speaker.engine.has_unfinished_requests:
        for out in speaker.engine.step():
            assert out.error is None, out.error


def assert_equal(got: SpeechState, ref: dict, what: str) -> None:
    assert got.tokens == ref["tokens"], what
    assert len(got.latents) == (torch.tensor(ref["tokens"]) == AUDIO_TOKEN).sum() > 2, what
    assert ref["audio"].abs().mean() > 1.0, "the reference's audio is near silent"
    torch.testing.assert_close(torch.stack(got.latents), ref["latents"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.cat(got.audio), ref["audio"], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("g", [1.3, 1.0])
def test_engine_equals_transformers(root: Path, g: float) -> None:
    ref = reference_generate(root, PROMPT, 11, 12, g, 5)
    speaker = make_speaker(root)
    add(speaker, "a", PROMPT, 11, g, 5, 12)
    run(speaker)
    assert_equal(speaker.drop("a"), ref, f"g={g}")
    if g != 1.0:
        assert ref["tokens"].count(AUDIO_BOS) >= 2       # the negative context restarted
    bm = speaker.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_two_requests_joining_at_different_steps(root: Path) -> None:
    b_ids = [8, 8, 31, 77, AUDIO_BOS]
    ref_a = reference_generate(root, PROMPT, 11, 12, 1.3, 5)
    ref_b = reference_generate(root, b_ids, 23, 9, 1.5, 4)
    speaker = make_speaker(root)
    add(speaker, "a", PROMPT, 11, 1.3, 5, 12)
    for _ in range(3):
        speaker.engine.step()
    add(speaker, "b", b_ids, 23, 1.5, 4, 9)
    run(speaker)
    assert_equal(speaker.drop("a"), ref_a, "a")
    assert_equal(speaker.drop("b"), ref_b, "b")
