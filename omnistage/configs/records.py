"""The sub-records of a stage's configuration: where it runs (`Placement`), how its ranks split
(`ParallelSizes`), how long it may take (`Timeouts`) and what each kind of engine reads
(`ARSettings`, `DiffusionSettings`, `GenerationSettings`). Each is frozen and checks itself;
schema.py's `StageConfig` holds one of each.

A field's metadata (`meta(...)`) is its documentation: `help` is the line the configuration
reference prints (scripts/config_doc.py), and `flag` names the `omnistage serve` flag and
`Omni(...)` keyword that sets it on the main stage (configs/flags.py derives both from it).
A `__post_init__` message starts with the offending field's name; the strict parser
(strict.py) prepends the path, e.g. "stages[1].placement.memory_fraction: must be in (0, 1]".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omnistage.configs.quantization import Quantization, check_diffusion, read_quantization
from omnistage.configs.strict import from_dict
from omnistage.sampling_params import SamplingParams

StageKind = Literal["ar", "diffusion", "generation"]
OutputKind = Literal["text", "audio", "image", "video", "tensor"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
ALL_KINDS: tuple[StageKind, ...] = ("ar", "diffusion", "generation")


def meta(help: str, *, flag: str | None = None, kinds: tuple[StageKind, ...] | None = None,
         every_stage: bool = False, keyword_every_stage: bool | None = None, cli: bool = True,
         keyword: bool = True, **argparse_kw: Any) -> dict[str, Any]:
    """A field's documentation. `flag`: the vLLM name (`max_num_seqs` -> `--max-num-seqs`,
    `Omni(max_num_seqs=...)`) that sets it; `kinds`: the stage kinds that read it (default:
    those of its record); `every_stage`: the flag sets it on every stage of those kinds, not
    only the main one (`keyword_every_stage`: the same for the `Omni` keyword, where it
    differs); `cli` / `keyword`: whether `serve` has the flag / `Omni` the keyword;
    `argparse_kw`: what the flag needs beyond its type (metavar, `short`, `action`)."""
    out: dict[str, Any] = {"help": help}
    if flag is not None:
        out["flag"] = dict(
            name=flag, kinds=kinds, every_stage=every_stage, cli=cli, keyword=keyword,
            keyword_every_stage=every_stage if keyword_every_stage is None
            else keyword_every_stage, argparse=argparse_kw)
    return out


def _bad(record: object, name: str, why: str) -> ValueError:
    return ValueError(f"{name}: {why}, got {getattr(record, name)!r}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a stage's processes run and how many copies of it there are."""

    devices: tuple[int, ...] = field(default=(0,), metadata=meta(
        "device indices; the first world-size of them hold the stage's ranks"))
    memory_fraction: float = field(default=0.9, metadata=meta(
        "share of the device for weights, KV cache and activations, in (0, 1]; stages "
        "sharing a device keep the sum at most 1", flag="gpu_memory_utilization",
        metavar="F"))
    replicas: int = field(default=1, metadata=meta(
        "whole copies of the stage (each with its own ranks) behind the orchestrator's router"))
    replica_devices: tuple[tuple[int, ...], ...] = field(default=(), metadata=meta(
        "each replica's devices, e.g. [[0], [1]]; empty: all use `devices`"))
    max_restarts: int = field(default=0, metadata=meta(
        "times a replica that dies is started again over the engine's life (0: it stays down)"))
    ray_resources: dict[str, float] = field(default_factory=dict, hash=False, metadata=meta(
        "backend ray: custom resources each actor requires besides its GPUs, e.g. {node_b: 1}"))
    ray_gpus: float | None = field(default=None, metadata=meta(
        "backend ray: the share of one GPU each rank's actor asks for; null: memory_fraction "
        "(a tenth for a generation stage); a stage of several ranks takes whole GPUs"))
    stream_priority: int = field(default=0, metadata=meta(
        "CUDA priority of the stream the stage's work runs on: 0 normal, negative higher "
        "(Hopper's range is -5..0; torch clamps to the device's); stages that share a GPU in "
        "one process (backend inproc) get the higher one's kernels run first, while processes "
        "on one GPU time-slice and their priorities do not meet"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "replica_devices", tuple(tuple(d) for d in self.replica_devices))
        object.__setattr__(self, "ray_resources", dict(self.ray_resources))
        if not self.devices or any(d < 0 for d in self.devices):
            raise _bad(self, "devices", "must be a non-empty list of device indices >= 0")
        if len(set(self.devices)) != len(self.devices):
            raise _bad(self, "devices", "must not repeat a device")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise _bad(self, "memory_fraction", "must be in (0, 1]")
        if self.replicas < 1:
            raise _bad(self, "replicas", "must be >= 1")
        if self.max_restarts < 0:
            raise _bad(self, "max_restarts", "must be >= 0")
        if self.replica_devices and len(self.replica_devices) != self.replicas:
            raise _bad(self, "replica_devices",
                       f"must hold one device list per replica ({self.replicas})")
        if any(not d or min(d) < 0 or len(set(d)) != len(d) for d in self.replica_devices):
            raise _bad(self, "replica_devices",
                       "each must be a non-empty list of distinct indices >= 0")
        if self.ray_gpus is not None and not 0.0 < self.ray_gpus <= 1.0:
            raise _bad(self, "ray_gpus", "must be in (0, 1]")
        if self.stream_priority > 0:
            raise _bad(self, "stream_priority", "must be <= 0 (0: normal; negative: higher)")
        if any(not v > 0 for v in self.ray_resources.values()):
            raise _bad(self, "ray_resources", "each amount must be > 0")

    def devices_of(self, replica: int) -> tuple[int, ...]:
        """The devices of one replica: its own list, or the stage's."""
        return self.replica_devices[replica] if self.replica_devices else self.devices


# ---- a stage's parallel layout (issue 18; the groups themselves: layers/groups.py) -------------
AXES = ("cfg", "ring", "ulysses", "tp")       # outermost first


@dataclass(frozen=True, slots=True)
class ParallelSizes:
    """How a stage's ranks split: one process per rank on the first world-size devices."""

    tp: int = field(default=1, metadata=meta(
        "tensor parallel: the weights split over N GPUs",
        flag="tensor_parallel_size", kinds=("ar", "diffusion"), metavar="N", short="-tp"))
    ulysses: int = field(default=1, metadata=meta(
        "a diffusion stage's sequence split over N GPUs (all-to-all around attention)",
        flag="ulysses_degree", kinds=("diffusion",), metavar="N"))
    ring: int = field(default=1, metadata=meta(
        "a diffusion stage's keys and values passed round N GPUs (ring attention)",
        flag="ring_degree", kinds=("diffusion",), metavar="N"))
    cfg: int = field(default=1, metadata=meta(
        "a true-CFG diffusion stage's positive and negative branches on 2 GPUs",
        flag="cfg_parallel_size", kinds=("diffusion",), metavar="N"))

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}: must be >= 1, got {getattr(self, axis)}")

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


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long a stage may take before the orchestrator gives up on it."""

    startup_s: float = field(default=120.0, metadata=meta(
        "seconds a stage process may take to load and report ready",
        flag="startup_timeout_s", every_stage=True, cli=False))
    # an upstream that died or went silent never leaves a request waiting forever
    input_s: float = field(default=300.0, metadata=meta(
        "a request waiting for input from upstream fails (kind timeout) when none comes "
        "for this long"))
    step_s: float = field(default=600.0, metadata=meta(
        "a busy loop that sends no heartbeat this long (a step that never returns) is hung: "
        "killed, its requests failed, restarted where max_restarts allows"))
    # beats come from a thread of their own every 0.5 s, through any step however long
    liveness_s: float = field(default=10.0, metadata=meta(
        "a process (any rank) that sends no liveness beat this long is taken for stopped "
        "(SIGSTOP, a frozen host) and SIGKILLed"))

    def __post_init__(self) -> None:
        for name in ("startup_s", "input_s", "step_s", "liveness_s"):
            if not getattr(self, name) > 0:
                raise _bad(self, name, "must be > 0")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The paged KV cache of an ar stage (its memory budget is the placement's
    memory_fraction, handed to the engine in `ARConfig`)."""

    block_size: int = field(default=16, metadata=meta(
        "tokens per KV block (a power of two)", flag="block_size", cli=False))
    enable_prefix_caching: bool = field(default=True, metadata=meta(
        "reuse the KV cache of shared prompt prefixes", flag="enable_prefix_caching",
        action="bool_optional"))
    # CPU: bytes for the KV cache (no device memory to measure).
    cpu_kv_cache_bytes: int = field(default=1 << 30, metadata=meta(
        "on CPU: bytes for the KV cache"))
    # Force an exact number of blocks (tests, debugging); None = from the memory budget.
    num_blocks: int | None = field(default=None, metadata=meta(
        "an exact number of KV blocks (tests, debugging); null: from the memory budget"))

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise _bad(self, "block_size", "must be a power of two")
        if self.cpu_kv_cache_bytes < 1:
            raise _bad(self, "cpu_kv_cache_bytes", "must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise _bad(self, "num_blocks", "must be >= 1")


def _check_count(record: object, name: str, minimum: int = 1) -> None:
    value = getattr(record, name)
    if value is not None and value < minimum:
        raise _bad(record, name, f"must be >= {minimum}")


@dataclass(frozen=True, slots=True)
class ARSettings:
    """What an autoregressive stage's engine reads besides its checkpoint (`stage.ar`)."""

    max_num_seqs: int = field(default=64, metadata=meta(
        "requests batched together", flag="max_num_seqs", metavar="N"))
    max_num_batched_tokens: int = field(default=2048, metadata=meta(
        "tokens per engine step", flag="max_num_batched_tokens", metavar="N"))
    max_model_len: int | None = field(default=None, metadata=meta(
        "prompt + output tokens of a request; null: the model's max_position_embeddings "
        "(above it is refused)", flag="max_model_len", metavar="N"))
    enable_chunked_prefill: bool = field(default=True, metadata=meta(
        "split long prompts over several steps", flag="enable_chunked_prefill", cli=False))
    tokenizer: str | None = field(default=None, metadata=meta(
        "a tokenizer folder or cached Hub id used instead of the checkpoint's (not for "
        "models with an input processor)", flag="tokenizer", keyword=False,
        metavar="FOLDER"))
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig, metadata=meta(
        "the paged KV cache"))
    quantization: Quantization | str | None = field(default=None, metadata=meta(
        "per component (configs/quantization.py): an ar stage's model fp8 / int8 / int4 (a "
        "bare method, or thinker= / talker=), a diffusion stage's transformer fp8 / int8 / "
        "gguf:FILE, text_encoder int8 and attention fp8 (COMPONENT=METHOD,...); fp8 needs a "
        "GPU of compute capability 8.9+", flag="quantization", metavar="SPEC"))
    enforce_eager: bool = field(default=False, metadata=meta(
        "no CUDA graphs for decode steps", flag="enforce_eager", keyword_every_stage=True,
        action="store_true"))
    max_graph_tokens: int = field(default=512, metadata=meta(
        "steps with prompt rows (prefills, mixed steps) of up to N tokens replay CUDA graphs "
        "as decodes do (0: they run eagerly)", flag="max_graph_tokens", metavar="N"))
    async_scheduling: bool = field(default=True, metadata=meta(
        "launch a graph-replayed decode step before the previous one's tokens are read back "
        "(host and device work overlap; the same tokens)", flag="async_scheduling",
        every_stage=True, cli=False))
    seed: int = field(default=0, metadata=meta(
        "sampling seed of requests that name none", flag="seed", keyword_every_stage=True))
    output_hidden_layers: tuple[int, ...] = field(default=(), metadata=meta(
        "hidden-state layers this stage emits downstream (an edge's adapter reads them)"))
    # checked here, built by default_sampling()
    sampling: dict[str, object] = field(default_factory=dict, hash=False, metadata=meta(
        "this stage's default SamplingParams fields (temperature, top_k, max_tokens, ...)"))
    options: dict[str, object] = field(default_factory=dict, hash=False, metadata=meta(
        "model-specific options: the fields of its stage class's `Options` record, checked "
        "when the stage is built (a talker's code_predictor_cuda_graphs)"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_hidden_layers", tuple(self.output_hidden_layers))
        object.__setattr__(self, "sampling", dict(self.sampling))
        object.__setattr__(self, "options", dict(self.options))
        try:
            object.__setattr__(self, "quantization", read_quantization(self.quantization))
        except ValueError as e:
            raise ValueError(f"quantization: {e}") from None
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _check_count(self, name)
        _check_count(self, "max_graph_tokens", 0)
        if any(i < 0 for i in self.output_hidden_layers):
            raise _bad(self, "output_hidden_layers", "layer indices must be >= 0")
        if "output_hidden_layers" in self.sampling:
            raise ValueError("sampling.output_hidden_layers: set ar.output_hidden_layers on "
                             "the stage, not in its sampling defaults")
        self.default_sampling()  # raises "sampling.<field>: ..." if the defaults are bad

    def default_sampling(self) -> SamplingParams:
        """The stage's default SamplingParams: `sampling`, plus the hidden layers it emits."""
        fields = dict(self.sampling)
        if self.output_hidden_layers:
            fields["output_hidden_layers"] = list(self.output_hidden_layers)
        return from_dict(SamplingParams, fields, "sampling")


@dataclass(frozen=True, slots=True)
class DiffusionSettings:
    """What a diffusion stage's engine reads besides its checkpoint (`stage.diffusion`)."""

    max_num_seqs: int = field(default=64, metadata=meta(
        "requests denoised together", flag="max_num_seqs", metavar="N"))
    quantization: Quantization | str | None = field(default=None, metadata=meta(
        "per component (configs/quantization.py): fp8 / int8 / gguf:FILE for the "
        "transformer, or COMPONENT=METHOD,... (transformer, text_encoder); fp8 needs a GPU "
        "of compute capability 8.9+", flag="quantization", metavar="SPEC"))
    compile: bool | str | None = field(default=None, metadata=meta(
        "compile the transformer blocks: true, false or a torch.compile backend; null: the "
        "pipeline's compile_default on CUDA, one rank"))
    cuda_graphs: bool | int | None = field(default=None, metadata=meta(
        "replay denoising steps from CUDA graphs: true, false or the most graphs; null: on "
        "for a CUDA device and a pipeline whose transformer captures"))
    offload: bool | int | None = field(default=None, metadata=meta(
        "keep the transformer's blocks in host memory, each copied to the GPU as it comes: "
        "true (one block ahead) or the blocks fetched ahead; for a transformer larger than "
        "its GPU (neither compiled nor graphed then)"))
    cudnn_attention: bool = field(default=True, metadata=meta(
        "attention through cuDNN's kernel (1.7x flash's at Qwen-Image's 1024 px on an H200); "
        "it builds a graph once per new sequence length (each prompt length is one): false "
        "serves the first request of each length sooner. The switch is the process's: "
        "backend inproc keeps it off"))
    options: dict[str, object] = field(default_factory=dict, hash=False, metadata=meta(
        "the fields of the pipeline class's `Options` record, checked when the stage is "
        "built (SD3's skip_layer_guidance)"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options))
        try:
            object.__setattr__(self, "quantization",
                               check_diffusion(read_quantization(self.quantization)))
        except ValueError as e:
            raise ValueError(f"quantization: {e}") from None
        _check_count(self, "max_num_seqs")
        if isinstance(self.cuda_graphs, int) and not isinstance(self.cuda_graphs, bool):
            _check_count(self, "cuda_graphs")
        if isinstance(self.offload, int) and not isinstance(self.offload, bool):
            _check_count(self, "offload")

    @property
    def offload_blocks(self) -> int:
        """Blocks fetched ahead by an offloaded transformer; 0: not offloaded."""
        return int(self.offload) if self.offload is not None else 0

    @property
    def option_items(self) -> dict[str, object]:
        """The generic options that are set, beside the pipeline's own (what `options` held
        before they were typed)."""
        typed = {"compile": self.compile, "cuda_graphs": self.cuda_graphs}
        return {**{k: v for k, v in typed.items() if v is not None}, **self.options}


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """What a generation stage (a vocoder, a decoder) reads (`stage.generation`)."""

    max_num_seqs: int = field(default=64, metadata=meta("requests stepped together"))
    # model-specific: each component's constructor takes its own (code2wav's chunk_frames,
    # token2wav's num_steps); it refuses a name it does not know
    options: dict[str, object] = field(default_factory=dict, hash=False, metadata=meta(
        "the fields of the component's `Options` record, checked when the stage is built "
        "(code2wav's chunk_frames)"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options))
        _check_count(self, "max_num_seqs")
