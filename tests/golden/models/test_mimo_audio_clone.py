"""Golden: MiMo-Audio speaking in a cloned voice and with a style instruction, against upstream's
code at the pinned commit (tests/fixtures/mimo_audio/clone.safetensors from
scripts/mimo_audio_clone_fixtures.py, on the tiny servable folder of tests/helpers/mimo_audio.py):

  * the prompts (get_tts_sft_prompt with prompt_speech, with prompt_speech and an instruction,
    with an instruction alone) equal ours (models/mimo_audio/voice.py's layouts, the clip
    encoded by our audio tokenizer encoder), every text id and every audio id;
  * the runtime (AsyncOmni, the shipped graph, stages in process) given the clip as ref_audio
    speaks, greedy, the codes upstream's tts_sft hands its decoder; without the clip it speaks
    other codes; a text chat given the clip speaks other codes than without it, repeatably;
  * a spoken chat in the clip's voice (get_spoken_dialogue_sft_multiturn_prompt, a user turn
    of audio, the audio tokenizer at 8 kHz): the prompt is upstream's, id for id, and the
    runtime speaks upstream's codes (up to upstream's dropping the last patch at the length
    limit);
  * a thinking layout's frames are sent as upstream's forward cuts them (MiMoAudioStage._hold).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import omnistage.generation.mimo_audio as gen
from omnistage import AsyncOmni, SamplingParams
from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.prompt import (SPEECH_START, MiMoAudioInputProcessor,
                                                SpecialIds, segment_ids, speech_patches,
                                                text_patches)
from omnistage.models.mimo_audio.tokenizer_encoder import MiMoAudioTokenizerEncoder
from omnistage.models.mimo_audio.voice import (dialogue_segments, layout_ids, tts_segments,
                                               tts_text)
from tests.helpers.mimo_audio import FIXTURES, build_tiny_mimo_audio


@pytest.fixture(scope="module")
def fx() -> dict:
    with safe_open(FIXTURES / "clone.safetensors", "pt") as f:
        out = json.loads(f.metadata()["json"])
        out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo_clone") / "model", 0.25)


def ours(folder: Path, text: str, instruction: str | None, clip: torch.Tensor | None
         ) -> torch.Tensor:
    """Our prompt as the LLM stage lays it out -> upstream's (1 + channels, T * group_size)
    (a text id on each patch's first frame; upstream's -100 on the others kept)."""
    proc = MiMoAudioInputProcessor.from_pretrained(folder)
    cfg = MiMoAudioConfig.from_folder(folder, empty_idx=proc.special.empty)
    rows = None
    if clip is not None:
        enc = MiMoAudioTokenizerEncoder.from_pretrained(folder / "audio_tokenizer")
        with torch.no_grad():
            rows = speech_patches(enc.speech_ids(clip, cfg.audio_channels, cfg.group_size), cfg)
    spoken = tts_text(proc.parse_request(text).prompt)
    assert spoken is not None
    ids, at = layout_ids(proc.tokenizer, SpecialIds.of(proc.tokenizer),
                         tts_segments(spoken, instruction, rows is not None),
                         0 if rows is None else rows.shape[0])
    patches = text_patches(ids, cfg)
    if rows is not None:
        patches[at:at + rows.shape[0]] = rows
    patches[:, 1:, 0] = -100
    return patches.reshape(-1, cfg.audio_channels + 1).T


def test_prompts_equal_upstream(fx: dict, folder: Path) -> None:
    clip = fx["clip"]
    for name, instruction, with_clip in (("clone", None, True),
                                         ("clone_instruct", fx["instruction"], True),
                                         ("instruct", fx["instruction"], False)):
        want = fx[f"{name}_prompt"].long()
        got = ours(folder, fx["text"], instruction, clip if with_clip else None)
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name


class Runtime:
    """The shipped graph in process (AsyncOmni) on `folder`, greedy for `steps`: run(prompt,
    extra) -> the codes its decoder stage was given (a spy on MiMoAudioGenerator.generate)."""

    def __init__(self, folder: Path, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.spoken: dict[int, torch.Tensor] = {}
        real = gen.MiMoAudioGenerator.generate

        def spy(generator, inputs, states, is_last):
            out = real(generator, inputs, states, is_last)
            for state in states:
                self.spoken[id(state)] = state["stream"].codes
            return out

        monkeypatch.setattr(gen.MiMoAudioGenerator, "generate", spy)
        self.steps = steps
        self.engine = AsyncOmni(str(folder), device="cpu", backend="inproc", connector="inproc")

    def run(self, prompt: object, extra: dict) -> list:
        async def one() -> list:
            params = [SamplingParams(temperature=0.0, max_tokens=self.steps, extra=extra), None]
            async for _ in self.engine.generate(prompt, params, output_modalities={"audio"}):
                pass
            [codes] = self.spoken.values()
            self.spoken.clear()
            return codes.tolist()
        return asyncio.run(asyncio.wait_for(one(), timeout=120))


def test_runtime_speaks_upstreams_codes_in_the_cloned_voice(fx: dict, folder: Path,
                                                            monkeypatch) -> None:
    rt = Runtime(folder, fx["steps"], monkeypatch)
    chat = {"messages": [{"role": "user", "content": "Hello there."}]}
    clip = {"ref_audio": fx["clip"].tolist()}
    want = fx["clone_codes"].tolist()
    try:
        assert run_ok(rt, fx["text"], clip) == want
        assert rt.run(fx["text"], {}) != want, "the clip changed nothing"
        voiced = rt.run(chat, clip)           # a text chat answered in the clip's voice
        assert voiced != rt.run(chat, {}) and voiced == rt.run(chat, clip)
    finally:
        rt.engine.shutdown()


def run_ok(rt: Runtime, prompt: object, extra: dict) -> list:
    codes = rt.run(prompt, extra)
    assert len(codes) == 8 and len(codes[0]) > 4, "too little speech to compare"
    return codes


def test_spoken_chat_in_a_cloned_voice_equals_upstream(fx: dict, monkeypatch,
                                                       tmp_path_factory) -> None:
    """get_spoken_dialogue_sft_multiturn_prompt with prompt_speech (one user turn of audio) on
    the folder with its audio tokenizer at 8 kHz: our prompt (the front door's layout of the
    turn + the stage's voice turn before it, both clips encoded by our encoder) is upstream's,
    and the runtime given the same chat and clip speaks upstream's codes."""
    d = {k.removeprefix("dialogue_"): v for k, v in fx.items() if k.startswith("dialogue_")}
    folder = build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo8k") / "model", 0.25, d["rate"])
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": d["user"].numpy(), "sample_rate": d["rate"]}]}]
    proc = MiMoAudioInputProcessor.from_pretrained(folder)
    cfg = MiMoAudioConfig.from_folder(folder, empty_idx=proc.special.empty)
    enc = MiMoAudioTokenizerEncoder.from_pretrained(folder / "audio_tokenizer")

    def rows(wave: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return speech_patches(enc.speech_ids(wave, cfg.audio_channels, cfg.group_size), cfg)
    inputs = proc.parse_request({"messages": messages})
    assert inputs.audio_waveforms is not None and inputs.audio_starts is not None
    body = text_patches(inputs.input_ids.tolist() + segment_ids(proc.tokenizer,
                                                                list(SPEECH_START)), cfg)
    user, at = rows(inputs.audio_waveforms), int(inputs.audio_starts[0])
    body[at:at + user.shape[0]] = user
    clip = rows(d["clip"])
    ids, at = layout_ids(proc.tokenizer, proc.special, dialogue_segments(), clip.shape[0])
    head = text_patches(ids, cfg)
    head[at:at + clip.shape[0]] = clip
    got = torch.cat([head, body])
    got[:, 1:, 0] = -100
    assert torch.equal(got.reshape(-1, cfg.audio_channels + 1).T, d["prompt"].long())
    rt = Runtime(folder, fx["steps"], monkeypatch)
    try:
        codes = run_ok(rt, {"messages": messages}, {"ref_audio": d["clip"].tolist()})
    finally:
        rt.engine.shutdown()
    want = d["codes"].tolist()
    # at the length limit upstream's forward drops the last step's patch (its text row's
    # [:-1]); the runtime keeps it (a patch drawn at max_tokens is output, as
    # test_mimo_audio_engine.py checks): equal up to that patch, and that patch is there
    assert [c[:len(want[0])] for c in codes] == want
    assert len(codes[0]) - len(want[0]) in (0, cfg.group_size)


@pytest.mark.parametrize("writes_sostm", [True, False])
def test_thinking_requests_speak_upstreams_span(writes_sostm: bool) -> None:
    """A layout ending <think>: the frames the stage sends (MiMoAudioStage._hold, step by step)
    are the codes upstream's forward cuts from the same steps (speech.patches_to_codes, its
    port): after the first <|sostm|> the model writes, or all of them when it writes none."""
    from types import SimpleNamespace

    from omnistage.models.mimo_audio.speech import patches_to_codes
    from omnistage.stages.mimo_audio import MiMoAudioStage

    cfg = MiMoAudioConfig.from_folder(FIXTURES / "tiny", empty_idx=299)
    sostm, eostm, g = 292, 293, cfg.group_size
    stage = SimpleNamespace(_held={"r": []}, special=SimpleNamespace(sostm=sostm))
    gen_ = torch.Generator().manual_seed(3)
    texts = [299, 299, 57, sostm if writes_sostm else 58, 299, 299, 299]
    sent, flat = [], []
    for i, text in enumerate(texts):
        codes = None
        if text == 299:
            codes = torch.stack([torch.randint(0, e, (g,), generator=gen_)
                                 for e in cfg.empty_ids], dim=1)       # (group_size, channels)
        audio = codes if codes is not None else torch.tensor(cfg.empty_ids).repeat(g, 1)
        flat.append(torch.cat([torch.full((g, 1), text), audio], dim=1))
        out = MiMoAudioStage._hold(stage, "r", [text], codes, i == len(texts) - 1)
        assert out is None or writes_sostm or i == len(texts) - 1, "sent before the end"
        sent += [] if out is None else [out]
    want = patches_to_codes(torch.cat(flat).reshape(-1), cfg, sostm, eostm)
    assert want.shape[1] == (12 if writes_sostm else 20)
    assert torch.equal(torch.cat(sent).T, want)
    assert stage._held == {}
