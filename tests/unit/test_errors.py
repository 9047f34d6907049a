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
    out = m.StageOutput("talker", "r1", finished=True, finish_reason="error", error=err)
    back = m.decode_from_stage(m.encode(out))
    assert back.error == err and back.error.param == "speaker" and back.error.is_invalid_input
    plain = m.decode_from_stage(m.encode(m.StageOutput("talker", "r2")))
    assert plain.error is None


def test_the_line_a_person_reads() -> None:
    """str(error): the message after its stage, unless the message names it already; an
    engine's error gets its stage from the worker."""
    assert str(StageError("dit", "invalid_input", "height: 30")) == "stage 'dit': height: 30"
    dead = StageError("second", "stage_dead", "stage 'second' replica 1 died (signal 9)")
    assert str(dead) == dead.message
    engine = StageError.internal("RuntimeError: boom")
    assert str(engine) == "RuntimeError: boom" and engine.at("talker").stage == "talker"
    assert StageError("a", "internal", "x").at("b").stage == "a"


def test_startup_failed_carries_a_stage_error() -> None:
    failed = m.StartupFailed("talker", StageError("talker", "internal", "OSError: no weights"))
    assert m.decode_from_stage(m.encode(failed)).error.message == "OSError: no weights"
