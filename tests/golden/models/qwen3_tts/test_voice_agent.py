"""A voice agent from a text LLM (configs/voice_agent.yaml): a tiny Qwen3 LLM's answer spoken by
the tiny Qwen3-TTS CustomVoice talker while it is written, in one graph, greedy, float32.

Golden: the agent's audio is the Qwen3-TTS graph's for the LLM's whole (speakable) text fed
along the frames (`non_streaming_mode` false: the reference's streaming mode, golden against
`qwen-tts` through the Base clone cases), its text is the LLM's alone, and the first audio
reaches the caller before the LLM's last token."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.errors import InputError
from omnistage.stages.speakable import speakable
from omnistage.testing.tiny_models import build_tiny_checkpoint
from omnistage.testing.tiny_tts import CASES, MAX_TOKENS

LLM_TOKENS = 160
CHUNKS = ["code2wav.generation.options.chunk_frames=4",
          "code2wav.generation.options.first_chunk_frames=2"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("agent_llm"), "Qwen3ForCausalLM")


def voice() -> dict:
    fields = CASES["preset"][1]
    return {"voice": fields["speaker"], "language": fields["language"]}


def params() -> list[SamplingParams]:
    """The LLM greedy for LLM_TOKENS tokens; the talker as the golden TTS tests run it."""
    talker = SamplingParams(temperature=0.0, repetition_penalty=1.05, min_tokens=2,
                            max_tokens=4 * MAX_TOKENS, detokenize=False, extra=voice())
    return [SamplingParams(temperature=0.0, max_tokens=LLM_TOKENS, ignore_eos=True), talker,
            None]


def agent(llm: Path, tts: Path) -> AsyncOmni:
    return AsyncOmni(str(llm), stage_config="voice_agent", device="cpu", backend="inproc",
                     connector="inproc",
                     stage_overrides=[f"talker.model={tts}", f"code2wav.model={tts}", *CHUNKS])


def test_agent_speaks_its_text_while_writing_it(llm: Path, qwen3_tts_ref: dict) -> None:
    tts = qwen3_tts_ref["root"] / CASES["preset"][0]
    engine = agent(llm, tts)
    seen: list[tuple[float, str, bool]] = []      # (time, what arrived, finished)

    async def run() -> list:
        outs = []
        async for out in engine.generate("Tell me a story.", params()):
            kind = "audio" if "audio" in out.delta_tensors else "text" if out.delta_text else ""
            seen.append((time.monotonic(), kind, out.finished))
            outs.append(out)
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(run(), timeout=240))
    finally:
        engine.shutdown()
    assert outs[-1].error is None, outs[-1].error
    text = outs[-1].text
    pieces = [o.delta_tensors["audio"] for o in outs if "audio" in o.delta_tensors]
    assert pieces and len(speakable(text).split()) >= 3, text
    first_audio = min(t for t, kind, _ in seen if kind == "audio")
    last_text = max(t for t, kind, _ in seen if kind == "text")
    assert first_audio < last_text, ("the first audio came only after the LLM's last token",
                                     first_audio - last_text)

    with Omni(str(llm), device="cpu", backend="inproc", connector="inproc") as plain:
        (alone,) = plain.generate("Tell me a story.", params()[0])
    assert alone.text == text                       # the LLM's answer is unchanged
    whole = replace(params()[1], extra={**voice(), "non_streaming_mode": False})
    with Omni(str(tts), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=CHUNKS) as omni:
        (expected,) = omni.generate(speakable(text).strip(), whole)
    assert expected.error is None and "audio" in expected.tensors, (
        speakable(text), expected.token_ids, expected.finish_reason, list(expected.tensors))
    audio, reference = torch.cat(pieces), expected.tensors["audio"]
    assert reference.abs().max() > 0.05
    assert audio.shape == reference.shape and (audio - reference).abs().max() <= 1e-4


def test_agent_refuses_bad_voices_and_in_context_cloning(llm: Path, qwen3_tts_ref: dict
                                                        ) -> None:
    """An unknown voice is refused at the front door (as the TTS graph's); a clone from a
    reference transcript needs the whole text, so the talker fails that request alone."""
    tts = qwen3_tts_ref["root"] / CASES["preset"][0]
    engine = agent(llm, tts)
    bad_voice, clone = params(), params()
    bad_voice[1] = replace(bad_voice[1], extra={**voice(), "voice": "nobody"})
    clone[1] = replace(clone[1], extra={**voice(), "ref_text": "hello"})

    async def run(p: list) -> list:
        return [o async for o in engine.generate("Hi.", p)]

    try:
        with pytest.raises(InputError, match="nobody"):
            asyncio.run(asyncio.wait_for(run(bad_voice), timeout=120))
        outs = asyncio.run(asyncio.wait_for(run(clone), timeout=120))
        assert outs[-1].error is not None and outs[-1].error.param == "ref_text"
        ok = asyncio.run(asyncio.wait_for(run(params()), timeout=120))  # the engine goes on
        assert ok[-1].error is None and ok[-1].finished
    finally:
        engine.shutdown()
