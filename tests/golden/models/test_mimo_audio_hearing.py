"""MiMo-Audio hears through the shipped graph (Omni, in process): a user turn with an audio
part and a question, answered in text and in speech. The front door lays the audio out
(models/mimo_audio/prompt.py), the LLM stage encodes it (the audio tokenizer's encoder) into
its speech patches; the answer equals our model's greedy generate on upstream's own prompt for
the same waveform (tests/fixtures/mimo_audio/encode.safetensors, from
scripts/mimo_audio_encoder_fixtures.py: upstream's get_audio_understanding_sft_prompt), and
differs from the answer to the question alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from omnistage import Omni, SamplingParams
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
from omnistage.models.mimo_audio.prompt import MiMoAudioInputProcessor, SpecialIds
from tests.helpers.mimo_audio import FIXTURES, build_tiny_mimo_audio

STEPS = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo_hear") / "model", 0.25)


def question(audio: np.ndarray | None) -> dict:
    parts = ([{"type": "audio", "audio": audio}] if audio is not None else [])
    return {"messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "Describe it."}]}]}


def test_the_answer_hears_the_audio(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fx = load_file(FIXTURES / "encode.safetensors")
    # the tiny tokenizer's 400 Hz is below any rate a request may send: the waveform goes in
    # at the tokenizer's rate as it is (resampling and the part checks: test_mimo_audio_encoder)
    monkeypatch.setattr(MiMoAudioInputProcessor, "hear", lambda self, part, where: part["audio"])
    wav = fx["wav_short"].numpy()
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        heard, deaf = omni.generate([question(wav), question(None)], greedy,
                                    output_modalities={"text"})
        (spoken,) = omni.generate([question(wav)], [greedy, None])
    assert heard.error is None and spoken.error is None, (heard.error, spoken.error)

    proc = MiMoAudioInputProcessor.from_pretrained(folder)
    empty = SpecialIds.of(proc.tokenizer).empty
    model = MiMoAudioForCausalLM.from_pretrained(folder, empty)
    g = model.cfg.group_size
    prompt = fx["prompt"].T.reshape(-1, g, fx["prompt"].shape[0])   # upstream's, as patches
    out = model.generate(prompt.reshape(-1), STEPS).view(STEPS, g, -1)[:, 0, 0].tolist()
    assert heard.token_ids == out
    assert heard.token_ids != deaf.token_ids, "the audio changes the answer"
    assert "audio" in spoken.tensors and spoken.tensors["audio"].abs().max() > 0.01
