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
    too_long = list(range(5)) * (info.max_model_len // 5 + 1)
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
    # the default: a stage process, shm; a vLLM keyword reaches the stage
    with Omni(str(tiny_qwen3), device="cpu", max_model_len=96) as proc:
        assert proc.engine.orchestrator.stage_info["llm"].max_model_len == 96
        got = proc.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Omni:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"))
    # small code2wav chunks: a streamed answer arrives in several audio updates
    with Omni(str(ckpt), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=["code2wav.generation.options.chunk_frames=4",
                               "code2wav.generation.options.first_chunk_frames=4"]) as omni:
        yield omni


SPEECH_CHAT = {"messages": [{"role": "user", "content": "Hello world, how are you?"}]}
SPEECH_PARAMS = [SamplingParams(temperature=0.0, max_tokens=8),
                 SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=30), None]


def test_speech_on_the_output_object(speech: Omni, tmp_path: Path) -> None:
    """Qwen3-Omni's code2wav reports 24 kHz at start-up; the output carries that rate, the
    waveform as numpy, and saves it; a text-only request has neither."""
    (out,) = speech.chat(SPEECH_CHAT["messages"], SPEECH_PARAMS)   # = generate(SPEECH_CHAT)
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
    with pytest.raises(ValueError, match="applies its own chat template"):
        speech.chat(SPEECH_CHAT["messages"], SPEECH_PARAMS, chat_template="{{ 1 }}")


def test_speech_streams_delta_audio(speech: Omni) -> None:
    async def collect() -> list:
        return [o async for o in speech.engine.generate(SPEECH_CHAT, SPEECH_PARAMS)]

    snaps = asyncio.run(collect())
    final = snaps[-1]
    assert final.finished and final.error is None, final.error
    # the rate is there from the first update on, before any sample: a player can open early
    assert all(s.sample_rate == 24000 for s in snaps)
    assert all(s.has_delta for s in snaps[:-1])      # no empty update
    with_audio = [s for s in snaps if s.delta_audio is not None]
    assert len(with_audio) >= 2
    for s in snaps:
        if "audio" in s.delta_tensors:
            assert np.array_equal(s.delta_audio, s.delta_tensors["audio"].numpy())
        else:
            assert s.delta_audio is None
    assert all(s.audio is None for s in snaps[:-1])
    assert np.array_equal(np.concatenate([s.delta_audio for s in with_audio]), final.audio)


# -- the API as vLLM users write it ------------------------------------------------------------

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello world"}]


