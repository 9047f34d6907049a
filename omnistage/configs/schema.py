"""The configuration tree: frozen dataclasses, built once and passed down by constructor.

Facts measured at start-up (how many KV blocks fit) are *not* written here: they come back in
their own result objects (`omnistage.ar.kv_cache.KVCacheLayout`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from omnistage.configs.strict import from_dict
from omnistage.sampling_params import SamplingParams

StageKind = Literal["ar", "diffusion", "generation"]
OutputKind = Literal["text", "audio", "image", "video", "tensor"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # CUDA: share of device memory for weights + KV cache + activations of this stage.
    memory_fraction: float = 0.9
    # CPU: bytes for the KV cache (no device memory to measure).
    cpu_kv_cache_bytes: int = 1 << 30
    # Force an exact number of blocks (tests, debugging); None = from the memory budget.
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"kv_cache.block_size={self.block_size}: must be a power of two")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"kv_cache.memory_fraction={self.memory_fraction}: must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"kv_cache.num_blocks={self.num_blocks}: must be >= 1")


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
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # Never replay decode steps from CUDA graphs (debugging, or models that change per step).
    enforce_eager: bool = False
    # Launch a graph-replayed decode step before the previous one's tokens are read back, so
    # host and device work overlap (the same tokens; engine.py `step`).
    async_scheduling: bool = True


# ---- a stage's parallel layout (issue 18; the groups themselves: layers/groups.py) -------------
AXES = ("cfg", "ring", "ulysses", "tp")       # outermost first


@dataclass(frozen=True, slots=True)
class ParallelSizes:
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} size must be >= 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.ulysses * self.ring * self.cfg

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        out = {}
        for axis in reversed(AXES):                   # innermost first
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return out

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The rank lists that share every coordinate but `axis` (each one group)."""
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            groups.setdefault(tuple(v for a, v in c.items() if a != axis), []).append(r)
        return list(groups.values())



# ---- the stage graph --------------------------------------------------------------------------
# `__post_init__` errors start with the offending field name; the parser prepends the path, e.g.
# "stages[1].memory_fraction: must be in (0, 1], got 1.5".

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


