"""vLLM-Omni's speech fields on our voice choice: `task_type` (Qwen3-TTS's three modes) and
`x_vector_only_mode`, read against what the model offers (registry.SpeechSpec) before the
voice is looked up (serving_speech.SpeechServing.extra).

    task_type     what it asks                          what we do with it
    CustomVoice   a preset voice (+ style instructions) voice as given (none: the first preset)
    VoiceDesign   a voice described in `instructions`   instructions required; voice ignored
    Base          a clone: ref_audio (+ ref_text), or   ref_audio wins over voice (ignored);
                  an uploaded voice                     without it voice must name an upload
    (none)        Base when ref_audio is given, else as the other fields say (ours)

    x_vector_only_mode  true: clone from the speaker embedding alone (ref_text dropped);
                        false: clone in context, so a transcript is needed (ref_text or the
                        upload's); only for a clone

A field the mode cannot use (ref_audio for CustomVoice, ...) or a mode the model does not serve
is a 400 naming the field. An ignored field is logged once per reason.
"""

from __future__ import annotations

import logging
from typing import Any

from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.protocol_speech import MAX_NEW_TOKENS, SpeechVoice
from omnistage.registry import SpeechSpec

logger = logging.getLogger(__name__)
_logged: set[str] = set()


def ignored(param: str, why: str) -> None:
    """An accepted field that changes nothing for this request: logged once per reason."""
    if f"{param}: {why}" not in _logged:
        _logged.add(f"{param}: {why}")
        logger.info("%s: ignored (%s)", param, why)


def served_tasks(spec: SpeechSpec) -> tuple[str, ...]:
    return tuple(t for t, ok in (("CustomVoice", bool(spec.voices)),
                                 ("VoiceDesign", spec.voice_design),
                                 ("Base", spec.cloning)) if ok)


def resolve_task(v: SpeechVoice, spec: SpeechSpec, where: str = "") -> SpeechVoice:
    """The request with vLLM-Omni's fields applied: a voice the mode ignores taken out (so
    that what is left is one choice of who speaks); 400 for a contradiction."""
    task = v.task_type or ("Base" if v.ref_audio is not None else None)
    if task is not None and task not in served_tasks(spec):
        raise bad_request(f"{where}task_type: this model does not serve {task!r} (it serves "
                          f"{', '.join(served_tasks(spec))})", f"{where}task_type",
                          "unsupported_task_type")
    if task != "Base":
        for name in ("ref_audio", "ref_text"):
            if task is not None and getattr(v, name) is not None:
                raise bad_request(f"{where}{name}: only for cloning (task_type Base), not "
                                  f"{task}", f"{where}{name}")
    if task == "VoiceDesign":
        if not v.instructions:
            raise bad_request(f"{where}instructions: task_type VoiceDesign speaks a voice "
                              "described in instructions; describe one", f"{where}instructions",
                              "instructions_required")
        if v.voice is not None:
            ignored(f"{where}voice", "task_type VoiceDesign: the instructions describe the voice")
            v = v.model_copy(update={"voice": None})
    elif task == "Base":
        if v.ref_audio is not None and v.voice is not None:
            ignored(f"{where}voice", "ref_audio is given: the voice is cloned from it")
            v = v.model_copy(update={"voice": None})
        elif v.ref_audio is None:
            if v.voice is None:
                raise bad_request(f"{where}ref_audio: task_type Base clones a voice: send "
                                  "ref_audio (with ref_text), or name an uploaded voice",
                                  f"{where}ref_audio", "voice_required")
            if v.voice.lower() in {p.lower() for p in spec.voices}:
                raise bad_request(f"{where}voice: {v.voice!r} is a preset voice; task_type "
                                  "Base clones from ref_audio or an uploaded voice",
                                  f"{where}voice")
    if v.x_vector_only_mode and v.ref_text is not None:
        v = v.model_copy(update={"ref_text": None})     # the embedding alone: no transcript
    return v


def check_max_new_tokens(value: object, param: str = "max_new_tokens") -> int | None:
    """`max_new_tokens` where no request model checks it (the speech WebSocket's session):
    None, or an integer 1..MAX_NEW_TOKENS, as SpeechRequest's field."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not \
            1 <= value <= MAX_NEW_TOKENS:
        raise bad_request(f"{param}: must be an integer from 1 to {MAX_NEW_TOKENS} (the talker's "
                          f"codec frames), not {value!r}"[:200], param)
    return value


def check_clone_mode(v: SpeechVoice, extra: dict[str, Any], where: str = "") -> dict[str, Any]:
    """`x_vector_only_mode` against the voice as resolved (`extra`, SamplingParams.extra):
    true drops an upload's transcript, false needs one; either only for a clone."""
    mode = v.x_vector_only_mode
    if mode is None:
        return extra
    param = f"{where}x_vector_only_mode"
    if "ref_audio" not in extra:
        if mode:
            raise bad_request(f"{param}: only for a clone (ref_audio, or an uploaded voice)",
                              param)
        return extra
    if mode:
        return {k: val for k, val in extra.items() if k != "ref_text"}
    if not extra.get("ref_text"):
        raise bad_request(f"{where}ref_text: x_vector_only_mode false clones in context, from "
                          "the clip and its transcript: send ref_text (or set "
                          "x_vector_only_mode true)", f"{where}ref_text", "ref_text_required")
    return extra
