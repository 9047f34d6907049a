"""LoRA adapters on a diffusion stage's transformer, loaded and unloaded at run time and
chosen per request.

    LoraAdapters(model)            the stage engine's: adapters by name, on the device
      .ensure(LoraRequest)         loaded from its path on first use (InputError naming
                                   lora.path / lora.name); least recently used evicted past
                                   max_loras
      .load(name, path) / .unload(name)
      .applied(name, scale)        while inside: every linear the adapter names adds
                                   scale * scaling * B (A x) to its output (forward hooks,
                                   put on at entry and taken off at exit)

The base weights are never touched: an adapter is a set of (A, B) pairs beside them, so any
number of adapters can be held, any linear kind (bf16, FP8, INT8) takes one, and unloading
frees its tensors. The engine (`group_by_adapter`) runs one transformer forward per distinct
(adapter, scale) among a step's requests, requests without an adapter sharing the base
forward: a batch of [lora A, none, lora B] takes three forwards of one step and each request's
rows equal what it gets alone.

While an adapter is applied, CUDA-graph replay is bypassed (`applying()`): a graph captured
without the hooks would silently drop the update. Tensor parallelism is refused (the B of a
column-parallel linear and the A of a row-parallel one would need their shard).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.diffusion.lora_formats import LoraLayer, read_adapter, to_device
from omnistage.diffusion_params import LoraRequest
from omnistage.errors import InputError
from omnistage.layers.parallel import tp_group

logger = logging.getLogger(__name__)

MAX_LORAS = 8               # adapters held at once (vLLM's --max-loras default is 1; ours more)
_applying = 0               # adapters applied right now (any engine of this process)


def applying() -> bool:
    """An adapter's hooks are on: the transformer must run eagerly (no graph replay)."""
    return _applying > 0


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    layers: dict[str, LoraLayer] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(x.a.nbytes + x.b.nbytes for x in self.layers.values())


class LoraAdapters:
    def __init__(self, model: nn.Module, max_loras: int = MAX_LORAS) -> None:
        self.model = model
        self.max_loras = max_loras
        self.adapters: OrderedDict[str, LoraAdapter] = OrderedDict()   # least recent first
        self.modules = dict(model.named_modules())

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read the adapter at `path` (a .safetensors file or a folder holding one) as
        `name`, in the model's dtype on its device; one already held under `name` is
        replaced. ValueError: unreadable, or does not fit the model."""
        if tp_group().world_size > 1:
            raise ValueError("LoRA adapters are not supported with tensor parallelism yet")
        param = next(self.model.parameters())
        dtype = param.dtype if param.is_floating_point() else torch.bfloat16
        layers = to_device(read_adapter(path, self.model), param.device, dtype)
        adapter = LoraAdapter(name, str(path), layers)
        self.adapters.pop(name, None)
        self.adapters[name] = adapter
        logger.info("LoRA %r loaded from %s: %d linears, %.1f MiB", name, path,
                    len(layers), adapter.nbytes / 2**20)
        return adapter

    def unload(self, name: str) -> bool:
        """Forget adapter `name` (its tensors are freed); False if none was held."""
        return self.adapters.pop(name, None) is not None

    def ensure(self, lora: LoraRequest, in_use: frozenset[str] = frozenset()) -> None:
        """The request's adapter held: loaded from `lora.path` unless held under its name
        (from that path). Past max_loras the least recently used one not in `in_use` goes.
        InputError naming the field."""
        held = self.adapters.get(lora.name)
        if held is not None and (lora.path is None or lora.path == held.path):
            self.adapters.move_to_end(lora.name)
            return
        if lora.path is None:
            raise InputError(f"lora.name: no adapter {lora.name!r} is loaded (loaded: "
                             f"{self.names}); give lora.path to load it", "lora.name")
        try:
            self.load(lora.name, lora.path)
        except (ValueError, OSError) as exc:
            raise InputError(f"lora.path: {exc}", "lora.path") from None
        self._evict(in_use | {lora.name})

    def _evict(self, keep: frozenset[str]) -> None:
        for name in [n for n in self.adapters if n not in keep]:
            if len(self.adapters) <= self.max_loras:
                break
            self.unload(name)
            logger.info("LoRA %r unloaded (more than %d held)", name, self.max_loras)

    @contextmanager
    def applied(self, name: str | None, scale: float = 1.0) -> Iterator[None]:
        """Adapter `name` (None: none) on the model's linears for the forwards inside."""
        global _applying
        if name is None or scale == 0.0:
            yield
            return
        adapter = self.adapters[name]
        handles = [self.modules[module].register_forward_hook(_hook(layer, scale))
                   for module, layer in adapter.layers.items()]
        _applying += 1
        try:
            yield
        finally:
            _applying -= 1
            for h in handles:
                h.remove()


def _hook(layer: LoraLayer, scale: float) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    factor = scale * layer.scaling

    def add_update(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = args[0]                                                     # (..., in)
        update = F.linear(F.linear(x.to(layer.a.dtype), layer.a), layer.b)   # (..., out)
        return out + (factor * update).to(out.dtype)

    return add_update


def adapter_key(lora: LoraRequest | None) -> tuple[str, float] | None:
    """What requests must share to share a forward: the adapter and its scale."""
    return None if lora is None else (lora.name, lora.scale)


def group_by_adapter(keys: list[tuple[str, float] | None]) -> list[list[int]]:
    """Indices of `keys` grouped by equal key, in first-appearance order."""
    groups: dict[tuple[str, float] | None, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())
