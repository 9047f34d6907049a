"""Shared fixtures: tiny random checkpoints built once per session (no downloads); the tier
markers, applied by folder.

Tiers (docs/testing.md): tests/unit (no subprocesses, no model beyond a few layers: the inner
loop, `pytest tests/unit`), tests/golden (against references: transformers, diffusers,
qwen-tts, fixtures), tests/system (servers, stage processes, Ray, the browser), tests/gpu. A
test's tier is the first folder under tests/ when that folder is a tier; the rule tests at
tests/test_*.py are static scans and count as unit. Files still in a package-mirror folder
(tests/ar, tests/engine, ... before the move to tiers) get no tier marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.testing.tiny_models import build_tiny_checkpoint

TIERS = ("unit", "golden", "system", "gpu")
TESTS = Path(__file__).resolve().parent


def tier_of(path: Path) -> str | None:
    """The tier of the test file at `path` by its folder, or None outside the tier folders."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:        # a file outside tests/ (pytest given an absolute path elsewhere)
        return None
    if len(parts) == 1:       # tests/test_*.py: the rule tests, scans of the source
        return "unit"
    return parts[0] if parts[0] in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # by folder, so that `-m unit` and `pytest tests/unit` select the same tests and no file
    # can forget its marker
    for item in items:
        tier = tier_of(Path(str(item.path)))
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


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


@pytest.fixture(scope="session")
def qwen3_tts_ref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Qwen3-TTS checkpoints (DIR/custom_voice, voice_design, base), built by the
    `qwen-tts` reference in its own environment, and its outputs for every case of
    omnistage/testing/tiny_tts.py (skipped without that environment)."""
    from omnistage.testing.tiny_tts import (CASES, reference_missing, reference_request,
                                            run_reference)

    missing = reference_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("qwen3_tts")
    out = run_reference(root, [reference_request(n) for n in CASES])
    by_name = {name: {k.split(".", 1)[1]: v for k, v in out.items() if k.startswith(f"{i}.")}
               for i, name in enumerate(CASES)}
    return {"root": root, **by_name}


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random SDXL folder (omnistage/testing/tiny_sdxl.py): a pipeline served by the
    generic diffusers adapter."""
    pytest.importorskip("diffusers")
    from omnistage.testing.tiny_sdxl import build_tiny_sdxl

    folder = tmp_path_factory.mktemp("tiny_sdxl")
    build_tiny_sdxl(folder)
    return folder
