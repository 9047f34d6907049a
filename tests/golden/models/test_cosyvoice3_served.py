"""Golden: CosyVoice3 streamed through the runtime (AsyncOmni, stages in process): the tiny
served folder (tests/helpers/cosyvoice3.py, greedy LM) speaks in several audio deltas, the
first sent by a flow step whose input was still open (the LM still writing), and the deltas
together are what the flow stage's golden path (`CosyVoice3Generator.speak`, golden against
upstream's stream in test_cosyvoice3_stream.py) gives for the LM's tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import omnistage.generation.cosyvoice3 as gen  # noqa: E402
from omnistage import AsyncOmni, SamplingParams  # noqa: E402
from tests.helpers.cosyvoice3 import write_served  # noqa: E402

HOPS = ["flow_hift.generation.options.token_hop_len=4",
        "flow_hift.generation.options.token_max_hop_len=16"]


def clip(rate: int = 24000, seconds: float = 1.2) -> list[float]:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).tolist()


def test_audio_streams_while_the_lm_writes_and_equals_the_golden_stream(tmp_path, monkeypatch):
    steps: list[tuple[bool, bool]] = []         # (the step's input closed, it sent audio)
    voices: list = []
    real = gen.CosyVoice3Generator.generate

    def spy(self, inputs, states, is_last):
        out = real(self, inputs, states, is_last)
        for x, state, last in zip(out, states, is_last):
            steps.append((last, "audio" in x and x["audio"].numel() > 0))
            if last and not self.has_backlog(state):
                voices.append((self, list(state[gen._TOKENS]), state[gen._VOICE]))
        return out

    monkeypatch.setattr(gen.CosyVoice3Generator, "generate", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # as the server's stage processes (stage_cpu_threads)
    engine = AsyncOmni(str(write_served(tmp_path / "cosyvoice3")), device="cpu",
                       backend="inproc", connector="inproc",
                       stage_overrides=["llm.ar.sampling.temperature=0", *HOPS])
    params = [SamplingParams(temperature=0.0, max_tokens=40, extra={"ref_audio": clip(),
                                                                    "ref_text": "A tone."}), None]
    try:
        async def run() -> list:
            return [o async for o in engine.generate("Hi there.", params)]

        outs = asyncio.run(asyncio.wait_for(run(), timeout=300))
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    deltas = [o.delta_tensors["audio"] for o in outs if "audio" in o.delta_tensors]
    deltas = [d for d in deltas if d.numel()]
    assert len(deltas) >= 3, [d.shape for d in deltas]
    assert (False, True) in steps, "no audio came while the LM still wrote"
    (generator, tokens, voice), = voices
    want = torch.cat(generator.speak(tokens, voice))
    got = torch.cat(deltas)
    assert want.abs().max() > 0.1 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
