"""Errors with their types kept from the stage that raised them to the API that answers.

    a stage refuses input       raise InputError(message, param="speaker")
    an engine's step fails      StageError.internal(message) (stage "" until the worker's)
    the worker                  StageError(stage, "invalid_input", message, param)
    the orchestrator            adds its own: "stage_dead", "aborted"
    a stage whose input stalls  "timeout" (no chunk from upstream for input_timeout_s)
    OmniOutput.error            the server maps kind and param to HTTP, reading no message text

`StageError` is the one encoding of a failure on every record that can carry one (a stage's
StageResult and StageOutput, StartupFailed, the orchestrator's RequestEvent, OmniOutput):
`error: StageError | None`. `str(error)` is the human-readable line ("stage 'talker': ...").
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

    def __str__(self) -> str:
        """The line a person reads: the message, after its stage unless it names it."""
        if not self.stage or self.message.startswith(f"stage {self.stage!r}"):
            return self.message
        return f"stage {self.stage!r}: {self.message}"

    @classmethod
    def internal(cls, message: str) -> StageError:
        """An engine's failure of one request; the worker sets the stage (`at`)."""
        return cls("", "internal", message)

    def at(self, stage: str) -> StageError:
        """This error, of `stage` (an engine's error reaching its worker)."""
        return self if self.stage else msgspec.structs.replace(self, stage=stage)

    @property
    def is_invalid_input(self) -> bool:
        """The request's fault (a stage refused its input), not the engine's."""
        return self.kind == "invalid_input"

    @classmethod
    def from_exception(cls, stage: str, exc: BaseException) -> StageError:
        """A ValueError is the request's fault (invalid_input), anything else ours."""
        kind: ErrorKind = "invalid_input" if isinstance(exc, ValueError) else "internal"
        param = exc.param if isinstance(exc, InputError) else None
        return cls(stage, kind, str(exc) or type(exc).__name__, param)
