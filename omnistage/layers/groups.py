"""A stage's ranks (issue 18): how its world splits into parallel axes, one torch.distributed
group per axis, and the channel over which rank 0 hands its step plan to the other ranks.

    rank = ((cfg_i * ring + ring_i) * ulysses + ulysses_i) * tp + tp_i       (tp innermost)

Tensor parallelism is innermost so that its every-layer all-reduces stay between neighbouring
GPUs; CFG-parallel, one exchange per step, is outermost.

Rank 0 runs the stage's scheduler and speaks to the orchestrator. Every step it broadcasts a
plan (`StageRanks.share_plan`): a small picklable object of host data (the scheduled batch's
ids, positions, slots; a diffusion step's requests). The others (`follow` loops in the engines)
receive it and run the same forward, so no rank runs a scheduler of its own. Plans travel over
a gloo group even when tensors use NCCL: a CPU broadcast needs no device synchronisation.

The layers read the current stage's groups (`stage_ranks()`); with none set every axis has
one rank and every layer is its single-device self.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from omnistage.configs.schema import AXES, ParallelSizes
from omnistage.layers.parallel import TPGroup, set_tp_group

# a follower waits for rank 0's next plan as long as the server idles
PLAN_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True, slots=True)
class StageRanks:
    sizes: ParallelSizes
    rank: int
    tp: TPGroup
    ulysses: TPGroup
    ring: TPGroup
    cfg: TPGroup
    world: TPGroup
    plan_group: object | None = field(default=None, repr=False)

    @staticmethod
    def single() -> "StageRanks":
        one = TPGroup(0, 1, None)
        return StageRanks(ParallelSizes(), 0, one, one, one, one, one)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    def share_plan(self, plan: object = None) -> object:
        """Rank 0: send `plan` to every other rank and return it. Others: return rank 0's."""
        if self.world_size == 1:
            return plan
        box = [plan if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.plan_group)
        return box[0]


_current = StageRanks.single()


def set_stage_ranks(ranks: StageRanks | None) -> None:
    """The ranks of the stage this process serves: the layers built from now on split over
    them (None: one rank)."""
    global _current
    _current = ranks or StageRanks.single()
    set_tp_group(_current.tp if _current.tp.world_size > 1 else None)


def stage_ranks() -> StageRanks:
    return _current


def init_stage_ranks(sizes: ParallelSizes, rank: int, init_method: str, backend: str,
                     timeout_s: float = 120.0) -> StageRanks:
    """Join the stage's process group (every rank calls this with the same arguments but its
    rank) and build one group per axis; sets them current. `timeout_s` bounds the rendezvous
    and every collective of the tensor groups."""
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=sizes.world_size, timeout=timeout)
    coords = sizes.coords(rank)
    groups = {}
    for axis in AXES:        # every rank creates every group, in the same order
        for members in sizes.axis_groups(axis):
            g = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
            if rank in members:
                groups[axis] = TPGroup(coords[axis], len(members), g)
    plan_group = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
    ranks = StageRanks(sizes, rank, groups["tp"], groups["ulysses"], groups["ring"],
                       groups["cfg"], TPGroup(rank, sizes.world_size, dist.group.WORLD),
                       plan_group)
    set_stage_ranks(ranks)
    return ranks


def close_stage_ranks() -> None:
    set_stage_ranks(None)
    if dist.is_initialized():
        dist.destroy_process_group()