@dataclass(frozen=True, slots=True)
class StageConfig:
    name: str
    kind: StageKind
    component: str | None = None  # which part of the checkpoint this stage loads
    model: str | None = None  # checkpoint for this stage; None = the graph's model
    inputs: tuple[StageInput, ...] = ()
    final: OutputKind | None = None  # this stage's output goes to the client
    devices: tuple[int, ...] = (0,)
    memory_fraction: float = 0.9
    dtype: DType = "auto"
    # diffusion: fp8 swaps the transformer's large linears for FP8 ones at load (layers/fp8.py;
    # a GPU of compute capability 8.9+). AR stages run in their dtype for now.
    quantization: Literal["fp8"] | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    tokenizer: str | None = None  # ar: tokenizer folder; None: the checkpoint's own
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    cpu_kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    output_hidden_layers: tuple[int, ...] = ()  # hidden states this stage emits downstream
    # Default SamplingParams fields of this stage; checked here, built by default_sampling().
    sampling: dict[str, object] = field(default_factory=dict, hash=False)
    startup_timeout_s: float = 120.0
    # A request waiting for input from upstream stages fails (kind "timeout") when none comes
    # for this long: an upstream that died or went silent never leaves it waiting forever.
    input_timeout_s: float = 300.0
    # A stage process whose busy loop sends no heartbeat for this long (a step that never
    # returns) is hung: the orchestrator kills it, which fails its requests and restarts it
    # where max_restarts allows. Longer than any one step may take. (A stopped process is
    # caught sooner, by liveness_timeout_s.)
    step_timeout_s: float = 600.0
    # A stage process (any rank of it) that sends no liveness beat for this long is taken for
    # stopped (SIGSTOP, a frozen host): the orchestrator SIGKILLs it, which fails or re-routes
    # its requests and restarts it where max_restarts allows. The beats come from a thread of
    # their own every 0.5 s, through any step however long (step_timeout_s is for a step that
    # never returns); only a C call that holds the GIL this long would also stop them.
    liveness_timeout_s: float = 10.0
    seed: int = 0
    enforce_eager: bool = False  # ar: no CUDA graphs for decode steps
    async_scheduling: bool = True  # ar: launch a decode step before reading the last one
    # Several GPUs for this stage (issue 18): one process per rank on the first
    # tensor_parallel_size * ulysses_degree * ring_degree * cfg_parallel_size of `devices`.
    tensor_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    # Whole copies of this stage (each with its own ranks), behind the orchestrator's router.
    replicas: int = 1
    # Each replica's devices, e.g. [[0], [1]]: one list per replica; empty: all use `devices`.
    replica_devices: tuple[tuple[int, ...], ...] = ()
    # A replica that dies is started again (in the background; it takes traffic once Ready)
    # up to this many times over the engine's life; 0: it stays down.
    max_restarts: int = 0
    # backend ray: custom resources each of the stage's actors requires besides its GPUs,
    # e.g. {node_b: 1} to pin it to the node started with `ray start --resources '{"node_b": 8}'`
    ray_resources: dict[str, float] = field(default_factory=dict, hash=False)
    # backend ray: the share of one GPU each rank's actor asks Ray for (Ray packs stages onto
    # GPUs by these shares); None: memory_fraction, or a tenth for a generation stage (a
    # vocoder's weights and activations are small). A stage of several ranks takes whole GPUs,
    # or its stated ray_gpus if above 0.5 (never two of its ranks on one GPU)
    ray_gpus: float | None = None
    # Component-specific options passed to its constructor (e.g. code2wav's chunk_frames).
    options: dict[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # Normalise list inputs (direct construction) so that the object compares and hashes.
        for name in ("inputs", "devices", "output_hidden_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "replica_devices", tuple(tuple(d) for d in self.replica_devices))
        object.__setattr__(self, "sampling", dict(self.sampling))
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "ray_resources", dict(self.ray_resources))

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if not _STAGE_NAME.fullmatch(self.name):
            bad("name", "must be letters, digits, '_' or '-' (overrides say NAME.KEY=VALUE)")
        if not self.devices or any(d < 0 for d in self.devices):
            bad("devices", "must be a non-empty list of device indices >= 0")
        if len(set(self.devices)) != len(self.devices):
            bad("devices", "must not repeat a device")
        if not 0.0 < self.memory_fraction <= 1.0:
            bad("memory_fraction", "must be in (0, 1]")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", "must be >= 1")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            bad("block_size", "must be a power of two")
        if self.cpu_kv_cache_bytes < 1:
            bad("cpu_kv_cache_bytes", "must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", "must be >= 1")
        if any(i < 0 for i in self.output_hidden_layers):
            bad("output_hidden_layers", "layer indices must be >= 0")
        if not self.startup_timeout_s > 0:
            bad("startup_timeout_s", "must be > 0")
        if not self.input_timeout_s > 0:
            bad("input_timeout_s", "must be > 0")
        if not self.step_timeout_s > 0:
            bad("step_timeout_s", "must be > 0")
        if not self.liveness_timeout_s > 0:
            bad("liveness_timeout_s", "must be > 0")
        for name in ("tensor_parallel_size", "ulysses_degree", "ring_degree",
                     "cfg_parallel_size"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.quantization is not None and self.kind != "diffusion":
            bad("quantization", f"applies to diffusion stages only for now; stage {self.name!r} "
                                f"is of kind {self.kind} and runs in its dtype")
        if self.replicas < 1:
            bad("replicas", "must be >= 1")
        if self.max_restarts < 0:
            bad("max_restarts", "must be >= 0")
        if self.replica_devices and len(self.replica_devices) != self.replicas:
            bad("replica_devices", f"must hold one device list per replica ({self.replicas})")
        if any(not d or min(d) < 0 or len(set(d)) != len(d) for d in self.replica_devices):
            bad("replica_devices", "each must be a non-empty list of distinct indices >= 0")
        if self.ray_gpus is not None and not 0.0 < self.ray_gpus <= 1.0:
            bad("ray_gpus", "must be in (0, 1]")
        if any(not v > 0 for v in self.ray_resources.values()):
            bad("ray_resources", "each amount must be > 0")
        if "output_hidden_layers" in self.sampling:
            raise ValueError("sampling.output_hidden_layers: set output_hidden_layers on the "
                             "stage, not in its sampling defaults")
        self.default_sampling()  # raises "sampling.<field>: ..." if the defaults are bad

    @property
    def parallel(self) -> ParallelSizes:
        """How this stage's ranks split (world size 1: one process, as before)."""
        return ParallelSizes(self.tensor_parallel_size, self.ulysses_degree, self.ring_degree,
                             self.cfg_parallel_size)

    @property
    def gpu_share(self) -> float:
        """The share of one GPU each rank asks Ray for (`ray_gpus`)."""
        if self.ray_gpus is not None:
            return self.ray_gpus
        return 0.1 if self.kind == "generation" else self.memory_fraction

    def devices_of(self, replica: int) -> tuple[int, ...]:
        """The devices of one replica: its own list, or the stage's."""
        return self.replica_devices[replica] if self.replica_devices else self.devices

    def default_sampling(self) -> SamplingParams:
        """This stage's default SamplingParams: `sampling`, plus the hidden layers it emits."""
        fields = dict(self.sampling)
        if self.output_hidden_layers:
            fields["output_hidden_layers"] = list(self.output_hidden_layers)
        return from_dict(SamplingParams, fields, "sampling")

    def ar_config(self, model: str, device: str) -> ARConfig:
        """The AR engine config of this (ar) stage. `model` is the graph's checkpoint, used when
        the stage names none; `device` is where the engine runs ("cpu", "cuda", "cuda:1")."""
        if self.kind != "ar":
            raise ValueError(f"stage {self.name!r} is a {self.kind} stage, not ar")
        return ARConfig(
            model=self.model if self.model is not None else model,
            component=self.component, tokenizer=self.tokenizer, device=device,
            dtype=self.dtype, seed=self.seed,
            enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling,
            kv_cache=KVCacheConfig(block_size=self.block_size,
                                   enable_prefix_caching=self.enable_prefix_caching,
                                   memory_fraction=self.memory_fraction,
                                   cpu_kv_cache_bytes=self.cpu_kv_cache_bytes,
                                   num_blocks=self.num_kv_blocks),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      max_model_len=self.max_model_len))


@dataclass(frozen=True, slots=True)
class GraphConfig:
    """The whole stage graph as written. Graph-level rules (unique names, no cycles, registered
    adapters) are checked by `omnistage.configs.graph.validate_graph`."""

    stages: tuple[StageConfig, ...]
    # auto: the backend's own (shm for process and inproc; under ray, per edge: shm when both
    # ends share a node, tcp when they do not); inproc needs backend inproc
    connector: Literal["auto", "inproc", "shm", "tcp"] = "auto"
    # process: one process per stage; inproc: every stage in the caller's process (tests, debug);
    # ray: one Ray actor per stage rank, placed on any node of a Ray cluster (stages/ray_actor.py)
    backend: Literal["process", "inproc", "ray"] = "process"
    model: str | None = None  # checkpoint of stages that name none
    # backend ray: the cluster to join ("auto", "ray://...", "HOST:PORT"); None: the one
    # RAY_ADDRESS or a running `ray start` names, else a new local one
    ray_address: str | None = None

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
