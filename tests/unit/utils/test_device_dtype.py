"""resolve_dtype: "auto" reads a checkpoint's dtype on CUDA (float32 on the CPU); a pipeline
folder without a config.json of its own (GLM-Image's components) leaves it to the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.utils.device import resolve_dtype

CUDA = torch.device("cuda")     # only named: nothing runs on it


def test_auto_reads_the_checkpoint_on_cuda(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert resolve_dtype("auto", tmp_path, CUDA) is torch.bfloat16
    assert resolve_dtype("auto", tmp_path, torch.device("cpu")) is torch.float32
    assert resolve_dtype("float16", tmp_path, CUDA) is torch.float16


def test_a_folder_of_components_leaves_it_to_the_loader(tmp_path: Path) -> None:
    (tmp_path / "vision_language_encoder").mkdir()
    (tmp_path / "vision_language_encoder" / "config.json").write_text("{}")
    assert resolve_dtype("auto", tmp_path, CUDA) is None


def test_unknown_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype='fp4'"):
        resolve_dtype("fp4", tmp_path, CUDA)