def test_chat_on_a_text_model(omni: Omni) -> None:
    """chat() renders the tokenizer's chat template (as vLLM's LLM.chat) and answers as the
    same token ids sent raw; a list of conversations is a batch, in order."""
    params = SamplingParams(temperature=0, max_tokens=6)
    text = omni.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = omni.tokenizer(text, add_special_tokens=False)["input_ids"]
    (raw,) = omni.generate({"prompt_token_ids": ids}, params)
    (one,) = omni.chat(CHAT, params)
    assert one.prompt == text and one.prompt_token_ids == ids
    assert one.token_ids == raw.token_ids and one.text == raw.text
    other = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    batch = omni.chat([other, CHAT], params)
    assert batch[1].token_ids == raw.token_ids and batch[0].prompt.endswith(
        "user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n")
    # continuing the assistant's message, and a template of the caller's own
    (cont,) = omni.chat([*CHAT, {"role": "assistant", "content": "Sure"}], params,
                        add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("assistant\nSure")
    (own,) = omni.chat(CHAT, params, chat_template="{{ messages[-1]['content'] }}!")
    assert own.prompt == "Hello world!"

    async def stream() -> str:
        return "".join([o.delta_text async for o in omni.engine.generate({"messages": CHAT},
                                                                          params)])

    assert asyncio.run(stream()) == raw.text      # AsyncOmni takes {"messages": ...} too


@pytest.mark.parametrize("messages, kwargs, message", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     r"messages\[0\].content\[0\]: this model takes text only"),
    ([], {}, "non-empty list"),
    ([{"content": "no role"}], {}, "string 'role'"),
    (CHAT, {"continue_final_message": True}, "set one of them"),
    (CHAT, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    (CHAT, {"chat_template": "{{ raise_exception('no system role') }}"}, "no system role"),
])
def test_bad_chat_raises_before_scheduling(omni: Omni, messages: list, kwargs: dict,
                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        omni.chat(messages, SamplingParams(max_tokens=2), **kwargs)
    assert omni.engine.orchestrator.num_requests == 0


def test_sampling_params_one_object_or_per_stage(omni: Omni) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    a = omni.generate("hello world", params)[0].token_ids
    assert omni.generate("hello world", [params])[0].token_ids == a
    assert omni.generate("hello world", sampling_params=params)[0].token_ids == a
    assert omni.generate("hello world", sampling_params_list=[params])[0].token_ids == a
    with pytest.raises(TypeError, match="not both"):
        omni.generate("hello world", params, sampling_params_list=[params])


def test_n_completions(omni: Omni) -> None:
    """n seeded completions: completion i is what n=1 gives with seed + i, in
    out.outputs[i]; out.text is the first's; greedy ones are all alike."""
    kw = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    (out,) = omni.generate("hello world", SamplingParams(n=3, seed=5, **kw))
    alone = [omni.generate("hello world", SamplingParams(seed=5 + i, **kw))[0]
             for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.text == alone[0].text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1      # distinct seeds, distinct draws
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    assert out.metrics.num_output_tokens == 24
    greedy = omni.generate(["abc", "hello"], SamplingParams(n=2, temperature=0, max_tokens=5))
    assert all(o.outputs[0].token_ids == o.outputs[1].token_ids for o in greedy)
    assert omni.engine._fan_outs == {}          # forgotten once done


def test_n_streams_by_index_and_aborts_every_completion(omni: Omni) -> None:
    params = SamplingParams(n=2, seed=1, max_tokens=6, ignore_eos=True)

    async def collect() -> list:
        return [o async for o in omni.engine.generate("hello", params)]

    snaps = asyncio.run(collect())
    # no empty update: each adds tokens to its completion, or ends it
    assert all(s.outputs[s.index].has_delta or s.outputs[s.index].finished for s in snaps)
    assert {s.index for s in snaps} == {0, 1} and snaps[-1].finished
    for i in range(2):
        ids = [t for s in snaps for t in s.outputs[i].delta_token_ids]
        assert ids == snaps[-1].outputs[i].token_ids and len(ids) == 6

    async def leave_early() -> None:
        async for _ in omni.engine.generate("hello", SamplingParams(
                n=3, max_tokens=200, ignore_eos=True)):
            break

    asyncio.run(leave_early())
    deadline = time.monotonic() + 10
    while omni.engine.orchestrator.stage_stats()["llm"].num_engine_requests:
        assert time.monotonic() < deadline
    assert omni.engine.orchestrator.num_requests == 0


def test_n_on_another_stage_than_the_entry_is_refused(speech: Omni) -> None:
    with pytest.raises(ValueError, match="SamplingParams.n=2 on stage 'talker'"):
        speech.generate(SPEECH_CHAT, [SPEECH_PARAMS[0], SamplingParams(n=2), None])


def test_progress_bar_over_a_batch(omni: Omni, capsys: pytest.CaptureFixture) -> None:
    params = SamplingParams(temperature=0, max_tokens=3)
    omni.generate(["a", "b"], params)
    err = capsys.readouterr().err            # not a terminal: plain lines, no bar frames
    assert "Processed prompts: 2 in " in err and "\r" not in err, err
    omni.generate("a", params)                       # one prompt: progress too
    assert "Processed prompts: 1 in " in capsys.readouterr().err
    omni.generate(["a", "b"], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_progress_bar_on_a_terminal(omni: Omni, capsys: pytest.CaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    omni.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=3))
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "2/2" in err and "tok/s" in err


def test_progress_bar_moves_with_diffusion_steps(capsys: pytest.CaptureFixture) -> None:
    """A request's step progress moves the bar by its share; finishing completes it."""
    import queue

    from omnistage.entrypoints.omni import _wait
    from omnistage.outputs import OmniOutput, RequestEvent

    outputs = {"r": OmniOutput("r", "seven", [])}
    events: queue.Queue = queue.Queue()
    for p in (0.25, 0.5):
        events.put(RequestEvent("r", "dit", progress=p))
    events.put(RequestEvent("r", "dit", done=True, finish_reason="stop"))
    _wait(outputs, events, show_bar=True)
    assert outputs["r"].finished and outputs["r"].progress == 0.5
    err = capsys.readouterr().err
    assert "Processed prompts: 1 in " in err, err   # instant: the closing line only


def test_vllm_engine_keywords(tiny_qwen3: Path) -> None:
    """vLLM's keywords set the main stage (capacity) or every stage (dtype, seed, eager);
    explicit stage overrides win; others are refused naming the keyword."""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.engine.engine_args import apply_keywords

    graph = resolve_graph(None, None, "qwen3_omni")
    keywords = {"gpu_memory_utilization": 0.6, "max_model_len": 4096, "max_num_seqs": 8,
                "dtype": "float32", "enforce_eager": True, "seed": 3,
                "trust_remote_code": False}
    got = apply_keywords(graph, keywords, ["thinker.ar.max_num_seqs=4"])
    thinker, talker = got.stage("thinker"), got.stage("talker")
    assert (thinker.placement.memory_fraction, thinker.ar.max_model_len,
            thinker.ar.max_num_seqs) == (0.6, 4096, 4)
    assert (talker.placement.memory_fraction, talker.ar.max_model_len) == (0.12, None)
    assert all(s.dtype == "float32" for s in got.stages)
    assert all(s.ar.enforce_eager and s.ar.seed == 3 for s in got.stages if s.kind == "ar")
    assert apply_keywords(graph, {"max_model_len": None}) is graph
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean 'max_num_seqs'"):
        Omni(str(tiny_qwen3), device="cpu", max_num_seq=4)
    tp = apply_keywords(graph, {"tensor_parallel_size": 2}).stage("thinker")
    assert (tp.parallel.tp, tp.placement.devices) == (2, (0, 1))
    on_ray = apply_keywords(graph, {"worker_backend": "ray", "ray_address": "10.0.0.1:6379"})
    assert (on_ray.backend, on_ray.ray_address, on_ray.connector_kind) == (
        "ray", "10.0.0.1:6379", "auto")
    with pytest.raises(TypeError, match=r"pipeline_parallel_size=2 .*split the model"):
        Omni(str(tiny_qwen3), device="cpu", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="memory_fraction"):
        Omni(str(tiny_qwen3), device="cpu", gpu_memory_utilization=1.5)


def test_empty_updates_are_not_yielded() -> None:
    """An event that adds no text, tokens or tensors (a stage's bare finish, say) is folded
    in but not yielded; the final update always is."""
    from types import SimpleNamespace

    from omnistage.configs.schema import GraphConfig, StageConfig
    from omnistage.engine.async_omni import AsyncOmni
    from omnistage.engine.inputs import ParsedPrompt
    from omnistage.outputs import RequestEvent

    def add_request(rid: str, ids: list, params: dict, sink, *args, **kw) -> set[str]:
        for ev in (RequestEvent(rid, "llm", [5], "a"), RequestEvent(rid, "llm"),
                   RequestEvent(rid, "llm", [6], "b"), RequestEvent(rid, "llm", tensors={}),
                   RequestEvent(rid, "llm", stage_finished=True, finish_reason="stop"),
                   RequestEvent(rid, "llm", done=True)):
            sink(ev)
        return {"llm"}

    engine = AsyncOmni.__new__(AsyncOmni)
    engine.graph = GraphConfig(stages=(StageConfig(name="llm", kind="ar", final="text"),))
    engine.entry, engine._fan_outs = ["llm"], {}
    engine.orchestrator = SimpleNamespace(stage_info={}, add_request=add_request,
                                          abort=lambda rid: None)
    engine.prepare = lambda request: (ParsedPrompt("x", [1], None), {"llm": None})

    async def collect() -> list:
        return [o async for o in engine.generate("x")]

    snaps = asyncio.run(collect())
    assert [s.delta_text for s in snaps] == ["a", "b", ""]
    assert snaps[-1].finished and snaps[-1].text == "ab" and snaps[-1].finish_reason == "stop"
