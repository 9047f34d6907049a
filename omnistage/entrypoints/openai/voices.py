"""Uploaded voices: reference clips (with their transcripts) kept on disk under one folder, so
that they survive a restart, and named in speech requests like a preset voice.

    <voices dir>/<name>.wav     the clip as decoded and checked: mono, float32, its own rate
    <voices dir>/<name>.json    {"transcript", "created_at", "consent", "duration_s"}

A name matches NAME (letters, digits, `_`, `-`): it can never name a path outside the folder.
The json is written last (both through a temporary file and a rename), so a voice is listed
only once it is whole. A preset's name (any case) can be neither uploaded nor deleted.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request

from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.protocol import VoiceCard
from omnistage.utils.audio import AudioTooLong, decode_audio, probe_audio

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_UPLOAD_BYTES = 10 << 20
MIN_CLIP_S, MAX_CLIP_S = 0.5, 60.0


def default_voices_dir() -> Path:
    """Under the user's cache folder ($XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "omnistage" / "voices"


@dataclass(frozen=True, slots=True)
class Voice:
    """A voice to clone: the clip, mono float32, its rate and its transcript."""
    samples: np.ndarray
    sample_rate: int
    transcript: str | None


def check_clip(data: bytes, param: str) -> tuple[np.ndarray, int]:
    """Reference audio as a client sent it -> mono float32 and rate; 400 naming `param` when
    it does not decode, is silent, or is shorter than MIN_CLIP_S / longer than MAX_CLIP_S."""
    try:
        header = probe_audio(data).seconds
        if header is not None and header > MAX_CLIP_S:     # refused before decoding
            raise AudioTooLong(f"the header says {header:.2f} s")
        wave, rate = decode_audio(data, max_seconds=MAX_CLIP_S, mono=True)
    except AudioTooLong:
        raise bad_request(f"{param}: the clip is longer than {MAX_CLIP_S} s; a reference voice "
                          f"needs {MIN_CLIP_S} to {MAX_CLIP_S} s", param, "invalid_audio") from None
    except ValueError as exc:
        raise bad_request(f"{param}: not a readable audio file ({exc})", param,
                          "invalid_audio") from None
    mono = np.nan_to_num(wave[0])
    seconds = len(mono) / rate
    if not MIN_CLIP_S <= seconds <= MAX_CLIP_S:
        raise bad_request(f"{param}: the clip is {seconds:.2f} s long; a reference voice needs "
                          f"{MIN_CLIP_S} to {MAX_CLIP_S} s", param, "invalid_audio")
    if not np.abs(mono).max() > 1e-4:
        raise bad_request(f"{param}: the clip is silent", param, "invalid_audio")
    return mono, rate


