"""The text routes end to end with the official `openai` client against a real server: chat
(streamed and not), completions, logprobs, auth, the queue bound, and aborts on disconnect."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

CHAT_MODEL = "tiny-chat"   # the text server's --served-model-name (conftest)

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(text_server: Server) -> None:
    client = text_server.openai()
    (card,) = client.models.list().data
    assert card.id == CHAT_MODEL and card.max_model_len == 512
    assert client.models.retrieve(CHAT_MODEL).id == CHAT_MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_applies_the_template_and_matches_completions(text_server: Server,
                                                           tiny_qwen3: Path) -> None:
    client = text_server.openai()
    chat = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=12,
                                          temperature=0)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    # the same prompt rendered here with the tokenizer's chat template, sent raw, answers alike
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    raw = client.completions.create(model=CHAT_MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert raw.choices[0].text == choice.message.content
    assert chat.usage.prompt_tokens == len(ids) == raw.usage.prompt_tokens
    assert chat.usage.completion_tokens == raw.usage.completion_tokens >= 1
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_chat_streamed_equals_not_streamed(text_server: Server) -> None:
    client = text_server.openai()
    kw = dict(model=CHAT_MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["length"] == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1
    # without include_usage no usage chunk
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason


def test_openai_fields_without_effect_here_are_accepted_and_logged(text_server: Server
                                                                   ) -> None:
    """Fields OpenAI documents for chat that change nothing here answer as without them (the
    tiny chat template has no reasoning switch, so reasoning_effort is one of them)."""
    client = text_server.openai()
    kw = dict(model=CHAT_MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw)
    extra = client.chat.completions.create(
        **kw, reasoning_effort="low", verbosity="low", service_tier="auto",
        safety_identifier="user-1", prompt_cache_key="k", store=True, metadata={"a": "b"},
        user="someone", extra_body={"mm_processor_kwargs": {"use_audio_in_video": False}})
    assert extra.choices[0].message.content == plain.choices[0].message.content
    log = text_server.log.read_text()
    for name in ("reasoning_effort", "verbosity", "service_tier", "safety_identifier",
                 "prompt_cache_key", "store", "metadata", "user"):
        assert f"{name}: accepted and ignored" in log, name


def test_seeded_sampling_repeats_and_stop_strings_cut(text_server: Server) -> None:
    client = text_server.openai()
    kw = dict(model=CHAT_MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    if len(a) >= 6:
        stop = a[3:6]
        cut = client.chat.completions.create(**kw, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == a[:a.index(stop)]


def test_chat_logprobs(text_server: Server) -> None:
    out = text_server.openai().chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:   # greedy: the chosen token is the most likely one
        assert 3 <= len(entry.top_logprobs) <= 4 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))


def test_completions_prompt_forms_batches_and_streaming(text_server: Server) -> None:
    client = text_server.openai()
    one = client.completions.create(model=CHAT_MODEL, prompt="Hello world", max_tokens=6,
                                    temperature=0)
    batch = client.completions.create(model=CHAT_MODEL, prompt=["Hello world", "The sun"],
                                      max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text
    assert batch.usage.prompt_tokens > one.usage.prompt_tokens
    assert batch.usage.completion_tokens <= 12
    streamed = list(client.completions.create(model=CHAT_MODEL, prompt="Hello world",
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == one.choices[0].text
    echo = client.completions.create(model=CHAT_MODEL, prompt="Hello world", max_tokens=6,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == "Hello world" + one.choices[0].text
    lp = client.completions.create(model=CHAT_MODEL, prompt="Hello world", max_tokens=4,
                                   temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == lp.usage.completion_tokens


def test_n_choices_chat_and_completions(text_server: Server) -> None:
    """n completions come back as n choices (seeded: choice i samples with seed + i, so
    choice 0 is the n=1 answer); streamed, each chunk names its choice's index; a batch of
    prompts with n gives choice i * n + j to prompt i's completion j."""
    client = text_server.openai()
    kw = dict(model=CHAT_MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    one = client.chat.completions.create(**kw)
    assert full.choices[0].message.content == one.choices[0].message.content
    assert len({c.message.content for c in full.choices}) > 1
    assert full.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(**kw, n=3, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks
                     if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.message.content for c in full.choices]
    ends = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1, 2]
    cmpl = client.completions.create(model=CHAT_MODEL, prompt=["Hello", "The cat"], n=2,
                                     max_tokens=4, temperature=0)
    assert [c.index for c in cmpl.choices] == [0, 1, 2, 3]
    assert cmpl.choices[0].text == cmpl.choices[1].text     # greedy: alike
    streamed = list(client.completions.create(model=CHAT_MODEL, prompt=["Hello", "The cat"],
                                              n=2, max_tokens=4, temperature=0, stream=True))
    for choice in cmpl.choices:
        assert "".join(c.choices[0].text for c in streamed
                       if c.choices[0].index == choice.index) == choice.text


