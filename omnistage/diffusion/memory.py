"""A diffusion stage's memory budget: which requests fit in one denoising step.

A stage may use `memory_fraction` of its device for weights plus activations. Weights (and
whatever else stays allocated: the requests' latents and conditioning, CUDA-graph pools) are
read from the device before each step; what is left of the limit is the step's room for
activations. A step's activation peak grows with its transformer rows (images, twice for a
request with true CFG: `forward_rows`) and with the latent size of a row, so the budget keeps a fit of the peak per row against the
latent size, from a profiling step at start-up and from every step run since:

    bytes per row(size) = a + b * size [+ c * size^2]     size: latent elements per row,
                                                          proportional to its tokens

The quadratic term is kept only when three or more measured sizes show it (attention that
materialises its scores); a memory-efficient attention fits a line. Admission takes the
step's candidates oldest first while their predicted peaks fit the room; the rest wait for
a later step. A request whose rows alone cannot fit the whole budget is refused when it is
added (`check`: an InputError naming its size and the budget). A request of a size never
measured is predicted from the fit; with no measurement at all it runs alone, measured.

The device is read through a `MemoryProbe`: `CudaProbe` on CUDA; tests give a byte model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from omnistage.diffusion.request import DiffusionRequest
from omnistage.errors import InputError

MIB = 2**20
QUADRATIC_SHARE = 0.1   # of the peak at the largest measured size: the parabola is real
HEADROOM = 0.1      # predictions are raised by this share: fragmentation, longer captions


class MemoryProbe(Protocol):
    """What the budget reads from its device, in bytes."""

    def total(self) -> int:
        """The device's whole memory."""

    def allocated(self) -> int:
        """What this process holds now (weights, latents, caches)."""

    def reset_peak(self) -> None:
        """Start a new peak measurement from what is allocated now."""

    def peak(self) -> int:
        """The most allocated at once since `reset_peak`."""

    def free_cache(self) -> None:
        """Give cached, unused blocks back (after an out-of-memory error)."""


