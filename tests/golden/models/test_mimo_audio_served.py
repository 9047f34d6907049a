"""Golden: MiMo-Audio's speech streamed through the runtime (AsyncOmni, the shipped graph, stages
in process) on the tiny servable folder (tests/helpers/mimo_audio.py): two requests at once,
of different lengths, each speaks in several audio deltas, the first sent while the LLM still
writes (a decoder step whose input was open, and by the stages' clocks), and each request's
deltas are, chunk for chunk, the golden stream (mimo_audio_stream.stream_decode, measured
against the whole decode in test_mimo_audio_stream.py) of the frames its LLM spoke; the LLM's
frames are golden against upstream (test_mimo_audio_engine.py; tests/system/entrypoints/openai/
test_mimo_audio_server.py compares served audio with upstream-layout generate + this stream)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import omnistage.generation.mimo_audio as gen
from omnistage import AsyncOmni, SamplingParams
from omnistage.generation.mimo_audio_stream import stream_decode
from tests.helpers.mimo_audio import build_tiny_mimo_audio

OPTIONS = ["decoder.generation.options.chunk_frames=8",
           "decoder.generation.options.first_chunk_frames=4"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo_audio") / "model", 0.25)


def test_speech_streams_while_the_llm_writes(folder: Path, monkeypatch) -> None:
    steps: list[tuple[bool, bool]] = []         # (the step's input closed, it sent audio)
    spoken: dict[int, tuple] = {}               # id(state) -> (generator, its frames)
    real = gen.MiMoAudioGenerator.generate

    def spy(self, inputs, states, is_last):
        out = real(self, inputs, states, is_last)
        for x, state, last in zip(out, states, is_last):
            steps.append((last, bool(x)))
            spoken[id(state)] = (self, state["stream"].codes)
        return out

    monkeypatch.setattr(gen.MiMoAudioGenerator, "generate", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # as the server's stage processes (stage_cpu_threads)
    engine = AsyncOmni(str(folder), device="cpu", backend="inproc", connector="inproc",
                       stage_overrides=OPTIONS)

    async def one(text: str, max_tokens: int) -> list:
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens), None]
        return [o async for o in engine.generate(text, params, output_modalities={"audio"})]

    async def both() -> list[list]:
        return await asyncio.gather(one("Hello world.", 40), one("Good day to you.", 28))
    try:
        outs = asyncio.run(asyncio.wait_for(both(), timeout=300))
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    assert (False, True) in steps, "no audio came while the LLM still wrote"
    streams = list(spoken.values())
    assert len(streams) == 2
    for events in outs:
        deltas = [o.delta_tensors["audio"] for o in events if "audio" in o.delta_tensors]
        deltas = [d for d in deltas if d.numel()]
        assert len(deltas) >= 3, [d.shape for d in deltas]
        sm = events[-1].stage_metrics
        assert sm["decoder"].first_output_time < sm["llm"].finished_time
        assert sm["decoder"].num_outputs == len(deltas)
        assert any(_is_stream_of(deltas, g, codes) for g, codes in streams), \
            "the deltas are no request's golden stream"


def _is_stream_of(deltas: list[torch.Tensor], g: gen.MiMoAudioGenerator,
                  codes: torch.Tensor) -> bool:
    want = stream_decode(g.model, codes, g.chunking)
    if [w.numel() for w in want] != [d.numel() for d in deltas]:
        return False
    assert float(torch.cat(want).abs().max()) > 0.01
    return all(bool((d.float() - w.float()).abs().max() <= 1e-6) for d, w in zip(deltas, want))
