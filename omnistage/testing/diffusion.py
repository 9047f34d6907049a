"""Driving a diffusion engine to the end in tests: a request alone, requests joining at
other steps, the final latents each one reached (what `decode` got), and which Wan expert
ran which requests; the generic diffusers adapter's engine, whose calls run on a thread, until
its last call has ended; random input image files for edits."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image
from torch import Tensor

from omnistage.diffusion.diffusers_engine import DiffusersEngine
from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from omnistage.diffusion.pipelines.wan import WanPipeline


def run_to_end(engine: DiffusionEngine) -> dict[str, DiffusionResult]:
    """Step until every request finished; -> request id -> its final result. Asserts that
    none failed."""
    done = {}
    while engine.has_unfinished_requests:
        for r in engine.step():
            if r.finished:
                assert r.error is None, r.error
                done[r.request_id] = r
    return done


def run_whole_calls(engine: DiffusersEngine, deadline_s: float = 60.0
                    ) -> dict[str, list[DiffusionResult]]:
    """Step until every request has finished and the last call has ended (an aborted one
    too); -> request id -> all its results (progress, then the last), in order."""
    out: dict[str, list[DiffusionResult]] = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests or engine.call is not None:
        assert time.monotonic() < deadline, f"the engine did not finish in {deadline_s} s"
        for r in engine.step():
            out.setdefault(r.request_id, []).append(r)
        time.sleep(0.005)
    return out


def run_recording_latents(pipeline: DiffusionPipeline,
                          drive: Callable[[DiffusionEngine], dict[str, DiffusionParams]]
                          ) -> tuple[dict[str, tuple[Tensor, Tensor]], DiffusionEngine]:
    """A fresh engine over `pipeline`; `drive(engine)` adds the requests (and may step) and
    returns their params by id. -> per request (its final latents, what `decode` got; its
    output), everything run to the end; and the engine."""
    seen: dict[int, Tensor] = {}
    decode = pipeline.decode

    def spy(latents: Tensor, params: DiffusionParams) -> Tensor:
        seen[id(params)] = latents.clone()
        return decode(latents, params)

    pipeline.decode = spy
    try:
        engine = DiffusionEngine(pipeline)
        jobs = drive(engine)
        done = run_to_end(engine)
    finally:
        pipeline.decode = decode
    return {rid: (seen[id(p)], done[rid].images) for rid, p in jobs.items()}, engine


def run_alone(pipeline: DiffusionPipeline, prompt: str, params: DiffusionParams
              ) -> tuple[Tensor, Tensor]:
    """One request alone on a fresh engine: (its final latents, its output)."""
    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        engine.add_request("alone", prompt, params)
        return {"alone": params}

    return run_recording_latents(pipeline, drive)[0]["alone"]


def run_staggered(pipeline: DiffusionPipeline,
                  jobs: dict[str, tuple[str, DiffusionParams]], lag: int = 1
                  ) -> tuple[dict[str, tuple[Tensor, Tensor]], DiffusionEngine]:
    """`jobs` (id -> (prompt, params)) added in order, each `lag` engine steps after the one
    before (none may finish before the last is added), then run to the end: as
    `run_recording_latents`."""
    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        for k, rid in enumerate(jobs):
            engine.add_request(rid, *jobs[rid])
            for _ in range(lag if k < len(jobs) - 1 else 0):
                engine.step()
        return {rid: p for rid, (_, p) in jobs.items()}

    return run_recording_latents(pipeline, drive)


@contextlib.contextmanager
def recording_experts(pipeline: WanPipeline) -> Iterator[list[list[int | str]]]:
    """A list that gets, for each transformer call of `pipeline` inside the block, [the
    expert (0: `transformer`, 1: `transformer_2`), the ids of the requests it ran]."""
    calls: list[list[int | str]] = []
    expert_velocity = pipeline.expert_velocity

    def spy(expert: int, latents: Tensor, requests: list[DiffusionRequest]) -> Tensor:
        calls.append([expert, *(r.request_id for r in requests)])
        return expert_velocity(expert, latents, requests)

    pipeline.expert_velocity = spy                      # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del pipeline.expert_velocity                    # the class's method again


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB image file (PNG) of the given size: an edit's input image."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
