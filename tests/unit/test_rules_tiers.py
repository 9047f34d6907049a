"""Issue 39.6's rule, on the source: the unit tier (tests/unit, and the rule tests beside this
file) starts no process and no server, so that `pytest tests/unit` stays the inner loop (under
2 minutes on 2 cores); the tiers the conftest applies by folder are the markers pyproject
declares. Checked with the AST (imports and calls, lazy ones included), plus a check that the
checker is not vacuous."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

# tests/ itself, from here or from tests/unit after the move to tiers
TESTS = next(p for p in Path(__file__).resolve().parents if p.name == "tests")
ROOT = TESTS.parent
TIERS = ("unit", "golden", "system", "gpu")
# what makes a test a system test: a child process, a server, Ray, several ranks
BANNED_MODULES = {"subprocess", "multiprocessing", "ray", "selenium"}
BANNED_CALLS = {"Popen", "run_ranks", "start_stage_process", "run_in_interpreter"}
BANNED_FIXTURES = {"servers", "text_server", "image_server", "omni_server", "start_server",
                   "browser"}


def violations(path: Path) -> list[str]:
    """What in `path` starts a process or a server: 'file:line what'."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name in BANNED_CALLS]
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n in BANNED_MODULES]
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in BANNED_CALLS:
                found.append(f"{path.name}:{node.lineno} calls {name}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"{path.name}:{node.lineno} {node.name} uses the {a.arg} fixture"
                      for a in node.args.args if a.arg in BANNED_FIXTURES]
    return found


def unit_files() -> list[Path]:
    return sorted((TESTS / "unit").rglob("*.py")) if (TESTS / "unit").is_dir() else []


def test_the_unit_tier_starts_no_process_and_no_server() -> None:
    files = unit_files()
    if not files:
        pytest.skip("no tests/unit yet: the files are still in the package folders "
                    "(/tmp/h/move_tiers.sh moves them)")
    bad = [v for path in files for v in violations(path)]
    assert not bad, "\n".join(bad)


def test_the_tiers_are_the_declared_markers() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tests_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    assert tuple(conftest.TIERS) == TIERS
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    declared = {m.split(":")[0] for m in pytest_ini["ini_options"]["markers"]}
    assert set(TIERS) <= declared, declared
    assert "slow" not in declared      # the tiers replaced it
    for tier in TIERS:
        assert conftest.tier_of(TESTS / tier / "x" / "test_y.py") == tier
    assert conftest.tier_of(TESTS / "test_rules_x.py") == "unit"
    assert conftest.tier_of(TESTS / "ar" / "test_x.py") is None


def test_the_check_sees_processes_and_servers(tmp_path: Path) -> None:
    """The checker is not vacuous: it finds a subprocess import, a lazy Ray import, a call
    of run_ranks, a server fixture; a clean file passes."""
    bad = tmp_path / "test_bad.py"
    bad.write_text("import subprocess\n"
                   "from omnistage.testing.ranks import run_ranks\n"
                   "def test_a(text_server):\n    import ray\n    run_ranks('m:f', 2, {}, '.')\n")
    found = {f.split(" ", 1)[1] for f in violations(bad)}
    assert found == {"imports subprocess", "imports run_ranks", "imports ray",
                     "test_a uses the text_server fixture", "calls run_ranks"}, found
    clean = tmp_path / "test_ok.py"
    clean.write_text("import torch\ndef test_b(tiny_qwen3):\n    assert torch.ones(1)\n")
    assert violations(clean) == []
