"""Driving a diffusion engine to the end in tests."""

from __future__ import annotations

from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.params import DiffusionParams


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


def run_keeping_latents(engine: DiffusionEngine
                        ) -> tuple[dict[str, DiffusionResult], dict[int, Tensor]]:
    """`run_to_end`, also keeping each request's final latents as the pipeline decodes them,
    by the request's seed (give each request its own)."""
    pipe = engine.pipeline
    decode = pipe.decode
    seen: dict[int, Tensor] = {}

    def spy(latents: Tensor, params: DiffusionParams) -> Tensor:
        seen[params.seed] = latents.clone()
        return decode(latents, params)

    pipe.decode = spy                                   # type: ignore[method-assign]
    try:
        return run_to_end(engine), seen
    finally:
        del pipe.decode                                 # the class's method again
