"""Errors with their types kept from the stage that raised them to the API that answers.

    a stage refuses input       raise InputError(message, param="speaker")
    the worker                  StageError(stage, "invalid_input", message, param)
    the orchestrator            adds its own: "stage_dead", "aborted"
    a stage whose input stalls  "timeout" (no chunk from upstream for input_timeout_s)
    OmniOutput.error_info       the server maps kind and param to HTTP, reading no message text

`OmniOutput.error` stays the human-readable line ("stage 'talker': ValueError: ...").
"""

from __future__ import annotations

from typing import Literal

import msgspec

ErrorKind = Literal["invalid_input", "internal", "stage_dead", "aborted", "timeout"]


class InputError(ValueError):
    """A request's input refused; `param` names the field it concerns (as the engine calls
    it: "speaker", "prompt"), when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StageError(msgspec.Struct, frozen=True):
    """Why a request failed: the stage, the kind, the message alone, the field it names."""

    stage: str
    kind: ErrorKind
    message: str
    param: str | None = None

    @classmethod
    def from_exception(cls, stage: str, exc: BaseException) -> StageError:
        """A ValueError is the request's fault (invalid_input), anything else ours."""
        kind: ErrorKind = "invalid_input" if isinstance(exc, ValueError) else "internal"
        param = exc.param if isinstance(exc, InputError) else None
        return cls(stage, kind, str(exc) or type(exc).__name__, param)
