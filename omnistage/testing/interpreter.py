"""Triton kernels on CPU tensors, for tests: Triton's interpreter runs them with numpy.

TRITON_INTERPRET must be set before `import torch` (which imports triton), so a test file
whose kernels should run here re-runs itself in a child process with it set:

    KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
    if KERNELS_HERE and not torch.cuda.is_available():
        patch_interpreter()

    @pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
    def test_kernels_in_triton_interpreter() -> None:
        run_in_interpreter(__file__)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter() -> None:
    """The interpreter turns a loaded scalar into a 1-element array, which numpy 2 refuses to
    convert with int() (a loop bound read from memory): convert through .item()."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


def run_in_interpreter(test_file: str | Path, timeout_s: float = 900) -> None:
    """Run the tests of `test_file` in a child process with TRITON_INTERPRET=1; assert they
    all passed (the child's output in the message otherwise)."""
    # the repository's root (where pyproject.toml is), at any depth under tests/
    root = next(p for p in Path(test_file).resolve().parents if (p / "pyproject.toml").exists())
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider", "-p",
         "no:warnings"], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root,
        capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0 and " passed" in proc.stdout, \
        proc.stdout[-4000:] + proc.stderr[-2000:]
