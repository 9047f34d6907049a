"""SamplingParams checks its fields at the boundary and normalises list inputs."""

from __future__ import annotations

import math

import pytest

from omnistage.errors import InputError
from omnistage.ranges import numeric_fields
from omnistage.sampling_params import (MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
                                       SamplingParams)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -3.0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("stop", ("ok", "")),
    ("stop_token_ids", (1, -1)),
    ("output_hidden_layers", (0, -1)),
    ("n", 0),
    ("n", 2.0),
    ("n", True),
])
def test_bad_field_raises_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens=.*max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


@pytest.mark.parametrize("kwargs", [
    {},
    {"temperature": 0.0},
    {"temperature": 1.7, "top_p": 1.0, "top_k": 50, "min_p": 1.0},
    {"top_k": -1, "top_p": 1e-6},
    {"repetition_penalty": 1e-3, "presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"max_tokens": 1, "min_tokens": 1},
    {"max_tokens": None},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": 0, "stop": ("\n",), "stop_token_ids": (0,), "output_hidden_layers": (0, 3)},
])
def test_good_values_pass(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_defaults_are_vllm_like() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert not p.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy


def test_list_inputs_are_normalised_to_tuples() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2],  # type: ignore[arg-type]
                       output_hidden_layers=[3])  # type: ignore[arg-type]
    assert (p.stop, p.stop_token_ids, p.output_hidden_layers) == (("a", "b"), (1, 2), (3,))
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert p == SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2), output_hidden_layers=(3,))
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2),
                                          output_hidden_layers=(3,), extra={"x": 1}))


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_n_completions_and_their_params() -> None:
    """n completions run as n requests: completion i gets n=1 and seed + i (completion 0 is
    the n=1 request); unseeded stays unseeded, DiffusionParams seeds move alike."""
    from omnistage.diffusion.params import DiffusionParams
    from omnistage.engine.async_omni import completion_params

    params = {"llm": SamplingParams(n=3, seed=10, temperature=0.7), "talker": SamplingParams(),
              "dit": DiffusionParams(seed=5), "code2wav": None}
    got = [completion_params(params, i) for i in range(3)]
    assert [g["llm"].seed for g in got] == [10, 11, 12] and all(g["llm"].n == 1 for g in got)
    assert all(g["llm"].temperature == 0.7 for g in got)
    assert all(g["talker"].seed is None for g in got)
    assert [g["dit"].seed for g in got] == [5, 6, 7]
    assert all(g["code2wav"] is None for g in got)


@pytest.mark.parametrize("field", sorted(numeric_fields(SamplingParams)))
@pytest.mark.parametrize("value", [2**64, -2**64, float("nan"), float("inf"), True, "1"])
def test_every_numeric_field_is_checked_for_kind_finiteness_and_range(field: str,
                                                                      value: object) -> None:
    """Every numeric field has a range (ranges.py): past 64 bits, non-finite and mistyped
    values are an InputError naming it, items of a tuple field included."""
    tuple_field = SamplingParams.__dataclass_fields__[field].type.startswith("tuple")
    with pytest.raises(InputError, match=field) as err:
        SamplingParams(**{field: (value,) if tuple_field else value})
    assert err.value.param == field


def test_stop_lists_have_the_apis_limits() -> None:
    """The limits the OpenAI fields have hold here, so per-stage overrides meet them too."""
    SamplingParams(stop=["x"] * MAX_STOP, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    for kwargs in ({"stop": ["x"] * (MAX_STOP + 1)}, {"stop": ["y" * (MAX_STOP_CHARS + 1)]},
                   {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}):
        with pytest.raises(InputError, match=next(iter(kwargs))) as err:
            SamplingParams(**kwargs)
        assert len(str(err.value)) < 200       # the message shows the start of a long list
