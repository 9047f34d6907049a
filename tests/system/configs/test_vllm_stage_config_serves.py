"""A vLLM-Omni stage config serves the tiny Qwen3-Omni and Qwen2.5-Omni as our shipped graphs
do: the same text and the same speech for the same prompt, under the hand-written fixture
(tests/fixtures/vllm_omni/) and under vLLM-Omni's own files (tests/fixtures/vllm_omni/upstream/;
qwen3_omni_moe_async_chunk.yaml's thinker tensor_parallel_size 2 overridden to 1 on the CPU, as
`--stage-override` would)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omnistage.entrypoints.omni import Omni
from omnistage.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm_omni"


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_omni"))


def answer(model: Path, overrides: tuple[str, ...] = (), **kw: object) -> tuple[str, np.ndarray]:
    # a greedy talker: the same codes on both graphs (its graph's sampling draws at random);
    # stages in one process, stepped in turn: the same chunks reach each stage on every run
    with Omni(str(model), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=["talker.ar.sampling.temperature=0", *overrides], **kw) as omni:
        [out] = omni.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                              use_tqdm=False, output_modalities={"text", "audio"})
    assert out.error is None, out.error
    return out.text, np.asarray(out.audio)


@pytest.fixture(scope="module")
def shipped(tiny_omni: Path) -> tuple[str, np.ndarray]:
    return answer(tiny_omni)


@pytest.mark.parametrize("path,overrides", [
    (FIXTURES / "qwen3_omni_moe.yaml", ()),
    (FIXTURES / "upstream" / "qwen3_omni_moe_async_chunk.yaml", ("thinker.parallel.tp=1",)),
], ids=["fixture", "upstream-async-chunk"])
def test_qwen3_omni_stage_config_answers_as_the_shipped_graph(
        tiny_omni: Path, shipped: tuple[str, np.ndarray], path: Path,
        overrides: tuple[str, ...]) -> None:
    """The same text, and speech of the same length within 1e-4: the tiny Qwen3-Omni's speech
    is not bit-reproducible from run to run on the CPU, even under one graph (a process's
    first answer differs from its later ones by ~1e-5; seen 2026-11-28)."""
    text, audio = shipped
    text2, audio2 = answer(tiny_omni, overrides, stage_configs_path=path)
    assert text2 == text and text
    assert audio.size and audio2.shape == audio.shape
    assert float(np.abs(audio2 - audio).max()) < 1e-4


@pytest.fixture(scope="module")
def tiny_omni25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni

    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni25"))


@pytest.mark.parametrize("name", ["qwen2_5_omni.yaml", "qwen2_5_omni_async_chunk.yaml"])
def test_qwen2_5_omni_stage_config_answers_as_the_shipped_graph(tiny_omni25: Path,
                                                                name: str) -> None:
    """vLLM-Omni's own Qwen2.5-Omni files (its code2wav is our token2wav): greedy thinker and
    talker, the same text and speech as the shipped graph, within 1e-4: the file's
    enforce_eager (no overlapped decode steps) changes when codes reach the streamed token2wav,
    which moves its samples by float noise (async_chunk's file, async_scheduling false: exact)."""
    params = [SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=40,
                             extra={"speaker": "Ethan"}), None]

    def speak(**kw: object) -> tuple[str, np.ndarray]:
        with Omni(str(tiny_omni25), device="cpu", backend="inproc", connector="inproc",
                  **kw) as omni:
            [out] = omni.generate([PROMPT], params, use_tqdm=False,
                                  output_modalities={"text", "audio"})
        assert out.error is None, out.error
        return out.text, np.asarray(out.audio)

    text, audio = speak()
    text2, audio2 = speak(stage_configs_path=FIXTURES / "upstream" / name)
    assert text2 == text and text
    assert audio.size and audio2.shape == audio.shape
    assert float(np.abs(audio2 - audio).max()) < 1e-4
