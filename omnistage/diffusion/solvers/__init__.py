"""Noise schedules and ODE solvers, one file each, as pure functions of `(sigmas, step_idx)`.

A multistep solver (unipc_flow.py) also remembers earlier model outputs; that memory is a small
state object the request owns, so rows at different steps still share one batch. `Solver` is what
the engine calls per request; the pipeline picks the solver and builds the schedule (it knows the
config, the image size for `mu`, the strength).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from torch import Tensor

S = TypeVar("S")


class Solver(Protocol[S]):
    def new_state(self) -> S:
        """A fresh per-request state, held by the request from its first step to its last."""

    def step(self, model_output: Tensor, sample: Tensor, sigmas: Tensor, step_idx: int,
             state: S) -> Tensor:
        """One request's rows from sigmas[step_idx] to sigmas[step_idx + 1]; updates state."""
