"""A vLLM-Omni stage config (tests/fixtures/vllm_omni/) serves the tiny Qwen3-Omni as our
shipped graph does: the same text and the same speech for the same prompt."""

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


def answer(model: Path, **kw: object) -> tuple[str, np.ndarray]:
    # a greedy talker: the same codes on both graphs (its graph's sampling draws at random)
    with Omni(str(model), device="cpu", stage_overrides=["talker.ar.sampling.temperature=0"],
              **kw) as omni:
        [out] = omni.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                              use_tqdm=False, output_modalities={"text", "audio"})
    assert out.error is None, out.error
    return out.text, np.asarray(out.audio)


def test_qwen3_omni_stage_config_answers_as_the_shipped_graph(tiny_omni: Path) -> None:
    text, audio = answer(tiny_omni)
    text2, audio2 = answer(tiny_omni, stage_configs_path=FIXTURES / "qwen3_omni_moe.yaml")
    assert text2 == text and text
    assert audio.size and np.array_equal(audio2, audio)
