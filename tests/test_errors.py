"""Typed errors: what a stage raises becomes a StageError with its kind, its message alone and
the field it names, and survives the wire (msgpack) inside a stage's output."""

from __future__ import annotations

import pytest

from omnistage.errors import InputError, StageError
from omnistage.stages import messages as m


@pytest.mark.parametrize("exc, kind, param", [
    (InputError("speaker 'x' is unknown", param="speaker"), "invalid_input", "speaker"),
    (ValueError("prompt: empty"), "invalid_input", None),
    (RuntimeError("CUDA error"), "internal", None),
])
def test_from_exception(exc: BaseException, kind: str, param: str | None) -> None:
    err = StageError.from_exception("talker", exc)
    assert (err.stage, err.kind, err.message, err.param) == ("talker", kind, str(exc), param)


def test_input_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown") as info:
        raise InputError("speaker 'x' is unknown", param="speaker")
    assert info.value.param == "speaker"


def test_stage_error_travels_in_a_stage_output() -> None:
    err = StageError("talker", "invalid_input", "speaker 'x' is unknown", "speaker")
    out = m.StageOutput("talker", "r1", finished=True, finish_reason="error",
                        error="ValueError: speaker 'x' is unknown", invalid_input=True,
                        error_info=err)
    back = m.decode_from_stage(m.encode(out))
    assert back.error_info == err and back.error_info.param == "speaker"
    plain = m.decode_from_stage(m.encode(m.StageOutput("talker", "r2")))
    assert plain.error_info is None