class VoiceStore:
    def __init__(self, folder: Path, presets: tuple[str, ...]) -> None:
        self.folder = folder
        self.presets = presets
        self._preset_keys = {p.lower() for p in presets}

    def check_name(self, name: str, param: str = "name") -> str:
        if not NAME.fullmatch(name):
            raise bad_request(f"{param}: {name[:80]!r} is not a voice name (1 to 64 letters, "
                              "digits, '_' or '-')", param, "invalid_voice_name")
        return name

    def is_preset(self, name: str) -> bool:
        return name.lower() in self._preset_keys

    def cards(self) -> list[VoiceCard]:
        """The presets, then the uploads by name."""
        cards = [VoiceCard(name=p, type="preset") for p in self.presets]
        if self.folder.is_dir():
            for meta in sorted(self.folder.glob("*.json")):
                if NAME.fullmatch(meta.stem) and meta.with_suffix(".wav").is_file():
                    info = json.loads(meta.read_text())
                    cards.append(VoiceCard(name=meta.stem, type="uploaded",
                                           transcript=info.get("transcript"),
                                           created_at=info.get("created_at"),
                                           duration_s=info.get("duration_s")))
        return cards

    def get(self, name: str) -> Voice | None:
        """An uploaded voice, or None (no such upload; names that are not names included)."""
        if not NAME.fullmatch(name):
            return None
        meta = self.folder / f"{name}.json"
        if not meta.is_file():
            return None
        import soundfile

        samples, rate = soundfile.read(self.folder / f"{name}.wav", dtype="float32")
        return Voice(samples, int(rate), json.loads(meta.read_text()).get("transcript"))

    def add(self, name: str, data: bytes, transcript: str | None) -> VoiceCard:
        """Check and keep an upload (consent is the route's to check)."""
        self.check_name(name)
        if self.is_preset(name):
            raise bad_request(f"name: {name!r} is a preset voice of this model; choose another "
                              "name", "name", "voice_is_preset")
        if (self.folder / f"{name}.json").is_file():
            raise APIError(409, f"name: a voice {name!r} exists already; delete it first",
                           param="name", code="voice_exists")
        if len(data) > MAX_UPLOAD_BYTES:
            raise APIError(413, f"audio: the file is {len(data)} bytes, the limit is "
                                f"{MAX_UPLOAD_BYTES}", param="audio", code="audio_too_large")
        samples, rate = check_clip(data, "audio")
        import soundfile

        self.folder.mkdir(parents=True, exist_ok=True)
        info = {"transcript": transcript, "created_at": int(time.time()), "consent": True,
                "duration_s": round(len(samples) / rate, 3)}
        self._write(f"{name}.wav", lambda f: soundfile.write(f, samples, rate, format="WAV",
                                                             subtype="FLOAT"))
        self._write(f"{name}.json", lambda f: f.write(json.dumps(info).encode()))
        return VoiceCard(name=name, type="uploaded", **{k: info[k] for k in (
            "transcript", "created_at", "duration_s")})

    def delete(self, name: str) -> None:
        self.check_name(name)
        if self.is_preset(name):
            raise bad_request(f"{name!r} is a preset voice of this model; it cannot be deleted",
                              "name", "voice_is_preset")
        meta = self.folder / f"{name}.json"
        if not meta.is_file():
            raise APIError(404, f"no uploaded voice {name!r}", param="name",
                           code="voice_not_found")
        meta.unlink()                   # unlisted first, then its clip
        (self.folder / f"{name}.wav").unlink(missing_ok=True)

    def _write(self, filename: str, write: Callable[[BinaryIO], object]) -> None:
        """Into a temporary file beside the target, then renamed over it."""
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, self.folder / filename)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# ---- POST /v1/audio/voices -------------------------------------------------------------------

_FORM_FIELDS = ("name", "transcript", "consent")
_YES = ("true", "1", "yes")


def voice_form_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["name", "audio", "consent"], "properties": {
        "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
        "audio": {"type": "string", "format": "binary",
                  "description": f"the reference clip (any format PyAV reads), at most "
                                 f"{MAX_UPLOAD_BYTES} bytes, {MIN_CLIP_S} to {MAX_CLIP_S} s"},
        "transcript": {"type": "string", "description": "what the clip says (better clones)"},
        "consent": {"type": "boolean", "description": "the speaker agreed to be cloned: must "
                                                      "be true"}}}


async def upload(store: VoiceStore, request: Request) -> VoiceCard:
    """The multipart form: name, audio (a file), transcript, consent (must be true)."""
    async with request.form(max_files=1, max_fields=8) as form:
        fields: dict[str, str] = {}
        audio: UploadFile | None = None
        for key, value in form.multi_items():
            if isinstance(value, UploadFile) != (key == "audio") or (
                    key != "audio" and key not in _FORM_FIELDS):
                raise bad_request(f"{key}: not a field of this form (name, audio as a file, "
                                  "transcript, consent)", key)
            if isinstance(value, UploadFile):
                audio = value
            else:
                fields[key] = value
        name = store.check_name(fields.get("name", ""))
        if fields.get("consent", "").strip().lower() not in _YES:
            raise bad_request("consent: cloning a voice needs the speaker's consent; send "
                              "consent=true", "consent", "consent_required")
        if audio is None:
            raise bad_request("audio: the reference clip is missing (a file field)", "audio")
        data = await audio.read(MAX_UPLOAD_BYTES + 1)
    return await run_in_threadpool(store.add, name, data, fields.get("transcript") or None)
