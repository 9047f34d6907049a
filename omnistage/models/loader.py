"""Find a checkpoint, build its model, stream the safetensors weights in.

    resolve_model_path("Qwen/Qwen3-0.6B" or "/ckpt/dir") -> folder with config.json
    load_model(folder, device, dtype) -> (model, ModelConfig, HF config)

Loading is strict, as nanoGPT's weight import is: a checkpoint tensor with no parameter, a
parameter with no checkpoint tensor, or a tensor of the wrong shape fails with its name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, TypeVar

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from omnistage import registry
from omnistage.layers.linear import default_weight_loader
from omnistage.models.compressed_tensors import quantized_linears
from omnistage.models.config import ModelConfig
from omnistage.utils.logging import Progress

PackedModules = Mapping[str, tuple[str, int | str]]
logger = logging.getLogger(__name__)

def _looks_like_path(model: str) -> bool:
    """./x, ../x, /x, ~/x, or a file path that exists (a repo id is `owner/name`)."""
    return model.startswith((".", "/", "~")) or Path(model).exists()


# Buffers some checkpoints carry that we recompute instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_model_path(model: str, cache_dir: str | Path | None = None) -> Path:
    """A local folder holding config.json (transformers) or model_index.json (diffusers), else
    an HF repo id already in the local HF cache. Never downloads."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not _is_model_folder(path):
            raise FileNotFoundError(f"model {model!r}: folder {path} has no config.json or "
                                    "model_index.json")
        return path
    try:
        snapshot = Path(snapshot_download(model, local_files_only=True, cache_dir=cache_dir))
    except (LocalEntryNotFoundError, HFValidationError) as e:
        if _looks_like_path(model):   # no download hint for a path: it names no repo
            raise FileNotFoundError(f"model {model!r}: no such folder") from e
        raise FileNotFoundError(
            f"model {model!r}: neither a local folder nor a model in the local Hugging Face cache "
            f"(nothing is downloaded; fetch it first, e.g. `hf download {model}`)") from e
    if not _is_model_folder(snapshot):
        raise FileNotFoundError(f"model {model!r}: cached snapshot {snapshot} has no config.json "
                                "or model_index.json")
    return snapshot


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "model_index.json").is_file() \
        or (path / "cosyvoice3.yaml").is_file() \
        or (path / "params.json").is_file()           # Mistral's format (Voxtral-TTS)


def safetensors_files(path: Path) -> list[str]:
    """`model.safetensors`, or the shards `model.safetensors.index.json` lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def iter_safetensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    """(name, CPU tensor) for every tensor of `model.safetensors` or of the shards listed in
    `model.safetensors.index.json`."""
    sizes = {path / file: tensor_nbytes(path / file) for file in safetensors_files(path)}
    yield from read_tensors({file: sorted(nbytes) for file, nbytes in sizes.items()}, sizes,
                             f"Loading {path.name}")


def tensor_nbytes(file: Path) -> dict[str, int]:
    """{tensor name: bytes} of a safetensors file, from its header alone (an 8-byte length,
    then JSON with each tensor's data offsets)."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {name: end - start for name, meta in header.items() if name != "__metadata__"
            for start, end in [meta["data_offsets"]]}