def test_api_key_is_required_on_all_but_health_and_the_page(text_server: Server) -> None:
    url = text_server.url
    body = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 2}
    key = text_server.api_key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200      # open without a key
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        assert text_server.get(path).status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        text_server.openai(api_key="nope").models.list()


def test_burst_beyond_the_queue_bound_gets_429_and_the_rest_completes(text_server: Server
                                                                      ) -> None:
    n, bound = 10, 4
    body = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    results: list[httpx.Response | None] = [None] * n
    barrier = threading.Barrier(n)

    def send(i: int) -> None:
        barrier.wait()
        results[i] = text_server.post("/v1/chat/completions", json=body)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = [r.status_code for r in results]
    accepted = [r for r in results if r.status_code == 200]
    rejected = [r for r in results if r.status_code == 429]
    assert len(accepted) + len(rejected) == n, codes
    assert bound <= len(accepted) < n and rejected, codes
    for r in rejected:
        assert r.headers["Retry-After"].isdigit()
        assert r.json()["error"]["code"] == "queue_full"
    for r in accepted:
        assert r.json()["usage"]["completion_tokens"] == 400
    m = text_server.metrics()
    assert m[("omnistage_requests_in_flight", ())] == 0
    assert m[("omnistage_http_requests_total",
              (("route", "/v1/chat/completions"), ("status", "429")))] >= len(rejected)


def _stage_state(server: Server) -> tuple[float, float, float, float, float]:
    m = server.metrics()
    get = lambda name, **labels: m.get((name, tuple(sorted(labels.items()))), -1.0)  # noqa: E731
    return (get("omnistage_stage_queue_length", stage="llm"),
            get("omnistage_stage_engine_requests", stage="llm"),
            get("omnistage_stage_kv_blocks", stage="llm", state="free"),
            get("omnistage_stage_kv_blocks", stage="llm", state="total"),
            m.get(("omnistage_requests_finished_total", (("finish_reason", "abort"),)), 0.0))


def test_disconnect_mid_stream_aborts_the_request_in_every_stage(text_server: Server) -> None:
    *_, aborts_before = _stage_state(text_server)
    body = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{text_server.url}/v1/chat/completions", json=body,
                         headers=text_server.headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert len(got) >= 2
            queued, running, *_ = _stage_state(text_server)
            assert queued == 1 and running == 1     # it is in the stage right now
    # the connection is closed: the request leaves every stage, its KV blocks come back
    deadline = time.monotonic() + 20
    while True:
        queued, running, free, total, aborts = _stage_state(text_server)
        if (queued, running) == (0, 0) and free == total and aborts == aborts_before + 1:
            break
        assert time.monotonic() < deadline, (queued, running, free, total, aborts)
        time.sleep(0.1)
    # and the server goes on serving
    out = text_server.openai().chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,
                                                       max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_disconnect_while_waiting_for_a_whole_answer_aborts_too(text_server: Server) -> None:
    *_, aborts_before = _stage_state(text_server)
    body = {"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes the connection
        text_server.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.15))
    deadline = time.monotonic() + 20
    while True:
        queued, running, free, total, aborts = _stage_state(text_server)
        if (queued, running) == (0, 0) and free == total and aborts == aborts_before + 1:
            break
        assert time.monotonic() < deadline, (queued, running, free, total, aborts)
        time.sleep(0.1)


def test_metrics_report_latency_step_time_and_tokens(text_server: Server) -> None:
    text_server.openai().chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,
                                                 max_tokens=8, extra_body={"ignore_eos": True})
    m = text_server.metrics()
    assert m[("omnistage_time_to_first_token_seconds_count", ())] >= 1
    assert m[("omnistage_stage_step_seconds_count", (("stage", "llm"),))] >= 1
    assert m[("omnistage_stage_step_seconds_sum", (("stage", "llm"),))] > 0
    assert m[("omnistage_generation_tokens_total", ())] >= 8
    assert m[("omnistage_request_tokens_per_second_count", ())] >= 1
    assert m[("omnistage_engine_healthy", ())] == 1
