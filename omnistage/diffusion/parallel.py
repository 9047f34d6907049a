"""A diffusion stage over several ranks (issue 18): which layouts each pipeline takes, CFG
branches on different ranks, and the plan rank 0 shares with the others every step.

    pipeline     cfg  ulysses  ring  tp
    qwen_image    x      x      x    x     CFG-parallel: true CFG's two branches
    flux          -      x      x    x     guidance-distilled: no negative branch to split
    z_image       x      x      x    x     CFG with guidance_scale; the main layers' padded
                                           joint batch split, its key mask with it
    wan           x      x      x    x     CFG with guidance_scale (each expert's); the video
                                           tokens split, text and CLIP tokens whole
    digits        -      -      -    -     the demo runs on one rank

(each pipeline class's `parallel_axes`). The axes combine: world = cfg x ring x ulysses x tp
(layers/groups.py), heads divisible by ulysses x tp. Text encoders and the VAE are whole on
rank 0, which alone encodes, prepares and decodes; the other ranks hold the transformer
only (their VAE is loaded but unused).

Every rank holds every running request (latents, schedule, conditioning, step-cache state)
and runs every step; rank 0 alone admits, schedules, decodes and answers. Its plan for a
step (`StepPlan`) names the batch and carries the requests the others have not seen yet, as
rank 0 prepared them (latents, sigmas, conditioning, on the CPU): the followers need no text
encoder and draw no noise, and their latents stay equal to rank 0's because every rank
combines the same gathered predictions the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from omnistage.configs.schema import AXES, ParallelSizes
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest
from omnistage.layers.parallel import TPGroup
from omnistage.layers.sequence_parallel import all_gather_uneven
from omnistage.models.diffusers_loader import read_config

OPTION_NAMES = {"tp": "tensor_parallel_size", "ulysses": "ulysses_degree",
                "ring": "ring_degree", "cfg": "cfg_parallel_size"}


def check_layout(pipeline_cls: type[DiffusionPipeline], name: str, sizes: ParallelSizes, path: str | Path | None
                 ) -> None:
    """ValueError, before anything loads, for a layout the pipeline `name` cannot run: an
    axis it does not split along, CFG-parallel over more than two ranks, or attention heads
    that do not divide by ulysses x tp (read from the checkpoint's transformer/config.json)."""
    if sizes.cfg > 2:
        raise ValueError(f"cfg_parallel_size={sizes.cfg}: classifier-free guidance has two "
                         "branches (choose 1 or 2)")
    supported = pipeline_cls.parallel_axes
    for axis in AXES:
        if getattr(sizes, axis) > 1 and axis not in supported:
            why = (" (CFG-parallel splits true classifier-free guidance's two branches; "
                   "this pipeline runs none)" if axis == "cfg" else "")
            raise ValueError(f"{OPTION_NAMES[axis]}={getattr(sizes, axis)}: the {name!r} "
                             f"pipeline does not split along this axis{why}; it supports "
                             f"{', '.join(OPTION_NAMES[a] for a in supported) or 'none'}")
    split = sizes.ulysses * sizes.tp
    if split > 1 and path is not None:
        key = pipeline_cls.heads_key
        folder = Path(path) / "transformer"     # or a one-model folder (HunyuanImage-3.0)
        heads = read_config(folder if folder.is_dir() else Path(path))[key]
        if heads % split:
            raise ValueError(f"the {name!r} transformer's {key} ({heads}) is not divisible by "
                             f"ulysses_degree x tensor_parallel_size ({sizes.ulysses} x "
                             f"{sizes.tp})")


def gather_branches(local: Tensor, sizes: list[int], cfg: TPGroup) -> Tensor:
    """CFG-parallel: rank c ran branch c (`sizes[c]` rows, maybe none); -> every branch's
    rows on every rank, branch after branch (the layout of one call over both)."""
    return all_gather_uneven(local, sizes, cfg, dim=0)


@dataclass(slots=True)
class FollowedRequest:
    """A request as rank 0 prepared it, for the other ranks to hold (CPU tensors)."""
    request_id: str
    params: DiffusionParams
    latents: Tensor
    sigmas: Tensor
    cond: dict[str, Tensor]
    step_idx: int

    @staticmethod
    def of(req: DiffusionRequest) -> FollowedRequest:
        return FollowedRequest(req.request_id, req.params, req.latents.cpu(), req.sigmas.cpu(),
                               {k: v.cpu() for k, v in req.cond.items()}, req.step_idx)

    def request(self, device: torch.device) -> DiffusionRequest:
        return DiffusionRequest(self.request_id, None, self.params, self.latents.to(device),
                                self.sigmas, {k: v.to(device) for k, v in self.cond.items()},
                                torch.Generator(), self.step_idx)


@dataclass(slots=True)
class StepPlan:
    """One step as rank 0 runs it: first forget `dropped` (aborted or failed), hold `new`,
    then step `batch` (request ids, in batch order)."""
    batch: list[str]
    new: list[FollowedRequest] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
