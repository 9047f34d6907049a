"""The stage worker's fault hook (stages/faults.py) is off unless OMNISTAGE_FAULT_DIR is set,
and an armed fault fires once, in the next step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.stages.faults import FAULT_DIR_ENV, StepFaults, arm


def test_the_hook_is_off_without_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_DIR_ENV, raising=False)
    assert StepFaults.from_env("llm", 0) is None
    monkeypatch.setenv(FAULT_DIR_ENV, "")
    assert StepFaults.from_env("llm", 0) is None


def test_an_armed_fault_fires_once_in_its_stage_only(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_DIR_ENV, str(tmp_path))
    talker, thinker = StepFaults.from_env("talker", 0), StepFaults.from_env("thinker", 0)
    assert talker is not None and thinker is not None
    path = arm(tmp_path, "talker", "oom")
    thinker.before_step()                      # another stage's fault is not its own
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        talker.before_step()
    assert not path.exists()
    talker.before_step()                       # taken: the next step runs
    arm(tmp_path, "talker", "hang", seconds=0.01)
    talker.before_step()
    assert list(tmp_path.iterdir()) == []
