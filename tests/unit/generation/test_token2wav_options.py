"""token2wav's `dit_quantization` options read strictly from a stage's `generation.options`
(and from bench omni25's `--stage-override`s, which name them the same way): the methods it
takes, a misspelt one answered with the choices, a bad width with its rule."""

from __future__ import annotations

import pytest

from omnistage.benchmarks.omni25 import token2wav_options
from omnistage.configs.options import read_options
from omnistage.configs.strict import ConfigError
from omnistage.generation.token2wav import Token2WavOptions
from omnistage.layers.fp8 import MIN_FEATURES

WHERE = "stage 'token2wav': generation.options"


@pytest.mark.parametrize("method", ["none", "fp8", "int8"])
def test_methods_read(method: str) -> None:
    o = read_options(Token2WavOptions, {"dit_quantization": method}, WHERE)
    assert o.dit_quantization == method and o.dit_quantization_min_features == MIN_FEATURES


def test_default_is_unquantized() -> None:
    assert Token2WavOptions().dit_quantization == "none"


@pytest.mark.parametrize("data, message", [
    ({"dit_quantization": "fp4"}, "dit_quantization"),
    ({"dit_quantisation": "fp8"}, "unknown key (did you mean dit_quantization?)"),
    ({"dit_quantization_min_features": 0}, "dit_quantization_min_features=0: must be >= 1"),
])
def test_bad_values_name_the_option(data: dict, message: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as err:
        read_options(Token2WavOptions, data, WHERE)
    assert message in str(err.value)


def test_bench_overrides_become_options() -> None:
    """Bench omni25 measures the waveform SNR of the token2wav its stage overrides name."""
    o = token2wav_options(["token2wav.generation.options.dit_quantization=fp8",
                           "token2wav.generation.options.chunk_blocks=8",
                           "thinker.ar.max_graph_tokens=0"])
    assert o == Token2WavOptions(dit_quantization="fp8", chunk_blocks=8)
    with pytest.raises(ConfigError, match="dit_quantization"):
        token2wav_options(["token2wav.generation.options.dit_quantization=fp16"])