def read_tensors(files: dict[Path, list[str]], sizes: dict[Path, dict[str, int]], desc: str,
                 prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """(name less `prefix`, CPU tensor) for the named tensors of each file, with the bytes read
    reported as they come (a bar on a terminal, log lines otherwise)."""
    total = sum(sizes[file][name] for file, names in files.items() for name in names)
    with Progress(total, desc, logger) as progress:
        for file, names in files.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    progress.update(sizes[file][name])
                    yield name[len(prefix):], tensor


def load_packed_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]],
                        packed_modules: PackedModules) -> set[str]:
    """Copy checkpoint tensors into `model`'s parameters, routing the ones named in
    `packed_modules` (e.g. `q_proj` -> shard "q" of `qkv_proj`) to their fused parameter.
    Returns the parameter names loaded; names that map to no parameter are skipped (the caller
    decides whether that is an error). A shape mismatch raises ValueError naming the tensor."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        parts = name.split(".")
        shard_id = None
        for i, part in enumerate(parts):
            if part in packed_modules:
                parts[i], shard_id = packed_modules[part]
                break
        param_name = ".".join(parts)
        param = params.get(param_name)
        if param is None:
            continue
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.add(param_name)
    return loaded


def checkpoint_names(model: nn.Module, packed_modules: PackedModules) -> set[str]:
    """The checkpoint tensor names `model` expects: its parameter names with every fused
    parameter expanded back into the tensors it is packed from."""
    sources: dict[str, list[str]] = {}
    for src, (dst, _) in packed_modules.items():
        sources.setdefault(dst, []).append(src)
    names: set[str] = set()
    for param_name, _ in model.named_parameters():
        parts = param_name.split(".")
        idx = next((i for i, p in enumerate(parts) if p in sources), None)
        if idx is None:
            names.add(param_name)
            continue
        for src in sources[parts[idx]]:
            names.add(".".join([*parts[:idx], src, *parts[idx + 1:]]))
    return names


_DEFAULT_DTYPE_LOCK = threading.RLock()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build a model in `dtype`. The default dtype is process-wide: stages that load in
    threads of one process (backend: inproc) take turns, or one could restore another's
    setting and leave the process in bfloat16."""
    with _DEFAULT_DTYPE_LOCK:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(prev)


def check_tensor_names(path: Path, model_name: str, expected: set[str], found: set[str]
                       ) -> None:
    """Raise ValueError naming missing and unexpected checkpoint tensors."""
    missing, unexpected = expected - found, found - expected
    problems = []
    if missing:
        problems.append(f"missing tensors: {_name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors (no parameter takes them): {_name_list(unexpected)}")
    if problems:
        raise ValueError(f"{path} does not match {model_name}: " + "; ".join(problems))


def _name_list(names: Iterable[str], limit: int = 10) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_model(path: Path, device: torch.device, dtype: torch.dtype | None = None
               ) -> tuple[nn.Module, ModelConfig, PretrainedConfig]:
    """Build the model named by `path`/config.json on `device` in `dtype` (None: the
    checkpoint's dtype) and load its weights."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
    hf_config = AutoConfig.from_pretrained(path)
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    cfg = ModelConfig.from_hf(hf_config, generation_config)
    model_cls = registry.model_class(cfg.architecture)
    dtype = dtype or getattr(torch, cfg.torch_dtype)

    with _default_dtype(dtype), torch.device(device):
        model = model_cls(cfg)
    if getattr(hf_config, "quantization_config", None) is not None:   # FP8 or int4 in the file
        names = {n for f in safetensors_files(path) for n in tensor_nbytes(path / f)}
        quantized_linears(model, hf_config, names, model.packed_modules)

    seen: list[str] = []

    def recorded(weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            seen.append(name)
            yield name, tensor

    loaded = model.load_weights(recorded(iter_safetensors(path)))

    expected = checkpoint_names(model, model.packed_modules)
    ignored = {n for n in seen if n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        ignored.add("lm_head.weight")   # the embedding is the head; a saved copy is redundant
    check_tensor_names(path, cfg.architecture, expected, set(seen) - ignored)
    not_loaded = {n for n, _ in model.named_parameters()} - loaded
    assert not not_loaded, f"parameters not loaded although the checkpoint has them: {not_loaded}"
    return model.eval(), cfg, hf_config


# ---- one component of a multi-part checkpoint (Qwen3-Omni's thinker, talker, code2wav, ...) --

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64}


def component_tensor_files(path: Path, prefix: str, exclude: tuple[str, ...] = (),
                           ignore_suffixes: tuple[str, ...] = ()) -> dict[Path, list[str]]:
    """{safetensors file: its tensor names under `prefix`, less `prefix + e` for e in
    `exclude` and the names ending in one of `ignore_suffixes`} for `model.safetensors` or the
    shards of `model.safetensors.index.json`; shards holding none are never opened."""
    path = Path(path)

    def wanted(name: str) -> bool:
        return (name.startswith(prefix) and not name[len(prefix):].startswith(exclude)
                and not name.endswith(ignore_suffixes or ("\0",)))

    index = path / "model.safetensors.index.json"
    files: dict[Path, list[str]] = {}
    if index.is_file():
        for name, file in json.loads(index.read_text())["weight_map"].items():
            if wanted(name):
                files.setdefault(path / file, []).append(name)
    elif (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", framework="pt", device="cpu") as f:
            files[path / "model.safetensors"] = [n for n in f.keys() if wanted(n)]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return {file: sorted(names) for file, names in files.items() if names}


def iter_component_tensors(path: Path | dict[Path, list[str]], prefix: str,
                           exclude: tuple[str, ...] = ()) -> Iterator[tuple[str, Tensor]]:
    """(name without `prefix`, CPU tensor), one at a time, for the component's tensors
    (`path`: a checkpoint folder, or what `component_tensor_files` returned for it)."""
    files = path if isinstance(path, dict) else component_tensor_files(path, prefix, exclude)
    sizes = {file: tensor_nbytes(file) for file in files}
    where = next(iter(files)).parent.name if files else ""
    yield from read_tensors(files, sizes, f"Loading {where} {prefix.rstrip('.')}".rstrip(),
                             prefix)


def component_dtype(files: dict[Path, list[str]]) -> torch.dtype:
    """The dtype of the component's first floating-point tensor (float32 if none)."""
    for file, names in files.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    return torch.float32


