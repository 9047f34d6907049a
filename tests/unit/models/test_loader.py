"""The loader fails loudly and by name: missing, unexpected and mis-shaped tensors, unknown
architectures, and models that are neither a folder nor in the local HF cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from omnistage.models.loader import iter_safetensors, load_model, resolve_model_path
from omnistage.registry import model_class

CPU = torch.device("cpu")


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(tiny_qwen3: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    path = edited_copy(tiny_qwen3, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        load_model(path, CPU)


def test_missing_lm_head_is_fine_when_tied(tiny_qwen3_tied: Path, tmp_path: Path) -> None:
    assert "lm_head.weight" not in dict(iter_safetensors(tiny_qwen3_tied))
    # ... and a redundant copy of the tied head in the checkpoint is accepted too
    def add_head(t: dict[str, Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    path = edited_copy(tiny_qwen3_tied, tmp_path / "m", add_head)
    model, _, _ = load_model(path, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_misshaped_tensor_is_named_with_shapes(tiny_qwen3: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    path = edited_copy(tiny_qwen3, tmp_path / "m", lambda t: t.update({name: torch.zeros(100, 64)}))
    with pytest.raises(ValueError, match=rf"{name}.*expected shape \(128, 64\), got \(100, 64\)"):
        load_model(path, CPU)


def test_unexpected_tensor_is_named_and_inv_freq_ignored(tiny_qwen3: Path, tmp_path: Path) -> None:
    def add(t: dict[str, Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["model.layers.0.mlp.extra_proj.weight"] = torch.ones(2, 2)

    path = edited_copy(tiny_qwen3, tmp_path / "m", add)
    with pytest.raises(ValueError, match=r"unexpected tensors.*: model\.layers\.0\.mlp\.extra_proj"
                                         r"\.weight$"):
        load_model(path, CPU)


def test_unknown_architecture_lists_supported(tiny_qwen3: Path, tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'MadeUpForCausalLM' is not supported.*Qwen3ForCausalLM"):
        load_model(path, CPU)
    with pytest.raises(ValueError, match="supported: Qwen2ForCausalLM, Qwen3ForCausalLM"):
        model_class("LlamaForCausalLM")


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path, CPU)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


def test_resolve_local_folder(tiny_qwen3: Path) -> None:
    assert resolve_model_path(str(tiny_qwen3)) == tiny_qwen3


def test_resolve_neither_folder_nor_cached(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a model in the "
                                                "local Hugging Face cache.*hf download"):
        resolve_model_path("nobody/not-cached", cache_dir=tmp_path / "hf-cache")
    for path in (str(tmp_path / "no-such-model"), "./no-such-model", "~/no-such-model"):
        with pytest.raises(FileNotFoundError, match="no such folder") as err:
            resolve_model_path(path, cache_dir=tmp_path / "hf-cache")
        assert "download" not in str(err.value)   # a path names no repo to fetch


def test_resolve_cached_hf_model(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A repo in the HF cache layout: models--org--name/{refs/main, snapshots/<commit>/}."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--org--tiny"
    commit = "0" * 40
    shutil.copytree(tiny_qwen3, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    path = resolve_model_path("org/tiny", cache_dir=cache)
    assert path == repo / "snapshots" / commit
