"""The offline API: prompt forms, outputs, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from omnistage import Omni, SamplingParams


@pytest.fixture(scope="module")
def omni(tiny_qwen3: Path) -> Omni:
    return Omni(str(tiny_qwen3), device="cpu")


def test_prompt_forms_and_outputs(omni: Omni) -> None:
    ids = omni.tokenizer("hello world")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    a, b, c = omni.generate(["hello world", {"prompt": "hello world"},
                             {"prompt_token_ids": ids}], params)
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) <= 5
    assert a.prompt == "hello world" and a.prompt_token_ids == ids
    # Text equals decode(), except that bytes of a character left incomplete at the very end
    # are dropped instead of shown as U+FFFD (test_detokenizer covers this in detail).
    decoded = omni.tokenizer.decode(a.token_ids, skip_special_tokens=True)
    assert decoded.startswith(a.text) and "\ufffd" not in a.text
    assert set(decoded[len(a.text):]) <= {"\ufffd"} or "\ufffd" in decoded
    assert len(a.logprobs) == len(a.token_ids)
    for tok, lp in zip(a.token_ids, a.logprobs):
        assert tok in lp and len(lp) in (3, 4)
    m = a.metrics
    assert m.time_to_first_token is not None and m.time_to_first_token > 0
    assert m.num_prompt_tokens == len(ids) and m.num_output_tokens == len(a.token_ids)
    if len(a.token_ids) > 1:
        assert m.tokens_per_s > 0


def test_stop_strings_and_max_tokens(omni: Omni) -> None:
    (full,) = omni.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    if len(full.text) >= 4:
        stop = full.text[2:4]
        (cut,) = omni.generate("abc", SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True, stop=[stop]))
        assert cut.finish_reason == "stop"
        assert cut.text == full.text[: full.text.index(stop)]


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_before_scheduling_and_engine_keeps_serving(omni: Omni) -> None:
    engine = omni.engine
    engine.add_request("bystander", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    too_long = list(range(5)) * (engine.max_model_len // 5 + 1)
    cases = [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": too_long}, "maximum length"),
        ({"prompt_token_ids": [10**9]}, "vocabulary"),
        ({"prompt_token_ids": "abc"}, "list of ints"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
        ({"text": "x"}, "unknown keys"),
        (42, "string or a dict"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            omni.generate(["fine prompt", prompt], SamplingParams(temperature=0))
        assert set(engine.scheduler.requests) == {"bystander"}  # nothing else was scheduled
    with pytest.raises(ValueError, match="output_hidden_layers"):
        omni.generate("x", SamplingParams(output_hidden_layers=(99,)))
    with pytest.raises(ValueError, match="1 stage"):
        omni.generate("x", [None, None])
    outs = []
    while engine.has_unfinished_requests:
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["bystander"] and outs[0].error is None


def test_unknown_model_path_and_architecture(tmp_path: Path, tiny_qwen3: Path) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        Omni(str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises((ValueError, FileNotFoundError), match="not-a/cached-model"):
        Omni("not-a/cached-model", device="cpu")
    odd = tmp_path / "odd"
    shutil.copytree(tiny_qwen3, odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MadeUpForCausalLM"):
        Omni(str(odd), device="cpu")


def test_abort_mid_generation(omni: Omni) -> None:
    engine = omni.engine
    engine.add_request("victim", list(range(1, 40)),
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    out = engine.abort_request("victim")
    assert out.finish_reason.value == "abort"
    assert engine.block_manager.num_free_blocks == engine.kv_layout.num_blocks
    assert engine.abort_request("victim") is None