M = TypeVar("M", bound=nn.Module)


def build_and_load(model_cls: type[M], config: object, model_config: ModelConfig, path: Path,
                   device: torch.device | str, dtype: torch.dtype | None) -> M:
    """`model_cls(config)` on `device` in `dtype` (None: `model_config.torch_dtype`), then
    every tensor under the class's `checkpoint_prefix` (less its `checkpoint_exclude`),
    strictly: a missing, unexpected or mis-shaped tensor raises ValueError with its full
    checkpoint name."""
    dtype = dtype or getattr(torch, model_config.torch_dtype)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config)
    prefix = model_cls.checkpoint_prefix
    seen: list[str] = []

    def recorded() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in iter_component_tensors(path, prefix, model_cls.checkpoint_exclude):
            seen.append(name)
            yield name, tensor

    with torch.no_grad():
        try:
            loaded = model.load_weights(recorded())
        except ValueError as e:   # name the tensor as the checkpoint does, with its prefix
            msg = str(e).replace(repr(seen[-1]), repr(prefix + seen[-1]), 1) if seen else str(e)
            raise ValueError(f"{path}: {msg}") from None
    expected = model.checkpoint_names()
    found = set(seen)
    if model_config.tie_word_embeddings:   # the embedding is the head; a saved copy is redundant
        found -= {"lm_head.weight", "codec_head.weight"}
    check_tensor_names(path, f"{model_cls.__name__} ({prefix}*)",
                       {prefix + n for n in expected}, {prefix + n for n in found})
    not_loaded = {n for n, _ in model.named_parameters()} - loaded
    assert not not_loaded, f"parameters not loaded although the checkpoint has them: {not_loaded}"
    return model.eval()


def load_component(build: Callable[[], M], path: Path, prefix: str, device: torch.device | str,
                   dtype: torch.dtype | None, packed_modules: PackedModules,
                   exclude: tuple[str, ...] = (), ignore_suffixes: tuple[str, ...] = ()) -> M:
    """`build()` on `device` in `dtype` (None: the component's), then the checkpoint's
    `prefix*` tensors (less `exclude` and `ignore_suffixes`, see `component_tensor_files`),
    strictly: a missing, unexpected or mis-shaped tensor raises ValueError with its full
    name. In eval mode."""
    files = component_tensor_files(path, prefix, exclude, ignore_suffixes)
    if not files:
        raise ValueError(f"{path}: the checkpoint has no {prefix}* tensors")
    with _default_dtype(dtype or component_dtype(files)), torch.device(device):
        model = build()
    seen: list[str] = []

    def recorded() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in iter_component_tensors(files, prefix):
            seen.append(name)
            yield name, tensor

    with torch.no_grad():
        try:
            loaded = load_packed_weights(model, recorded(), packed_modules)
        except ValueError as e:
            raise ValueError(f"{path} ({prefix}*): {e}") from None
    expected = {prefix + n for n in checkpoint_names(model, packed_modules)}
    check_tensor_names(path, type(model).__name__, expected, {prefix + n for n in seen})
    not_loaded = {n for n, _ in model.named_parameters()} - loaded
    assert not not_loaded, f"parameters not loaded: {sorted(not_loaded)}"
    return model.eval()
