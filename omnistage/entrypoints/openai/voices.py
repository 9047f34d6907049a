"""Uploaded voices: reference clips (with their transcripts) kept on disk under one folder, so
that they survive a restart, and named in speech requests like a preset voice.

    <voices dir>/<name>.wav     the clip as decoded and checked: mono, float32, its own rate
    <voices dir>/<name>.json    {"transcript", "created_at", "consent", "duration_s"}

A name matches NAME (letters, digits, `_`, `-`): it can never name a path outside the folder.
Names are unique in any case (`Ann` and `ann` are one voice, found by either). The json is
written last (both through a temporary file and a rename) and deleted first, so a voice is
listed only while it is whole; a voice deleted while it is read or listed is no voice (a
listing skips it, a speech request gets voice_not_found), never an error. A preset's name (any
case) can be neither uploaded nor deleted.

Uploads are capped: MAX_TRANSCRIPT_CHARS, MAX_VOICES voices, MAX_VOICES_BYTES on disk, rates
within utils/audio.py's MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE (check_clip: the speech route's
ref_audio too); each refusal a 4xx naming its limit.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse

from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.protocol_speech import VoiceCard
from omnistage.utils.audio import (MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, AudioTooLong,
                                   decode_audio, probe_audio)

logger = logging.getLogger(__name__)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_UPLOAD_BYTES = 10 << 20
MIN_CLIP_S, MAX_CLIP_S = 0.5, 60.0
MAX_TRANSCRIPT_CHARS = 4096           # as a speech request's ref_text
MAX_VOICES = 256
MAX_VOICES_BYTES = 1 << 30            # the folder's clips and their json (a 60 s clip at
                                      # 48 kHz is 11.5 MB as float32)


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

    def clip_extra(self) -> dict[str, Any]:
        """As a cloning model's SamplingParams.extra: "ref_audio" {samples (float32 bytes),
        sample_rate} and "ref_text"."""
        return {"ref_audio": {"samples": self.samples.astype("<f4").tobytes(),
                              "sample_rate": self.sample_rate},
                "ref_text": self.transcript}


def check_clip(data: bytes, param: str) -> tuple[np.ndarray, int]:
    """Reference audio as a client sent it -> mono float32 and rate; 400 naming `param` when
    it does not decode, is silent, is shorter than MIN_CLIP_S / longer than MAX_CLIP_S, or
    its rate is outside MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE."""
    try:
        info = probe_audio(data)
        if info.seconds is not None and info.seconds > MAX_CLIP_S:   # refused before decoding
            raise AudioTooLong(f"the header says {info.seconds:.2f} s")
        if not MIN_SAMPLE_RATE <= info.sample_rate <= MAX_SAMPLE_RATE:
            raise bad_request(f"{param}: the clip's sample rate is {info.sample_rate} Hz; a "
                              f"reference voice needs {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz",
                              param, "invalid_audio")
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
    """The folder of uploads. Adding and deleting hold a lock (the caps and the name's
    uniqueness are checked against what is there); reading and listing take none, and a file
    gone between two reads means the voice is gone."""

    def __init__(self, folder: Path, presets: tuple[str, ...], max_voices: int = MAX_VOICES,
                 max_bytes: int = MAX_VOICES_BYTES) -> None:
        self.folder = folder
        self.presets = presets
        self.max_voices, self.max_bytes = max_voices, max_bytes
        self._preset_keys = {p.lower() for p in presets}
        self._lock = threading.Lock()

    def check_name(self, name: str, param: str = "name") -> str:
        if not NAME.fullmatch(name):
            raise bad_request(f"{param}: {name[:80]!r} is not a voice name (1 to 64 letters, "
                              "digits, '_' or '-')", param, "invalid_voice_name")
        return name

    def is_preset(self, name: str) -> bool:
        return name.lower() in self._preset_keys

    def cards(self) -> list[VoiceCard]:
        """The presets, then the uploads by name (one deleted meanwhile is left out)."""
        cards = [VoiceCard(name=p, type="preset") for p in self.presets]
        for name in self._names():
            info = self._info(name)
            if info is not None and (self.folder / f"{name}.wav").is_file():
                cards.append(VoiceCard(name=name, type="uploaded",
                                       transcript=info.get("transcript"),
                                       created_at=info.get("created_at"),
                                       duration_s=info.get("duration_s")))
        return cards

    def get(self, name: str) -> Voice | None:
        """An uploaded voice in any case of its name, or None (no such upload, names that are
        not names, one deleted while it was read)."""
        stored = self._stored_name(name) if NAME.fullmatch(name) else None
        info = None if stored is None else self._info(stored)
        if info is None:
            return None
        import soundfile

        try:
            samples, rate = soundfile.read(self.folder / f"{stored}.wav", dtype="float32")
        except (OSError, soundfile.LibsndfileError):      # deleted since its json was read
            return None
        return Voice(samples, int(rate), info.get("transcript"))

    def clone_extra(self, name: str) -> dict[str, Any] | None:
        """An uploaded voice as a cloning model's SamplingParams.extra (registry.SpeechSpec:
        "ref_audio" {samples, sample_rate}, "ref_text"), or None (a preset, no such upload)."""
        stored = None if self.is_preset(name) else self.get(name)
        return None if stored is None else stored.clip_extra()

    def add(self, name: str, data: bytes, transcript: str | None) -> VoiceCard:
        """Check and keep an upload (consent is the route's to check)."""
        self.check_name(name)
        if self.is_preset(name):
            raise bad_request(f"name: {name!r} is a preset voice of this model; choose another "
                              "name", "name", "voice_is_preset")
        if transcript is not None and len(transcript) > MAX_TRANSCRIPT_CHARS:
            raise bad_request(f"transcript: {len(transcript)} characters, the limit is "
                              f"{MAX_TRANSCRIPT_CHARS}", "transcript", "transcript_too_long")
        if len(data) > MAX_UPLOAD_BYTES:
            raise APIError(413, f"audio: the file is {len(data)} bytes, the limit is "
                                f"{MAX_UPLOAD_BYTES}", param="audio", code="audio_too_large")
        samples, rate = check_clip(data, "audio")
        import soundfile

        clip = io.BytesIO()
        soundfile.write(clip, samples, rate, format="WAV", subtype="FLOAT")
        info = {"transcript": transcript, "created_at": int(time.time()), "consent": True,
                "duration_s": round(len(samples) / rate, 3)}
        meta = json.dumps(info).encode()
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._check_room(name, len(clip.getvalue()) + len(meta))
            self._write(f"{name}.wav", lambda f: f.write(clip.getvalue()))
            self._write(f"{name}.json", lambda f: f.write(meta))
        return VoiceCard(name=name, type="uploaded", **{k: info[k] for k in (
            "transcript", "created_at", "duration_s")})

    def delete(self, name: str) -> None:
        self.check_name(name)
        if self.is_preset(name):
            raise bad_request(f"{name!r} is a preset voice of this model; it cannot be deleted",
                              "name", "voice_is_preset")
        with self._lock:
            stored = self._stored_name(name)
            try:
                if stored is None:
                    raise FileNotFoundError(name)
                (self.folder / f"{stored}.json").unlink()      # unlisted first, then its clip
            except FileNotFoundError:
                raise APIError(404, f"no uploaded voice {name!r}", param="name",
                               code="voice_not_found") from None
            (self.folder / f"{stored}.wav").unlink(missing_ok=True)

    def _check_room(self, name: str, num_bytes: int) -> None:
        """409 if the name is taken in any case; 400 past MAX_VOICES or MAX_VOICES_BYTES."""
        stored = self._stored_name(name)
        if stored is not None:
            raise APIError(409, f"name: a voice {stored!r} exists already (names are unique "
                                "in any case); delete it first", param="name",
                           code="voice_exists")
        names = self._names()
        if len(names) >= self.max_voices:
            raise bad_request(f"name: this server keeps at most {self.max_voices} uploaded "
                              "voices; delete one first", "name", "too_many_voices")
        used = 0
        for entry in os.scandir(self.folder):
            try:
                used += entry.stat().st_size if entry.is_file() else 0
            except FileNotFoundError:
                pass
        if used + num_bytes > self.max_bytes:
            raise bad_request(f"audio: the voices would take {used + num_bytes} bytes on disk, "
                              f"the limit is {self.max_bytes}; delete some first", "audio",
                              "voice_storage_full")

    def _names(self) -> list[str]:
        """The uploads' names, sorted (their json present when the folder was read)."""
        try:
            entries = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        return sorted(e[:-5] for e in entries if e.endswith(".json") and NAME.fullmatch(e[:-5]))

    def _stored_name(self, name: str) -> str | None:
        """The upload's name as stored, whatever the case of `name`."""
        if (self.folder / f"{name}.json").is_file():
            return name
        key = name.lower()
        return next((n for n in self._names() if n.lower() == key), None)

    def _info(self, name: str) -> dict[str, Any] | None:
        """The voice's json, or None once it is deleted."""
        try:
            info = json.loads((self.folder / f"{name}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return info if isinstance(info, dict) else None

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
# vLLM-Omni's form: the file as `audio_sample`, the transcript as `ref_text`, `consent` the id
# of a consent recording (any non-empty id), `speaker_description` (accepted, not kept)
_FILES = ("audio", "audio_sample")
_VLLM_NAMES = {"ref_text": "transcript", "speaker_description": "speaker_description"}


def voice_form_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["name", "audio", "consent"], "properties": {
        "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
        "audio": {"type": "string", "format": "binary",
                  "description": f"the reference clip (any format PyAV reads), at most "
                                 f"{MAX_UPLOAD_BYTES} bytes, {MIN_CLIP_S} to {MAX_CLIP_S} s, "
                                 f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz"},
        "transcript": {"type": "string", "maxLength": MAX_TRANSCRIPT_CHARS,
                       "description": "what the clip says (better clones)"},
        "consent": {"type": "boolean", "description": "the speaker agreed to be cloned: must "
                                                      "be true"}}}


async def upload(store: VoiceStore, request: Request) -> VoiceCard | JSONResponse:
    """The multipart form: name, audio (a file), transcript, consent (must be true), answered
    with our voice card; or vLLM-Omni's (the file as `audio_sample`): name, audio_sample,
    ref_text, consent (a consent recording's id), speaker_description (logged as ignored),
    answered as vLLM-Omni answers it: {"success": true, "voice": {name, consent, created_at,
    mime_type, file_size, ref_text and speaker_description (when given)}}."""
    async with request.form(max_files=1, max_fields=8) as form:
        fields: dict[str, str] = {}
        audio: UploadFile | None = None
        vllm = False                      # the file came as vLLM-Omni's audio_sample
        for key, value in form.multi_items():
            is_file = isinstance(value, UploadFile)
            field = _VLLM_NAMES.get(key, key)
            if is_file != (key in _FILES) or (not is_file and key not in _FORM_FIELDS
                                               and key not in _VLLM_NAMES):
                raise bad_request(f"{key}: not a field of this form (name, audio as a file, "
                                  "transcript, consent)", key)
            if is_file:
                audio, vllm = value, key == "audio_sample"
            elif field in fields:
                raise bad_request(f"{key}: given twice (transcript and ref_text are one "
                                  "field)", key)
            else:
                fields[field] = value
        name = store.check_name(fields.get("name", ""))
        consent = fields.get("consent", "").strip()
        if not (consent.lower() in _YES or (vllm and consent)):
            raise bad_request("consent: cloning a voice needs the speaker's consent; send "
                              "consent=true", "consent", "consent_required")
        if audio is None:
            raise bad_request("audio: the reference clip is missing (a file field)", "audio")
        if "speaker_description" in fields:
            logger.info("speaker_description: accepted and not kept (voice %r)", name)
        data = await audio.read(MAX_UPLOAD_BYTES + 1)
        mime = audio.content_type or "application/octet-stream"
    card = await run_in_threadpool(store.add, name, data, fields.get("transcript") or None)
    if not vllm:
        return card
    # vLLM-Omni's client reads {"success": true, "voice": {name, consent, created_at, ...}}
    voice = {"name": card.name, "consent": consent, "created_at": card.created_at,
             "mime_type": mime, "file_size": len(data)}
    if card.transcript:
        voice["ref_text"] = card.transcript
    if fields.get("speaker_description"):
        voice["speaker_description"] = fields["speaker_description"]    # echoed, not kept
    return JSONResponse({"success": True, "voice": voice})
