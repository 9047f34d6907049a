"""The Ray launcher without Ray: backend ray says how to get it (the process backend needs none;
tests/engine/test_ray.py runs stages on a cluster)."""

from __future__ import annotations

import sys

import pytest


def test_backend_ray_without_ray_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnistage.stages.ray_actor import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)      # import ray: ImportError
    with pytest.raises(ImportError, match=r"omnistage\[ray\].*backend: process"):
        require_ray()
