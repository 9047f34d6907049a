"""The /v1/videos jobs on disk: one SQLite table (stdlib sqlite3) and a folder per job, so
that they outlive the server.

    <videos dir>/jobs.sqlite3        a row per job: status, progress, request, error
    <videos dir>/files/<id>/input    the first-frame image of an image-to-video job
    <videos dir>/files/<id>/video.mp4          the result, written when the job completes
    <videos dir>/files/<id>/video.{webm,...}   other formats, made from it when first asked

    queued ──claim──> in_progress ──> completed | failed
       ^                   │
       └── requeue() at startup: a job in progress when the server stopped runs again

Every database call runs on the server's event loop (a row update is a fraction of a
millisecond); only file work (`write`, `remove_files`, `disk_bytes`) may run in a thread.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

VideoStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
ACTIVE = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order: listing and the queue
    id TEXT UNIQUE NOT NULL,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    request TEXT NOT NULL,                   -- JSON: the engine fields (see VideoServing)
    error TEXT                               -- JSON: {"code", "message"}
)"""
_COLUMNS = ("id", "created_at", "completed_at", "status", "progress", "model", "prompt",
            "size", "seconds", "request", "error")


def default_videos_dir() -> Path:
    """Under the user's cache folder ($XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "omnistage" / "videos"


@dataclass(slots=True)
class VideoJob:
    id: str
    created_at: int
    completed_at: int | None
    status: VideoStatus
    progress: int                     # percent
    model: str
    prompt: str
    size: str                         # "WxH"
    seconds: str
    request: dict[str, Any]           # the fields the engine gets (DiffusionParams' names)
    error: dict[str, str] | None


class VideoStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(root / "jobs.sqlite3", check_same_thread=False,
                                  isolation_level=None)        # autocommit: a row a call
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- rows --------------------------------------------------------------------------------
    def add(self, job: VideoJob, image: bytes | None) -> None:
        """A new job (queued), its first-frame image written first."""
        if image is not None:
            self.folder(job.id).mkdir(parents=True, exist_ok=True)
            (self.folder(job.id) / "input").write_bytes(image)
        row = {**_as_row(job)}
        self.db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES "
                        f"({', '.join('?' * len(_COLUMNS))})", [row[c] for c in _COLUMNS])

    def get(self, job_id: str) -> VideoJob | None:
        row = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?",
                              (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list(self, limit: int, after: str | None, order: Literal["asc", "desc"]
             ) -> tuple[list[VideoJob], bool] | None:
        """A page of jobs in creation order (`desc`: newest first) after the job `after`,
        and whether more follow; None if `after` names no job."""
        where, args = "", []
        if after is not None:
            seq = self.db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
            if seq is None:
                return None
            where, args = f"WHERE seq {'>' if order == 'asc' else '<'} ?", [seq[0]]
        rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs {where} ORDER BY seq "
                               f"{order.upper()} LIMIT ?", [*args, limit + 1]).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def update(self, job_id: str, **fields: Any) -> None:
        """Set columns of a job (status, progress, completed_at, error)."""
        if "error" in fields and fields["error"] is not None:
            fields["error"] = json.dumps(fields["error"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*fields.values(), job_id])

    def claim_next(self, model: str) -> VideoJob | None:
        """The oldest queued job for `model`, now in_progress; None if none waits. (A folder
        shared by servers of different models keeps each one's jobs for it.)"""
        row = self.db.execute("UPDATE jobs SET status = 'in_progress', progress = 0 WHERE seq = "
                              "(SELECT MIN(seq) FROM jobs WHERE status = 'queued' AND model = ?)"
                              f" RETURNING {', '.join(_COLUMNS)}", (model,)).fetchone()
        return None if row is None else _job(row)

    def requeue(self, model: str) -> int:
        """At startup: `model`'s jobs left in_progress (the server stopped under them) wait
        again. -> how many of its jobs are queued now."""
        self.db.execute("UPDATE jobs SET status = 'queued', progress = 0 "
                        "WHERE status = 'in_progress' AND model = ?", (model,))
        return self.db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued' AND "
                               "model = ?", (model,)).fetchone()[0]

    def num_active(self) -> int:
        """Jobs queued or in progress."""
        return self.db.execute("SELECT COUNT(*) FROM jobs WHERE status IN (?, ?)",
                               ACTIVE).fetchone()[0]

    def delete(self, job_id: str) -> None:
        """The job's row (`remove_files` takes its files: a thread may, the row is the
        connection's, which stays on the event loop)."""
        self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def remove_files(self, job_id: str) -> None:
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

    # -- files -------------------------------------------------------------------------------
    def folder(self, job_id: str) -> Path:
        return self.files / job_id

    def input_image(self, job_id: str) -> bytes | None:
        path = self.folder(job_id) / "input"
        return path.read_bytes() if path.is_file() else None

    def write(self, job_id: str, name: str, data: bytes) -> Path:
        """A file of the job, written whole or not at all (a crash leaves no half file)."""
        folder = self.folder(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".{name}.part"
        part.write_bytes(data)
        part.replace(folder / name)
        return folder / name

    def disk_bytes(self) -> int:
        """What the jobs' files take."""
        return sum(p.stat().st_size for p in self.files.rglob("*") if p.is_file())


def _as_row(job: VideoJob) -> dict[str, Any]:
    row = {c: getattr(job, c) for c in _COLUMNS}
    row["request"] = json.dumps(job.request)
    row["error"] = None if job.error is None else json.dumps(job.error)
    return row


def _job(row: tuple) -> VideoJob:
    values = dict(zip(_COLUMNS, row))
    values["request"] = json.loads(values["request"])
    values["error"] = None if values["error"] is None else json.loads(values["error"])
    return VideoJob(**values)


def now() -> int:
    return int(time.time())
