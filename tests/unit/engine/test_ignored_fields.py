"""One way to say a field was accepted and ignored: `ignore(name, why)` logs it once per
process and names it to the request's collector (`collect_ignored`), which the server's
middleware turns into the X-Omnistage-Ignored header; Qwen-Image's own list of what it
ignores (`unused_params`), the cases diffusers warns about."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading

import httpx
import pytest
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.qwen_image import check_text_params, unused_params
from omnistage.engine.request import collect_ignored, ignore
from omnistage.entrypoints.openai.ignored_header import IgnoredHeader


def test_names_are_collected_once_each_in_order() -> None:
    ignore("outside_any_request", "nobody collects it")
    with collect_ignored() as names:
        ignore("flow_shift", "x")
        ignore("boundary_ratio", "x")
        ignore("flow_shift", "x")
        with collect_ignored() as inner:       # a nested collector takes its own
            ignore("user", "x")
        ignore("seed_unused", "x")
    assert names == ["flow_shift", "boundary_ratio", "seed_unused"] and inner == ["user"]


def test_threads_that_copy_the_context_report_to_it() -> None:
    with collect_ignored() as names:
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(ignore, "in_thread", "x"))
        thread.start()
        thread.join()
        bare = threading.Thread(target=ignore, args=("bare_thread", "x"))   # no context: log only
        bare.start()
        bare.join()
    assert names == ["in_thread"]


def test_the_log_says_it_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            ignore("logged_once_field", "the reason")
    lines = [r.getMessage() for r in caplog.records if "logged_once_field" in r.getMessage()]
    assert lines == ["logged_once_field: accepted and ignored (the reason)"]


def test_the_header_names_what_each_request_had_ignored() -> None:
    app = FastAPI()

    @app.get("/ignores")
    async def ignores(names: str = "") -> dict[str, bool]:
        for name in filter(None, names.split(",")):
            await run_in_threadpool(ignore, name, "test")      # a worker thread reports too
            await asyncio.sleep(0)
        return {"ok": True}

    app.add_middleware(IgnoredHeader)

    async def both_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            return await asyncio.gather(client.get("/ignores?names=quality,user,quality"),
                                        client.get("/ignores"))

    named, none = asyncio.run(both_at_once())
    assert named.headers["x-omnistage-ignored"] == "quality, user"
    assert "x-omnistage-ignored" not in none.headers and none.json() == {"ok": True}


@pytest.mark.parametrize(("fields", "unused"), [
    ({}, []),
    ({"true_cfg_scale": 4.0, "negative_prompt": " "}, []),            # true CFG: all used
    ({"true_cfg_scale": 4.0}, ["true_cfg_scale"]),                     # no negative prompt
    ({"negative_prompt": "blurry"}, ["negative_prompt"]),              # no scale above 1
    ({"negative_prompt": "blurry", "true_cfg_scale": 0.5}, ["negative_prompt"]),
    ({"guidance_scale": 3.5}, ["guidance_scale"]),                     # not distilled
    ({"guidance_scale": 1.0, "true_cfg_scale": 2.0}, ["true_cfg_scale", "guidance_scale"]),
])
def test_qwen_image_accepts_what_diffusers_warns_about(fields: dict, unused: list[str]) -> None:
    params = DiffusionParams(**fields)
    assert list(unused_params(params)) == unused
    check_text_params("a prompt", params)                               # no refusal
    with pytest.raises(ValueError, match="non-empty"):
        check_text_params("  ", params)


def test_the_preparation_pool_reports_to_the_requests_collector() -> None:
    """Preparation runs on the pool's threads (prep_pool.py) in a copy of the request's
    context: a field it ignores (chat's reasoning_effort without a template switch, say)
    reaches the answer's header."""
    from omnistage.entrypoints.openai.prep_pool import PrepPool

    pool = PrepPool(workers=1, max_pending=2)

    async def request() -> list[str]:
        with collect_ignored() as names:
            await pool.run(ignore, "reasoning_effort", "no template switch")
        return names

    try:
        assert asyncio.run(request()) == ["reasoning_effort"]
    finally:
        pool.shutdown()
