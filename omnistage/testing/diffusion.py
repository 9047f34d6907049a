"""Driving a diffusion engine to the end in tests."""

from __future__ import annotations

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult


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
