"""Issue 37, item 11: a prompt longer than the model could hold is refused by its length,
before anything tokenizes it (a 12 MB prompt cost a minute of CPU in the token counter's
child before its 400). The tokenizer, the engine and the token counter are spied on: none
is called for a refused prompt; a long prompt that may fit is still counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.entrypoints.openai.prep_pool import LONG_TEXT_CHARS, TokenCounter
from omnistage.testing.fake_engine import FakeTextEngine
from omnistage.testing.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

WORDS = "Grüße aus München, 日本語のテキスト and the lazy dog. "


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of texts tokenized (here or in the counter's child); they still run."""
    calls = {"tokenize": 0, "count": 0}
    real_count = TokenCounter.count

    def count(self: TokenCounter, text: str) -> int:
        calls["count"] += 1
        return real_count(self, text)

    monkeypatch.setattr(TokenCounter, "count", count)
    tokenizer_type = type(build_tiny_tokenizer(Path(
        pytest.importorskip("tempfile").mkdtemp())))
    real_call = tokenizer_type.__call__

    def call(self, *args, **kw):
        calls["tokenize"] += 1
        return real_call(self, *args, **kw)

    monkeypatch.setattr(tokenizer_type, "__call__", call)
    return calls


def post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=60)

    try:
        return asyncio.run(go())
    finally:
        app.state.client.close()


def text(num_chars: int) -> str:
    return (WORDS * (num_chars // len(WORDS) + 1))[:num_chars]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}),
    ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": t}]}]}),
    ("/v1/completions", lambda t: {"prompt": t}),
    ("/v1/completions", lambda t: {"prompt": [t, "short"]}),
])
def test_a_prompt_too_long_to_fit_is_refused_untokenized(tmp_path: Path, spies, path: str,
                                                         body) -> None:
    """max_model_len 4096: 3 MB of text cannot fit (a token covers at most 16 characters)."""
    engine = FakeTextEngine(tmp_path, max_model_len=4096,
                            chat_template=CHAT_TEMPLATE)
    app = build_app(engine, ServerConfig(served_model_name="m"))
    r = post(app, path, {"model": "m", "max_tokens": 2, **body(text(3_000_000))})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "prompt_too_long" and "characters" in err["message"], err
    assert spies == {"tokenize": 0, "count": 0} and engine.num_prepared == 0


def test_a_model_without_a_maximum_length_takes_a_bounded_prompt(tmp_path: Path,
                                                                  spies) -> None:
    engine = FakeTextEngine(tmp_path, max_model_len=None,
                            chat_template=CHAT_TEMPLATE)
    app = build_app(engine, ServerConfig(served_model_name="m"))
    r = post(app, "/v1/completions", {"model": "m", "prompt": text(LONG_TEXT_CHARS + 1),
                                      "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert r.json()["error"]["param"] == "prompt"
    assert engine.num_prepared == 0 and spies["tokenize"] == 0
    app = build_app(engine, ServerConfig(served_model_name="m"))
    r = post(app, "/v1/completions", {"model": "m", "prompt": text(LONG_TEXT_CHARS),
                                      "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_long_prompt_that_may_fit_is_counted_first(tmp_path: Path, spies) -> None:
    """Over LONG_TEXT_CHARS but under max_model_len x 16 characters: counted in the child
    (the count says it does not fit: 400), never tokenized here."""
    engine = FakeTextEngine(tmp_path, max_model_len=20_000,
                            chat_template=CHAT_TEMPLATE)
    app = build_app(engine, ServerConfig(served_model_name="m"))
    r = post(app, "/v1/completions", {"model": "m", "prompt": text(LONG_TEXT_CHARS + 1000),
                                      "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert "tokens" in r.json()["error"]["message"]
    assert spies["count"] == 1 and spies["tokenize"] == 0 and engine.num_prepared == 0