@dataclass(frozen=True, slots=True)
class CudaProbe:
    """The CUDA caching allocator's counters. They are kept on the host as kernels are
    launched, so reading them needs no device sync."""

    device: torch.device

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def free_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(slots=True)
class ActivationFit:
    """The activation peak per batch row against the latent size of a row, from measured
    steps: the largest peak per row seen at each size."""

    points: dict[int, int] = field(default_factory=dict)    # size -> bytes per row

    def record(self, size: int, bytes_per_row: int) -> None:
        self.points[size] = max(self.points.get(size, 0), bytes_per_row)

    def predict(self, size: int) -> int | None:
        """Bytes per row at `size`; None before any measurement. Never below a measured
        peak at a size at most `size` (the peak only grows with the size); one measured
        size: that peak below it, proportional to the size above it."""
        if not self.points:
            return None
        if len(self.points) == 1:
            ((s0, b0),) = self.points.items()
            return max(b0, -(-b0 * size // s0))
        below = max((b for s, b in self.points.items() if s <= size), default=0)
        return max(below, int(self.curve(size)))

    def curve(self, size: int) -> float:
        """The least-squares line through the measured sizes, or the parabola when three or
        more sizes show a quadratic term that makes a tenth or more of the peak at the
        largest of them (attention scores held whole); a smaller one is noise."""
        sizes = np.array(list(self.points), dtype=np.float64)
        peaks = np.array(list(self.points.values()), dtype=np.float64)
        coeffs = np.polyfit(sizes, peaks, 1)
        if len(sizes) >= 3:
            quad = np.polyfit(sizes, peaks, 2)
            largest = sizes.max()
            if quad[0] * largest**2 >= QUADRATIC_SHARE * np.polyval(quad, largest):
                coeffs = quad
        return float(np.polyval(coeffs, size))


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def row_size(req: DiffusionRequest) -> int:
    """A request's latent elements per row (image): its tokens times a constant of the
    pipeline."""
    return req.latents[0].numel()


def forward_rows(req: DiffusionRequest, cfg_split: bool = False) -> int:
    """The rows a request puts through the transformer each step: its images, and as many
    again with true CFG (every native pipeline runs the negative prompt's branch in the same
    call, and marks it by a `negative_prompt_embeds` condition), unless CFG-parallel gives
    that branch to another rank (`cfg_split`)."""
    images = req.latents.shape[0]
    return images * 2 if "negative_prompt_embeds" in req.cond and not cfg_split else images


class MemoryBudget:
    """Admission of a diffusion stage's requests into steps, within `limit` bytes of the
    device (`memory_fraction` of it) for weights plus activations."""

    def __init__(self, probe: MemoryProbe, limit: int, cfg_split: bool = False) -> None:
        self.probe = probe
        self.limit = limit
        self.cfg_split = cfg_split    # CFG-parallel: this rank runs one branch of each request
        self.fit = ActivationFit()
        self._start = 0         # allocated when the measured step began

    @classmethod
    def of_fraction(cls, probe: MemoryProbe, memory_fraction: float, cfg_split: bool = False
                    ) -> MemoryBudget:
        return cls(probe, int(memory_fraction * probe.total()), cfg_split)

    def rows(self, req: DiffusionRequest) -> int:
        return forward_rows(req, self.cfg_split)

    def room(self) -> int:
        """Bytes the next step's activations may take: the limit less what is held now."""
        return self.limit - self.probe.allocated()

    def cost(self, req: DiffusionRequest) -> int | None:
        """A request's predicted activation peak in a step (None: nothing measured yet)."""
        per_row = self.fit.predict(row_size(req))
        if per_row is None:
            return None
        return int(per_row * (1 + HEADROOM)) * self.rows(req)

    def describe(self, req: DiffusionRequest) -> str:
        """The numbers for a log line: the budget, what is held, a request's predicted peak."""
        cost = self.cost(req)
        return (f"budget {_mib(self.limit)} (memory_fraction of {_mib(self.probe.total())}), "
                f"held {_mib(self.probe.allocated())}; a step of {self.rows(req)} "
                f"transformer row(s) of {row_size(req)} latent elements: about "
                f"{'unmeasured' if cost is None else _mib(cost)} of activations")

    def check(self, req: DiffusionRequest) -> None:
        """InputError when the request alone cannot fit (its latents are already held)."""
        cost = self.cost(req)
        if cost is not None and cost > self.room():
            raise InputError(
                f"request too large for this stage's memory: {req.latents.shape[0]} image(s) "
                f"of {row_size(req)} latent elements need about {_mib(cost)} of activations "
                f"per step, but the stage has {_mib(self.room())} left of its budget of "
                f"{_mib(self.limit)} (memory_fraction): ask for "
                "fewer images or a smaller size, or raise memory_fraction")

    def admit(self, candidates: list[DiffusionRequest]) -> list[DiffusionRequest]:
        """The candidates (oldest first) that fit the room together; the oldest always runs
        (it fit alone when it was added), and one of a size no step has measured yet runs
        alone, so that its step measures it."""
        room = self.room()
        batch: list[DiffusionRequest] = []
        for req in candidates:
            cost = self.cost(req)
            if cost is None:
                return batch or [req]
            if batch and cost > room:
                continue
            batch.append(req)
            room -= cost
        return batch

    def start(self) -> None:
        """Before a step: measure its peak from here."""
        self._start = self.probe.allocated()
        self.probe.reset_peak()

    def record(self, batch: list[DiffusionRequest]) -> None:
        """After a step that ran `batch` (one latent size): its peak per row joins the fit."""
        rows = sum(self.rows(r) for r in batch)
        self.fit.record(row_size(batch[0]), -(-(self.probe.peak() - self._start) // rows))

    def record_oom(self, batch: list[DiffusionRequest]) -> None:
        """A step of several requests ran out of memory: a row of their size needs more than
        its share of the room the step had, so later steps take fewer of them. One request
        alone teaches nothing about batching (and may have met another process's memory):
        it fails, and a later request of its size is tried again."""
        if len(batch) > 1:
            rows = sum(self.rows(r) for r in batch)
            self.fit.record(row_size(batch[0]), -(-(self.limit - self._start) // rows) + 1)
