"""The offline API: prompt forms, outputs, and clear errors on bad input."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.utils.audio import decode_audio


@pytest.fixture(scope="module")
def omni(tiny_qwen3: Path) -> Omni:
    with Omni(str(tiny_qwen3), device="cpu", backend="inproc", connector="inproc") as omni:
        yield omni


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
    assert a.audio is None and a.sample_rate is None   # a text model writes no audio
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
    events: list = []
    omni.engine.submit({"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       "bystander", None, events.append)
    info = omni.engine.orchestrator.stage_info["llm"]
    too_long = list(range(5)) * (info["max_model_len"] // 5 + 1)
    cases = [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": too_long}, "maximum length"),
        ({"prompt_token_ids": [10**9]}, "vocabulary"),
        ({"prompt_token_ids": "abc"}, "list of ints"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
        ({"text": "x"}, "unknown keys"),
        ({"prompt_embeds": torch.zeros(3, 7)}, "prompt_embeds has shape"),
        (42, "string or a dict"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            omni.generate(["fine prompt", prompt], SamplingParams(temperature=0))
        # nothing but the bystander was ever scheduled
        assert omni.engine.orchestrator.num_requests <= 1
    with pytest.raises(ValueError, match="output_hidden_layers"):
        omni.generate("x", SamplingParams(output_hidden_layers=(99,)))
    with pytest.raises(ValueError, match="1 stage"):
        omni.generate("x", [None, None])
    deadline = time.monotonic() + 30
    while not (events and events[-1].done):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert events[-1].error is None and sum(len(e.token_ids) for e in events) == 30
    stats = omni.engine.orchestrator.stage_stats()["llm"]
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks


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
    async def first_then_leave() -> None:
        async for out in omni.engine.generate(
                {"prompt_token_ids": list(range(1, 40))},
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
            assert out.delta_token_ids
            break

    asyncio.run(first_then_leave())
    deadline = time.monotonic() + 10
    while True:
        stats = omni.engine.orchestrator.stage_stats()["llm"]
        if stats.num_engine_requests == 0:
            break
        assert time.monotonic() < deadline
    assert stats.num_free_blocks == stats.num_blocks


def test_process_backend_matches_inproc(omni: Omni, tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["hello world", {"prompt_token_ids": [5, 6, 7, 8]}]
    ref = omni.generate(prompts, params)
    with Omni(str(tiny_qwen3), device="cpu") as proc:  # the default: a stage process, shm
        got = proc.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Omni:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"))
    # small code2wav chunks: a streamed answer arrives in several audio updates
    with Omni(str(ckpt), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=["code2wav.options.chunk_frames=4",
                               "code2wav.options.first_chunk_frames=4"]) as omni:
        yield omni


SPEECH_CHAT = {"messages": [{"role": "user", "content": "Hello world, how are you?"}]}
SPEECH_PARAMS = [SamplingParams(temperature=0.0, max_tokens=8),
                 SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=30), None]


def test_speech_on_the_output_object(speech: Omni, tmp_path: Path) -> None:
    """Qwen3-Omni's code2wav reports 24 kHz at start-up; the output carries that rate, the
    waveform as numpy, and saves it; a text-only request has neither."""
    (out,) = speech.generate(SPEECH_CHAT, SPEECH_PARAMS)
    assert out.error is None, out.error
    assert out.sample_rate == 24000
    assert out.audio.dtype == np.float32 and out.audio.ndim == 1 and len(out.audio) > 0
    assert np.array_equal(out.audio, out.tensors["audio"].numpy())
    out.save_audio(tmp_path / "answer.wav")
    back, rate = decode_audio((tmp_path / "answer.wav").read_bytes())
    assert rate == 24000 and back.shape == (1, len(out.audio))
    assert np.abs(back[0] - np.clip(out.audio, -1, 1)).max() <= 1e-4
    (text,) = speech.generate(SPEECH_CHAT, SPEECH_PARAMS, output_modalities={"text"})
    assert text.audio is None and text.sample_rate is None and text.text
    with pytest.raises(ValueError, match="produced no audio"):
        text.save_audio(tmp_path / "text.wav")


def test_speech_streams_delta_audio(speech: Omni) -> None:
    async def collect() -> list:
        return [o async for o in speech.engine.generate(SPEECH_CHAT, SPEECH_PARAMS)]

    snaps = asyncio.run(collect())
    final = snaps[-1]
    assert final.finished and final.error is None, final.error
    # the rate is there from the first update on, before any sample: a player can open early
    assert all(s.sample_rate == 24000 for s in snaps)
    with_audio = [s for s in snaps if s.delta_audio is not None]
    assert len(with_audio) >= 2
    for s in snaps:
        if "audio" in s.delta_tensors:
            assert np.array_equal(s.delta_audio, s.delta_tensors["audio"].numpy())
        else:
            assert s.delta_audio is None
    assert all(s.audio is None for s in snaps[:-1])
    assert np.array_equal(np.concatenate([s.delta_audio for s in with_audio]), final.audio)
