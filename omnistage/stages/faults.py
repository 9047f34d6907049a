"""Faults a test injects into a running stage worker: an out-of-memory error raised in its
next step, or its next step hung for some seconds (tests/system/engine/test_fault_matrix.py).

Inert unless the stage process starts with OMNISTAGE_FAULT_DIR set (read once, when the worker
is built): then, before each step, the worker looks for a file named after one of its faults,

    $OMNISTAGE_FAULT_DIR/<stage>.<replica>.oom      raise torch.OutOfMemoryError in this step
    $OMNISTAGE_FAULT_DIR/<stage>.<replica>.hang     sleep (the file's text: seconds) in this step

and takes it (removes it), so each file is one fault, once. A test arms one with `arm()`
while the engine serves; nothing of this runs in a server started without the variable.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

FAULT_DIR_ENV = "OMNISTAGE_FAULT_DIR"
FAULTS = ("oom", "hang")


class StepFaults:
    def __init__(self, folder: Path, stage: str, replica: int) -> None:
        self.files = {kind: folder / f"{stage}.{replica}.{kind}" for kind in FAULTS}

    @classmethod
    def from_env(cls, stage: str, replica: int) -> StepFaults | None:
        """The stage's hook if the fault folder is set in its environment, else None."""
        folder = os.environ.get(FAULT_DIR_ENV)
        return None if not folder else cls(Path(folder), stage, replica)

    def before_step(self) -> None:
        """Fire each armed fault once: its file taken, then the fault raised or slept."""
        for kind, path in self.files.items():
            try:
                text = path.read_text()
                path.unlink()
            except FileNotFoundError:
                continue
            if kind == "oom":
                raise torch.OutOfMemoryError("injected fault: out of memory in a step")
            time.sleep(float(text))


def arm(folder: Path, stage: str, kind: str, replica: int = 0, seconds: float = 0.0) -> Path:
    """Arm one fault for a stage's next step (the test's side); -> the file, gone once fired."""
    assert kind in FAULTS, kind
    path = Path(folder) / f"{stage}.{replica}.{kind}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{seconds:g}")
    tmp.replace(path)         # whole, so the worker never reads it half written
    return path
