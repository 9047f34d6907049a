"""The model-family table: lookups by architecture, diffusers class and component name, the
default graph of every family, and families registered from outside the production table."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


from omnistage import registry


def test_test_family_registers_from_the_testing_package(tmp_path: Path) -> None:
    """In a fresh interpreter the "testing" family is unknown until omnistage.testing's toy
    pipeline is imported; then it is known, and so in a process started afterwards (which
    inherits OMNISTAGE_FAMILY_MODULES), as spawned stage processes are."""
    script = textwrap.dedent("""
        import subprocess, sys
        from omnistage import registry
        assert "testing" not in registry.families()
        try:
            registry.load_component("generation", "token_embedder")
            raise SystemExit("token_embedder known before registration")
        except ValueError as e:
            assert "not registered" in str(e), e
        import omnistage.testing.toy_pipeline as toy
        assert registry.load_component("generation", "token_embedder") is toy.TokenEmbedder
        assert registry.adapter_module("testing.fail_marked") == toy.__name__
        child = ("from omnistage import registry; "
                 "print(registry.load_component('generation', 'token_embedder').__qualname__)")
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             check=True).stdout
        print(out.strip())
    """)
    env = {k: v for k, v in os.environ.items() if k != registry.FAMILY_MODULES_ENV}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).parents[2], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "TokenEmbedder"

