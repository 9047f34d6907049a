"""A stage over several ranks (issue 18): layouts the checkpoint cannot split are refused before
any process starts, naming the stage and what does not divide."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage import Omni
from omnistage.configs.schema import StageConfig
from omnistage.stages.ranks import check_heads_divide


@pytest.mark.parametrize("tp, message", [
    (3, r"stage 'llm': its 2 key/value heads neither split evenly over nor replicate evenly "
        r"on tensor_parallel_size 3"),
    (8, r"stage 'llm': its 4 attention heads do not divide by tensor_parallel_size = 8"),
])
def test_heads_that_do_not_divide_are_refused(tiny_qwen3: Path, tp: int, message: str) -> None:
    stage = StageConfig(name="llm", kind="ar", final="text", tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=message):
        check_heads_divide(stage, str(tiny_qwen3))
    # before anything starts: Omni refuses it without a stage process
    with pytest.raises(ValueError, match=message):
        Omni(str(tiny_qwen3), device="cpu", tensor_parallel_size=tp)


def test_heads_that_divide_or_replicate_pass(tiny_qwen3: Path) -> None:
    for tp in (2, 4):      # 4 query heads, 2 key/value heads: split at 2, replicated at 4
        check_heads_divide(StageConfig(name="llm", kind="ar", final="text",
                                       tensor_parallel_size=tp), str(tiny_qwen3))
