"""`omnistage serve <folder>` picks the duplex server for a full-duplex family (Moshi) from the
checkpoint's architecture, and none for the others; flags the duplex server does not honour
are refused with a clear error before anything loads or binds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.configs.server import API_KEY_ENV
from omnistage.entrypoints.cli.main import parse_args
from omnistage.entrypoints.cli.serve_duplex import duplex_target, serve_duplex


@pytest.fixture
def moshi_folder(tmp_path: Path) -> Path:
    """A folder the registry matches by its config.json (nothing here loads the weights)."""
    path = tmp_path / "moshi"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["MoshiForConditionalGeneration"], "model_type": "moshi"}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_the_family_decides(moshi_folder: Path, tiny_qwen3: Path) -> None:
    assert duplex_target(str(moshi_folder)) == (moshi_folder,
                                                "omnistage.stages.moshi_duplex:MoshiDuplex")
    assert duplex_target(str(tiny_qwen3)) is None
    assert duplex_target(None) is None


@pytest.mark.parametrize("flags, name", [(["--tokenizer", "."], "--tokenizer"),
                                         (["--stage-config", "llm"], "--stage-config")])
def test_unhonoured_flags_are_refused(moshi_folder: Path, monkeypatch: pytest.MonkeyPatch,
                                      flags: list[str], name: str) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse_args(["serve", str(moshi_folder), *flags])
    with pytest.raises(ValueError, match=f"{name} is not supported when serving a "
                                         "full-duplex model"):
        serve_duplex(args, moshi_folder, "omnistage.stages.moshi_duplex:MoshiDuplex")
