"""`omnistage.__version__` is the project's version (pyproject.toml in a checkout)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import omnistage


def test_version_is_the_projects() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert omnistage.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
    assert "__version__" in omnistage.__all__
