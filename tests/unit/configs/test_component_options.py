"""Each component's `options:` is a typed record (configs/options.py): read strictly when its
stage is built, a misspelt key answered with the one meant, a wrong type with the expected
one, a bad value with its rule."""

from __future__ import annotations

import pytest

from omnistage.configs.options import NoOptions, read_options
from omnistage.configs.strict import ConfigError
from omnistage.diffusion.pipelines.sd3 import SD3Options, SkipLayerGuidance
from omnistage.generation.code2wav import Code2WavOptions
from omnistage.generation.token2wav import Token2WavOptions
from omnistage.stages.qwen3_omni import CodePredictorOptions
from omnistage.testing.toy_tts import ToySpeakerOptions

WHERE = "stage 'x': generation.options"


def test_records_read_with_their_types() -> None:
    assert read_options(Code2WavOptions, {"chunk_frames": 8, "first_chunk_frames": 2}, WHERE) \
        == Code2WavOptions(chunk_frames=8, first_chunk_frames=2)
    t2w = read_options(Token2WavOptions, {"guidance_scale": 1, "chunk_blocks": 0}, WHERE)
    assert t2w.guidance_scale == 1.0 and isinstance(t2w.guidance_scale, float)
    assert read_options(CodePredictorOptions, {}, WHERE).code_predictor_cuda_graphs is True
    slg = read_options(SD3Options, {"skip_layer_guidance": {"layers": [7, 8], "stop": 0.3}},
                       WHERE).skip_layer_guidance
    assert slg == SkipLayerGuidance(layers=(7, 8), stop=0.3)
    assert read_options(ToySpeakerOptions, {"step_delay_s": 0.5}, WHERE).step_delay_s == 0.5
    assert read_options(NoOptions, {}, WHERE) == NoOptions()


@pytest.mark.parametrize("record, data, message", [
    (Code2WavOptions, {"chunk_frame": 8},
     "generation.options.chunk_frame: unknown key (did you mean chunk_frames?)"),
    (CodePredictorOptions, {"code_predictor_cuda_graph": False},
     "options.code_predictor_cuda_graph: unknown key (did you mean code_predictor_cuda_graphs?)"),
    (Code2WavOptions, {"chunk_frames": "25"},
     "generation.options.chunk_frames: expected an integer, got str"),
    (Code2WavOptions, {"chunk_frames": 0}, "chunk_frames=0: must be >= 1"),
    (Token2WavOptions, {"num_steps": 1}, "num_steps=1: must be >= 2"),
    (Token2WavOptions, {"first_chunk_blocks": 0},
     "first_chunk_blocks must be >= 1"),                 # the windows, checked at load
    (SD3Options, {"skip_layer_guidance": {"layers": [], "scale": 2.8}},
     "skip_layer_guidance.layers: empty"),
    (SD3Options, {"skip_layer_guidance": {"layer": [1]}},
     "skip_layer_guidance.layer: unknown key (did you mean layers?)"),
    (NoOptions, {"chunk_frames": 4}, "chunk_frames: unknown key (it takes none)"),
])
def test_bad_options_name_their_path(record: type, data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        read_options(record, data, WHERE)
    assert message in str(err.value) and str(err.value).startswith("stage 'x'")
