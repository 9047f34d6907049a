"""Issue 25, defects 1 and 2: the work a request costs before it is admitted is bounded, and
the request loop never stalls.

- Media is refused from its header, before decoding: a FLAC whose header claims an hour, a
  PNG whose header claims 8000x8000, a request's images over the pixel budget, a video whose
  frames are too large or too many (the decoders are spied on: never called); a header that
  claims less than the file holds is stopped while decoding.
- A text-only model refuses an image part, too many parts are refused, and a full queue
  answers 429, all before any media is fetched.
- /health answers within its deadline while a long prompt is being prepared (on the old
  code the chat template and the tokenizer ran on the event loop: seconds of stall), and the
  server's shutdown ends the token counter's child process.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.entrypoints.openai.prep_pool import LONG_TEXT_CHARS
from omnistage.testing.fake_engine import FakeTextEngine
from omnistage.stages.info import StageInfo

HEALTH_DEADLINE_S = 0.1
PING_S = 0.02


# ---- media that lies about itself -------------------------------------------------------------

# ---- the app, in process ----------------------------------------------------------------------

def chat(content: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def test_health_answers_while_a_long_prompt_is_prepared(tmp_path: Path) -> None:
    """A 600 kB prompt (its template rendered, then counted in the child process: too long
    for max_model_len 40000, though not so long that its length alone refuses it:
    test_prompt_size.py) is prepared while /health is asked PING_S after each answer."""
    engine = FakeTextEngine(tmp_path)
    engine.orchestrator.stage_info["llm"] = StageInfo(max_model_len=40_000)
    app = build_app(engine, ServerConfig(served_model_name="m"))
    words = "The quick brown fox jumps over the lazy dog. "
    prompt = words * (3 * LONG_TEXT_CHARS // len(words))

    async def go() -> tuple[httpx.Response, list[float], subprocess.Popen]:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=transport, base_url="http://test") as client:
            long = asyncio.ensure_future(client.post("/v1/chat/completions",
                                                     json=chat(prompt), timeout=60))
            latencies, last = [], time.perf_counter()
            while not long.done():
                await asyncio.sleep(PING_S)
                assert (await client.get("/health", timeout=30)).status_code == 200
                # asked PING_S after the last answer (a stalled loop delays the sleep too)
                now = time.perf_counter()
                latencies.append(now - last - PING_S)
                last = now
            return await long, latencies, app.state.client.counter._proc

    try:
        r, latencies, counter = asyncio.run(go())
    finally:
        app.state.client.close()
    assert counter.poll() is not None             # the server's shutdown ended the counter
    # a deadline, not a benchmark: most answers within it, none stalled for long (on a
    # loaded 2-core machine a thread may wait its turn; the old code stalled for seconds)
    assert len(latencies) >= 10, latencies        # the preparation took a while
    assert statistics.quantiles(latencies, n=10)[-1] < HEALTH_DEADLINE_S, latencies
    assert max(latencies) < 10 * HEALTH_DEADLINE_S, latencies
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text
