"""What a realtime session may hold (the server's flags), and which models can hold one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omnistage.entrypoints.openai.client import EngineClient


@dataclass(frozen=True, slots=True)
class RealtimeLimits:
    max_buffer_bytes: int = 15 << 20     # input audio held (as PCM16 at 16 kHz); more: error
    max_turn_s: float = 60.0             # a longer user turn is cut (VAD) or refused (commit)
    idle_timeout_s: float = 600.0        # no client event this long: the session ends
    max_items: int = 1000                # conversation items a session may hold
    server_vad: bool = True              # a new session's turn detection (off: vLLM-Omni's)
    resume_grace_s: float = 30.0         # a dropped socket's session waits this long (resume.py)
    resume_journal_bytes: int = 4 << 20  # server events kept for a resume to replay

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "server_vad" or (f.name == "resume_grace_s" and value == 0):
                continue                 # a grace of 0: no session outlives its socket
            if value <= 0:
                raise ValueError(f"realtime {f.name}={value}: must be > 0")


def realtime_support(client: EngineClient) -> str | None:
    """Why this model cannot hold a realtime session (None: it can). A model that speaks
    but does not hear (the voice agent graph: a text LLM into a TTS) takes text items."""
    if "audio" not in client.outputs:
        return "this model does not produce audio; /v1/realtime needs a model that speaks " \
               "(Qwen3-Omni, MiMo-Audio, or the voice agent graph)"
    return None


def hears(client: EngineClient) -> bool:
    """Whether the model takes audio input: its input processor declares audio parts among
    its `input_modalities` (Qwen3-Omni's, Qwen2.5-Omni's; MiMo-Audio's with its audio
    tokenizer), as the playground's capabilities read them; a processor that declares none
    takes text."""
    processor = client.processor
    return processor is not None and "audio" in getattr(processor, "input_modalities", ())
