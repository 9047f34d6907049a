"""`max_tokens` that cannot fit the context is refused with vLLM's 400, not accepted and cut
short by the engine; a request that fits, or names no max_tokens, is served."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.entrypoints.openai.api_server import ServerConfig, build_app

NAME = "tiny"
CONTEXT = 96
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Iterator[AsyncOmni]:
    engine = AsyncOmni(str(tiny_qwen3), device="cpu", max_model_len=CONTEXT)
    yield engine
    engine.shutdown()


def post(engine: AsyncOmni, route: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        app = build_app(engine, ServerConfig(served_model_name=NAME))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(route, json={"model": NAME, **body}, timeout=60)

    return asyncio.run(go())


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_past_the_context_is_a_400(engine: AsyncOmni, field: str) -> None:
    r = post(engine, "/v1/chat/completions", {"messages": USER, field: CONTEXT})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert f"maximum context length is {CONTEXT} tokens" in err["message"], err
    assert f"{CONTEXT} in the completion" in err["message"], err


def test_completions_max_tokens_past_the_context_is_a_400(engine: AsyncOmni) -> None:
    r = post(engine, "/v1/completions", {"prompt": "The capital of France is",
                                         "max_tokens": CONTEXT - 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"


def test_what_fits_is_served(engine: AsyncOmni) -> None:
    r = post(engine, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
    assert r.status_code == 200, r.text
    r = post(engine, "/v1/chat/completions", {"messages": USER})   # no max_tokens: the rest
    assert r.status_code == 200, r.text
    r = post(engine, "/v1/completions", {"prompt": "Paris", "max_tokens": 4})
    assert r.status_code == 200, r.text
