"""Layerwise offload of a diffusion transformer's blocks (issue 44): a denoiser larger than
its GPU runs with its repeated blocks in pinned host memory, each block's weights copied to
the device just before it runs, the next `prefetch` blocks' copies overlapping its compute.

    host (pinned)   block 0 | block 1 | ... | block n-1      one flat buffer a block and dtype
    device          slot 0  | slot 1 (| ...)                 prefetch + 1 slots of the largest
                                                             block's size
    copy stream     H2D block i+1 -> the slot block i-1 used (after block i-1's compute ended)
    compute stream  block i (its parameters pointed at its slot's views for its forward)

Everything outside the blocks (embeddings, final layers, the VAE, the text encoders) stays
on the device. The blocks are the model's `nn.ModuleList`s of repeated layers (FLUX's
double- and single-stream lists, Qwen-Image's one), taken in definition order, which is the
order a forward runs them; a block that comes out of order (a step cache skipping blocks)
is loaded when it is reached, so the result never depends on the order, only the overlap
does. The device holds `prefetch + 1` blocks' weights instead of all of them: Qwen-Image's
60 blocks of 20B parameters (38 GiB in bf16) leave about 1.3 GiB on the device with one
block prefetched.

A forward reads each block's weights over PCIe once per step, so an offloaded step is bound
by max(compute, weights / host bandwidth): worth it for large images (compute-heavy steps).
The hooks change parameters between blocks: an offloaded denoiser is neither compiled nor
replayed from CUDA graphs (the stage turns both off). On the CPU (tests) copies are
synchronous and there are no streams.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

MIN_SHARE = 0.5     # block lists that hold at least this share of the parameters
# the models `offload_blocks` placed, with their offloads
_OFFLOADED: weakref.WeakKeyDictionary[nn.Module, BlockOffload] = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class _Block:
    """One block's tensors: (module, name, is_parameter, dtype, offset, shape) each, and its
    host flat buffer per dtype."""
    entries: list[tuple[nn.Module, str, bool, torch.dtype, int, torch.Size]]
    host: dict[torch.dtype, Tensor]


@dataclass(slots=True)
class _Slot:
    flats: dict[torch.dtype, Tensor]       # device buffers, the largest block's size
    block: int = -1                        # whose weights it holds (-1: none)
    ready: object = None                   # CUDA event: its copy is done
    free: object = None                    # CUDA event: the last block that used it is done
    used: int = field(default=0)           # when it was last entered (least recent: reused)


def block_lists(model: nn.Module) -> list[tuple[nn.Module, str, nn.ModuleList]]:
    """The model's lists of repeated blocks, in definition order: (parent, attribute, list)
    for each `nn.ModuleList` holding at least MIN_SHARE of the parameters together with the
    others found (nested lists inside a block are part of it)."""
    total = sum(p.numel() for p in model.parameters())
    found: list[tuple[nn.Module, str, nn.ModuleList]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) > 1 and not any(
                    child is c or _inside(child, c) for _, _, c in found):
                found.append((parent, name, child))
    found = [f for f in found if not any(_inside(f[2], g[2]) for g in found if g is not f)]
    share = sum(p.numel() for _, _, lst in found for p in lst.parameters())
    if not found or share < MIN_SHARE * total:
        raise ValueError(f"{type(model).__name__}: no lists of blocks holding most of its "
                         "parameters to offload")
    return found


def _inside(inner: nn.Module, outer: nn.Module) -> bool:
    return inner is not outer and any(m is inner for m in outer.modules())


class BlockOffload:
    """Offload `model`'s blocks (module docstring): the rest moves to `device`, the blocks'
    weights to pinned host memory, hooks stream them in. `resident_bytes` is what the blocks
    keep on the device."""

    def __init__(self, model: nn.Module, device: torch.device, prefetch: int = 1) -> None:
        if prefetch < 1:
            raise ValueError(f"offload prefetch={prefetch}: must be >= 1")
        self.device = device
        self.cuda = device.type == "cuda"
        lists = block_lists(model)
        for parent, name, _ in lists:            # the rest of the model to the device
            setattr(parent, name, nn.ModuleList())
        model.to(device)
        for parent, name, lst in lists:
            setattr(parent, name, lst)
        self.modules = [block for _, _, lst in lists for block in lst]
        self.blocks = [self._host(block) for block in self.modules]
        sizes: dict[torch.dtype, int] = defaultdict(int)
        for b in self.blocks:
            for dt, flat in b.host.items():
                sizes[dt] = max(sizes[dt], flat.numel())
        self.slots = [_Slot({dt: torch.empty(n, dtype=dt, device=device)
                             for dt, n in sizes.items()}) for _ in range(prefetch + 1)]
        self.prefetch = prefetch
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        self.clock = 0
        self.num_loads = self.num_late_loads = 0
        for i, block in enumerate(self.modules):
            block.register_forward_pre_hook(lambda m, a, i=i: self._enter(i))
            block.register_forward_hook(lambda m, a, o, i=i: self._leave(i))

    @property
    def resident_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for s in self.slots for f in s.flats.values())

    def _host(self, block: nn.Module) -> _Block:
        """The block's parameters and buffers packed into pinned host buffers per dtype; the
        block's tensors become views of them."""
        tensors = [(m, name, True, p) for m in block.modules()
                   for name, p in m._parameters.items() if p is not None]
        tensors += [(m, name, False, b) for m in block.modules()
                    for name, b in m._buffers.items() if b is not None]
        sizes: dict[torch.dtype, int] = defaultdict(int)
        entries = []
        for m, name, is_param, t in tensors:
            entries.append((m, name, is_param, t.dtype, sizes[t.dtype], t.shape))
            sizes[t.dtype] += t.numel()
        host = {dt: torch.empty(n, dtype=dt, pin_memory=self.cuda) for dt, n in sizes.items()}
        for (m, name, is_param, dt, off, shape), (_, _, _, t) in zip(entries, tensors):
            host[dt][off:off + t.numel()].copy_(t.detach().reshape(-1))
        result = _Block(entries, host)
        self._point(result, host)
        return result

    @staticmethod
    def _point(block: _Block, flats: dict[torch.dtype, Tensor]) -> None:
        for m, name, is_param, dt, off, shape in block.entries:
            view = flats[dt][off:off + shape.numel()].view(shape)
            if is_param:
                m._parameters[name].data = view
            else:
                m._buffers[name] = view

    # -- the hooks ---------------------------------------------------------------------------
    def _enter(self, i: int) -> None:
        slot = next((s for s in self.slots if s.block == i), None)
        if slot is None:                         # not prefetched: out of order, or the first
            slot = self._load(i, exclude=())
            self.num_late_loads += 1
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        self.clock += 1
        slot.used = self.clock
        self._point(self.blocks[i], slot.flats)
        ahead = [slot]
        for k in range(1, self.prefetch + 1):
            j = (i + k) % len(self.blocks)
            held = next((s for s in self.slots if s.block == j), None)
            ahead.append(held if held is not None else self._load(j, exclude=ahead))

    def _leave(self, i: int) -> None:
        slot = next(s for s in self.slots if s.block == i)
        if self.cuda:
            slot.free = torch.cuda.current_stream(self.device).record_event()
        self._point(self.blocks[i], self.blocks[i].host)     # nothing keeps the slot's views

    def _load(self, i: int, exclude: tuple | list) -> _Slot:
        """Copy block i's weights into the least recently used slot not in `exclude`."""
        slot = min((s for s in self.slots if all(s is not e for e in exclude)),
                   key=lambda s: s.used)
        slot.block = i
        self.num_loads += 1
        if not self.cuda:
            for dt, flat in self.blocks[i].host.items():
                slot.flats[dt][:flat.numel()].copy_(flat)
            return slot
        with torch.cuda.stream(self.copies):
            if slot.free is not None:            # the block that used it last has finished
                self.copies.wait_event(slot.free)
            for dt, flat in self.blocks[i].host.items():
                slot.flats[dt][:flat.numel()].copy_(flat, non_blocking=True)
            slot.ready = self.copies.record_event()
        return slot


def offload_blocks(model: nn.Module, device: torch.device, prefetch: int = 1) -> BlockOffload:
    """Offload `model`'s blocks to host memory (BlockOffload), logging what stays resident."""
    offload = _OFFLOADED[model] = BlockOffload(model, device, prefetch)
    total = sum(f.numel() * f.element_size() for b in offload.blocks for f in b.host.values())
    logger.info("offloaded %d blocks of %s (%.2f GiB) to host memory; %.2f GiB of them on %s "
                "at a time", len(offload.blocks), type(model).__name__, total / 2**30,
                offload.resident_bytes / 2**30, device)
    return offload


def place(model: nn.Module, device: torch.device) -> nn.Module:
    """model on `device`, unless its blocks are offloaded (`offload_blocks` placed it)."""
    return model if model in _OFFLOADED else model.to(device)


def offload_of(model: nn.Module) -> BlockOffload | None:
    """The offload of `model`'s blocks, if `offload_blocks` made one."""
    return _OFFLOADED.get(model)
