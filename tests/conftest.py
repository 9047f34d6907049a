"""Shared fixtures: tiny random checkpoints built once per session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.testing.tiny_models import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_tied"), "Qwen3ForCausalLM",
                                 tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "Qwen2ForCausalLM")
