"""MiMo-Audio's LLM stage in process (stages/mimo_audio.py) on the tiny servable folder, golden
against our MiMoAudioForCausalLM.generate on the same prompt: a spoken reply ends at the step
its greedy path draws <|eostm|> (upstream's MiMoStopper), its spoken patches sent on before;
the same checkpoint asked for text (no decoder downstream) does not stop there."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from omnistage.configs.schema import ARSettings, KVCacheConfig, StageConfig
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
from omnistage.models.mimo_audio.prompt import (SPEECH_START, MiMoAudioInputProcessor,
                                                SpecialIds, segment_ids, text_patches)
from omnistage.payloads import CodecFrames
from omnistage.sampling_params import SamplingParams
from omnistage.stages.interface import StageRequest
from omnistage.stages.mimo_audio import MiMoAudioStage
from tests.helpers.mimo_audio import build_tiny_mimo_audio

STEPS = 12
TEXT = "Hello world."


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, list[int]]:
    """The folder with <|eostm|>'s lm_head row swapped with that of the first text id the
    greedy spoken reply draws after speaking: the reply now stops there. -> (folder, that
    step, the original greedy text ids)."""
    folder = build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo") / "model", 0.25)
    proc = MiMoAudioInputProcessor.from_pretrained(folder)
    sp = SpecialIds.of(proc.tokenizer)
    model = MiMoAudioForCausalLM.from_pretrained(folder, sp.empty)
    ids = proc.parse_request(TEXT).input_ids.tolist() + segment_ids(proc.tokenizer,
                                                                      list(SPEECH_START))
    out = model.generate(text_patches(ids, model.cfg).reshape(-1), STEPS)
    text = out.view(STEPS, 4, -1)[:, 0, 0].tolist()
    step = next(i for i in range(1, STEPS) if text[i] != sp.empty and sp.empty in text[:i])
    state = load_file(folder / "model.safetensors")
    lm = state["lm_head.weight"]
    lm[[sp.eostm, text[step]]] = lm[[text[step], sp.eostm]]
    save_file(state, str(folder / "model.safetensors"))
    return folder, step, text


def _run(folder: Path, downstream: tuple[str, ...]) -> tuple[list[int], list, str | None]:
    settings = ARSettings(enforce_eager=True, kv_cache=KVCacheConfig(num_blocks=16))
    stage = MiMoAudioStage(StageConfig("llm", "ar", component="mimo_audio_llm", ar=settings),
                           str(folder), "cpu")
    proc = MiMoAudioInputProcessor.from_pretrained(folder)
    stage.add(StageRequest("r", 0.0, SamplingParams(temperature=0.0, max_tokens=STEPS),
                           prompt_token_ids=proc.parse_request(TEXT).input_ids.tolist(),
                           downstream=downstream))
    ids, frames, reason = [], [], None
    while stage.has_unfinished_requests:
        for res in stage.step():
            assert res.error is None, res.error
            ids += res.token_ids
            if res.payload.codec is not None:
                frames.append(CodecFrames.unpack(res.payload.codec.pack()).codes)
            reason = res.finish_reason if res.finished else reason
    return ids, frames, reason


def test_a_spoken_reply_stops_at_eostm(case: tuple[Path, int, list[int]]) -> None:
    folder, step, text = case
    sp = SpecialIds.of(MiMoAudioInputProcessor.from_pretrained(folder).tokenizer)
    ids, frames, reason = _run(folder, ("decoder",))
    assert ids == [*text[:step], sp.eostm] and reason == "stop"
    assert len(frames) == text[:step].count(sp.empty) > 0
    assert all(f.shape == (4, 8) for f in frames)


def test_a_text_reply_does_not_stop_at_eostm(case: tuple[Path, int, list[int]]) -> None:
    eostm = SpecialIds.of(MiMoAudioInputProcessor.from_pretrained(case[0]).tokenizer).eostm
    ids, _, reason = _run(case[0], ())
    assert len(ids) == STEPS and reason == "length" and eostm in ids[:-1]

