"""The configuration tree: frozen dataclasses, built once and passed down by constructor.

Facts measured at start-up (how many KV blocks fit) are *not* written here: they come back in
their own result objects (`omnistage.ar.kv_cache.KVCacheLayout`).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Literal

from omnistage.configs.quantization import ComponentQuantization, ar_method
from omnistage.configs.records import (ALL_KINDS, AXES, ARSettings,  # noqa: F401 (re-exported)
                                       DiffusionSettings, DType, GenerationSettings,
                                       KVCacheConfig, OutputKind, ParallelSizes, Placement,
                                       StageKind, Timeouts, meta)
from omnistage.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"scheduler.max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")


@dataclass(frozen=True, slots=True)
class ARConfig:
    """Everything an autoregressive stage engine needs besides the checkpoint itself."""

    model: str = ""
    component: str | None = None  # sub-model of a multi-part checkpoint (issue 3+)
    tokenizer: str | None = None  # tokenizer folder; None: the checkpoint's own
    device: Literal["auto", "cpu", "cuda"] | str = "auto"
    dtype: DType = "auto"
    seed: int = 0
    # CUDA: share of device memory for weights + KV cache + activations of this stage.
    memory_fraction: float = 0.9
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # Never replay decode steps from CUDA graphs (debugging, or models that change per step).
    enforce_eager: bool = False
    # Steps with prompt rows of up to this many tokens replay CUDA graphs too (0: eager).
    max_graph_tokens: int = 512
    # Launch a graph-replayed decode step before the previous one's tokens are read back, so
    # host and device work overlap (the same tokens; engine.py `step`).
    async_scheduling: bool = True
    # The method for the model's linears after it loads (configs/quantization.py `ar_method`;
    # ar/quantize.py applies it); None: as loaded.
    quantization: ComponentQuantization | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction={self.memory_fraction}: must be in (0, 1]")


# ---- the stage graph --------------------------------------------------------------------------
# `__post_init__` errors start with the offending field name; the parser prepends the path, e.g.
# "stages[1].placement.memory_fraction: must be in (0, 1], got 1.5".

_STAGE_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class StageInput:
    """One edge into a stage. YAML: `{from: thinker, adapter: qwen3_omni.thinker_to_talker}`."""

    source: str = field(metadata={"alias": "from"})  # `from` is a Python keyword
    adapter: str  # registry key in omnistage.stages.adapters.ADAPTERS
    chunked: bool = False  # the upstream output is streamed through in chunks

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("from: must name a stage")
        if not self.adapter:
            raise ValueError("adapter: must name a registered adapter")


# Flat keys of the old StageConfig (before issue 39) -> their path in the nested one; "{kind}"
# is the stage's kind. The parser refuses each with its new path (`moved_key`).
MOVED: dict[str, str] = {
    **{k: f"placement.{k}" for k in ("devices", "memory_fraction", "replicas",
                                     "replica_devices", "max_restarts", "ray_resources",
                                     "ray_gpus")},
    "tensor_parallel_size": "parallel.tp", "ulysses_degree": "parallel.ulysses",
    "ring_degree": "parallel.ring", "cfg_parallel_size": "parallel.cfg",
    **{f"{k}_timeout_s": f"timeouts.{k}_s" for k in ("startup", "input", "step", "liveness")},
    **{k: f"ar.{k}" for k in ("max_num_batched_tokens", "max_model_len", "tokenizer",
                              "enable_chunked_prefill", "enforce_eager", "async_scheduling",
                              "seed", "output_hidden_layers", "sampling")},
    **{k: f"ar.kv_cache.{k}" for k in ("block_size", "enable_prefix_caching",
                                       "cpu_kv_cache_bytes")},
    "num_kv_blocks": "ar.kv_cache.num_blocks",
    "quantization": "{kind}.quantization",
    "max_num_seqs": "{kind}.max_num_seqs", "options": "{kind}.options",
}


@dataclass(frozen=True, slots=True)
class StageConfig:
    """One stage of the graph: what it runs (name, kind, component, model), what it reads and
    where its output goes (inputs, final), and one sub-record per concern. The record of its
    kind (`ar`, `diffusion` or `generation`) is filled with defaults when not written; a record
    of another kind is refused."""

    name: str = field(metadata=meta("the stage's name (letters, digits, '_', '-')"))
    kind: StageKind = field(metadata=meta("ar, diffusion or generation"))
    component: str | None = field(default=None, metadata=meta(
        "which part of the checkpoint this stage loads (a registry key)"))
    model: str | None = field(default=None, metadata=meta(
        "checkpoint of this stage; null: the graph's model"))
    inputs: tuple[StageInput, ...] = field(default=(), metadata=meta(
        "edges into this stage: [{from: STAGE, adapter: NAME, chunked: BOOL}]"))
    final: OutputKind | None = field(default=None, metadata=meta(
        "this stage's output goes to the client as text, audio, image, video or tensor"))
    dtype: DType = field(default="auto", metadata=meta(
        "weights and activations; auto: the checkpoint's", flag="dtype", kinds=ALL_KINDS,
        every_stage=True, choices=["auto", "float32", "bfloat16", "float16"],
        type="dtype"))
    placement: Placement = field(default_factory=Placement, metadata=meta(
        "where the stage's processes run"))
    parallel: ParallelSizes = field(default_factory=ParallelSizes, metadata=meta(
        "how the stage's ranks split (world size 1: one process)"))
    timeouts: Timeouts = field(default_factory=Timeouts, metadata=meta(
        "how long the stage may take"))
    ar: ARSettings | None = field(default=None, metadata=meta("kind ar: its engine's settings"))
    diffusion: DiffusionSettings | None = field(default=None, metadata=meta(
        "kind diffusion: its engine's settings"))
    generation: GenerationSettings | None = field(default=None, metadata=meta(
        "kind generation: its engine's settings"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))  # direct construction: hashable
        if not _STAGE_NAME.fullmatch(self.name):
            raise ValueError(f"name: must be letters, digits, '_' or '-' (overrides say "
                             f"NAME.KEY=VALUE), got {self.name!r}")
        records = {"ar": ARSettings, "diffusion": DiffusionSettings,
                   "generation": GenerationSettings}
        for kind, record in records.items():
            if kind == self.kind and getattr(self, kind) is None:
                object.__setattr__(self, kind, record())
            elif kind != self.kind and getattr(self, kind) is not None:
                raise ValueError(f"{kind}: settings of {kind} stages; stage {self.name!r} is "
                                 f"of kind {self.kind}")
        if self.ar is not None:
            try:
                ar_method(self.ar.quantization, self.component)
            except ValueError as e:
                raise ValueError(f"ar.quantization.{e}") from None
    @staticmethod
    def moved_key(data: object, key: str, close: bool = False) -> str | None:
        """The new path of an old flat key (strict.py's did-you-mean), else None; `close`: of
        the old key closest to `key` (a misspelt one, `max_num_seq`)."""
        if close:
            near = difflib.get_close_matches(key, list(MOVED), n=1)
            key = near[0] if near else key
        path = MOVED.get(key)
        if path is None:
            return None
        kind = data.get("kind") if isinstance(data, dict) else None
        return path.format(kind=kind if kind in ALL_KINDS else "ar")

    @property
    def gpu_share(self) -> float:
        """The share of one GPU each rank asks Ray for (`placement.ray_gpus`)."""
        if self.placement.ray_gpus is not None:
            return self.placement.ray_gpus
        return 0.1 if self.kind == "generation" else self.placement.memory_fraction

    def devices_of(self, replica: int) -> tuple[int, ...]:
        """The devices of one replica: its own list, or the stage's."""
        return self.placement.devices_of(replica)

    @property
    def max_num_seqs(self) -> int:
        """Requests the stage's engine batches, whatever its kind."""
        return (self.ar or self.diffusion or self.generation).max_num_seqs

    def default_sampling(self) -> SamplingParams:
        """This stage's default SamplingParams (`ar.sampling` plus the hidden layers it emits;
        an empty one for a stage of another kind)."""
        return self.ar.default_sampling() if self.ar is not None else SamplingParams()

    def ar_config(self, model: str, device: str) -> ARConfig:
        """The AR engine config of this (ar) stage. `model` is the graph's checkpoint, used when
        the stage names none; `device` is where the engine runs ("cpu", "cuda", "cuda:1")."""
        if self.ar is None:
            raise ValueError(f"stage {self.name!r} is a {self.kind} stage, not ar")
        ar = self.ar
        return ARConfig(
            model=self.model if self.model is not None else model,
            component=self.component, tokenizer=ar.tokenizer, device=device,
            dtype=self.dtype, seed=ar.seed, memory_fraction=self.placement.memory_fraction,
            enforce_eager=ar.enforce_eager, async_scheduling=ar.async_scheduling,
            max_graph_tokens=ar.max_graph_tokens, kv_cache=ar.kv_cache, quantization=ar_method(ar.quantization, self.component),
            scheduler=SchedulerConfig(max_num_seqs=ar.max_num_seqs,
                                      max_num_batched_tokens=ar.max_num_batched_tokens,
                                      enable_chunked_prefill=ar.enable_chunked_prefill,
                                      max_model_len=ar.max_model_len))


@dataclass(frozen=True, slots=True)
class GraphConfig:
    """The whole stage graph as written. Graph-level rules (unique names, no cycles, registered
    adapters) are checked by `omnistage.configs.graph.validate_graph`."""

    stages: tuple[StageConfig, ...] = field(metadata=meta("the stages, each below"))
    connector: Literal["auto", "inproc", "shm", "tcp"] = field(default="auto", metadata=meta(
        "how tensors move between stages; auto: the backend's own (shm; under ray, per edge: "
        "shm when both ends share a node, tcp when they do not); inproc needs backend inproc"))
    backend: Literal["process", "inproc", "ray"] = field(default="process", metadata=meta(
        "process: one process per stage; inproc: every stage in the caller's process (tests, "
        "debugging); ray: one Ray actor per stage rank, on any node of a Ray cluster"))
    model: str | None = field(default=None, metadata=meta(
        "checkpoint of the stages that name none"))
    ray_address: str | None = field(default=None, metadata=meta(
        "backend ray: the cluster to join (auto, ray://..., HOST:PORT); null: the one "
        "RAY_ADDRESS or a running `ray start` names, else a new local one"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def connector_kind(self) -> str:
        """The connector the stages run: `connector`, with auto resolved for the backend."""
        if self.connector != "auto":
            return self.connector
        return "auto" if self.backend == "ray" else "shm"

    def stage(self, name: str) -> StageConfig:
        """The stage called `name`; KeyError if there is none."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r} (stages: {', '.join(self.stage_names)})")

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]
