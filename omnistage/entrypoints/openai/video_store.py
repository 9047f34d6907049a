"""The /v1/videos jobs on disk: one SQLite table (stdlib sqlite3) and a folder per job, so
that they outlive the server.

    <videos dir>/jobs.sqlite3        a row per job: scope, status, progress, request, error
    <videos dir>/files/<id>/input    the first-frame image of an image-to-video job
    <videos dir>/files/<id>/video.mp4          the result, written when the job completes
    <videos dir>/files/<id>/video.{webm,...}   other formats, made from it when first asked

    queued ──claim──> in_progress ──> completed | failed
       ^                   │
       └── requeue() at startup: a job in progress when the server stopped runs again

Every row belongs to one server, its `scope` (`server_scope`: the model it serves, where it
listens, and for the default folder the machine): a server sees, lists, runs and counts only
its own jobs, so servers sharing a folder never serve each other's, and the same server
started again finds its jobs.

The database is touched on one thread of the store's own, never on the event loop: another
process holding the database's write lock makes a call wait at most BUSY_TIMEOUT_S in all
(queued behind other calls included), then raise StoreBusy (the routes answer 503).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import shutil
import socket
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

T = TypeVar("T")
VideoStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
ACTIVE = ("queued", "in_progress")
BUSY_TIMEOUT_S = 2.0      # what a call may wait for another process's lock on the database

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
    error TEXT,                              -- JSON: {"code", "message"}
    scope TEXT                               -- the server that owns the job (server_scope)
)"""
_COLUMNS = ("id", "created_at", "completed_at", "status", "progress", "model", "prompt",
            "size", "seconds", "request", "error")
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM jobs"


def default_videos_dir() -> Path:
    """Under the user's cache folder ($XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "omnistage" / "videos"


def server_scope(model_name: str, model: str | None, host: str, port: int,
                 machine: bool) -> str:
    """Whose jobs a server sees: a hash of the name it serves, the model it loaded (a local
    folder by its resolved path), the address it listens on and, with `machine` (the default
    folder, which a home shared between machines may hold), the machine's name. The same
    server started again has the same scope; two servers running at once never do (one
    address, one server), unless machines share a chosen folder and an address."""
    where = model
    if model is not None and Path(model).expanduser().exists():
        where = str(Path(model).expanduser().resolve())
    parts = [model_name, where or "", host, str(port), socket.gethostname() if machine else ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class StoreBusy(Exception):
    """The database stayed locked by another process past the store's wait."""


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
    """One server's jobs (`scope`) in a folder that others may share. The row methods are
    coroutines run on the store's thread (which owns the connection); the file methods are
    plain (blocking: callers run them in a thread)."""

    def __init__(self, root: Path, scope: str, busy_timeout_s: float | None = None) -> None:
        self.root, self.scope = root, scope
        self.busy_timeout_s = BUSY_TIMEOUT_S if busy_timeout_s is None else busy_timeout_s
        self.files = root / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="video-store")
        self._db: sqlite3.Connection | None = None      # opened on the thread, on first use

    def close(self) -> None:
        def close_db() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._thread.submit(close_db).result()
        self._thread.shutdown()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(db, *args)` on the store's thread, within busy_timeout_s of now."""
        deadline = time.monotonic() + self.busy_timeout_s
        call = functools.partial(self._on_thread, deadline, fn, *args)
        return await asyncio.wrap_future(self._thread.submit(call))

    def _on_thread(self, deadline: float, fn: Callable[..., T], *args: Any) -> T:
        left = deadline - time.monotonic()
        busy = StoreBusy("the video jobs' database is locked by another process")
        if left <= 0:                 # the wait was spent behind other calls
            raise busy
        try:
            db = self._connect(left)
            db.execute(f"PRAGMA busy_timeout = {max(1, int(left * 1000))}")
            return fn(db, *args)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise busy from None
            raise

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.root / "jobs.sqlite3", timeout=timeout_s,
                                 check_same_thread=False,
                                 isolation_level=None)     # autocommit: a row a call
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(_SCHEMA)
                columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
                if "scope" not in columns:       # a folder from before scopes
                    db.execute("ALTER TABLE jobs ADD COLUMN scope TEXT")
                db.execute("CREATE INDEX IF NOT EXISTS jobs_scope ON jobs (scope, seq)")
            except sqlite3.Error:
                db.close()
                raise
            self._db = db
        return self._db

    # -- rows --------------------------------------------------------------------------------
    async def add(self, job: VideoJob, image: bytes | None) -> None:
        """A new job (queued), its first-frame image written first."""
        await self._call(self._add, job, image)

    def _add(self, db: sqlite3.Connection, job: VideoJob, image: bytes | None) -> None:
        if image is not None:
            self.folder(job.id).mkdir(parents=True, exist_ok=True)
            (self.folder(job.id) / "input").write_bytes(image)
        row = _as_row(job)
        db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}, scope) VALUES "
                   f"({', '.join('?' * (len(_COLUMNS) + 1))})",
                   [*(row[c] for c in _COLUMNS), self.scope])

    async def get(self, job_id: str) -> VideoJob | None:
        return await self._call(self._get, job_id)

    def _get(self, db: sqlite3.Connection, job_id: str) -> VideoJob | None:
        row = db.execute(f"{_SELECT} WHERE id = ? AND scope = ?",
                         (job_id, self.scope)).fetchone()
        return None if row is None else _job(row)

    async def list(self, limit: int, after: str | None, order: Literal["asc", "desc"]
                   ) -> tuple[list[VideoJob], bool] | None:
        """A page of jobs in creation order (`desc`: newest first) after the job `after`,
        and whether more follow; None if `after` names no job (of this server)."""
        return await self._call(self._list, limit, after, order)

    def _list(self, db: sqlite3.Connection, limit: int, after: str | None,
              order: Literal["asc", "desc"]) -> tuple[list[VideoJob], bool] | None:
        where, args = "WHERE scope = ?", [self.scope]
        if after is not None:
            seq = db.execute("SELECT seq FROM jobs WHERE id = ? AND scope = ?",
                             (after, self.scope)).fetchone()
            if seq is None:
                return None
            where += f" AND seq {'>' if order == 'asc' else '<'} ?"
            args.append(seq[0])
        rows = db.execute(f"{_SELECT} {where} ORDER BY seq {order.upper()} LIMIT ?",
                          [*args, limit + 1]).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    async def update(self, job_id: str, **fields: Any) -> None:
        """Set columns of a job (status, progress, completed_at, error)."""
        await self._call(self._update, job_id, fields)

    def _update(self, db: sqlite3.Connection, job_id: str, fields: dict[str, Any]) -> None:
        assert set(fields) <= {"status", "progress", "completed_at", "error"}, fields
        if fields.get("error") is not None:
            fields = {**fields, "error": json.dumps(fields["error"])}
        sets = ", ".join(f"{k} = ?" for k in fields)
        db.execute(f"UPDATE jobs SET {sets} WHERE id = ? AND scope = ?",
                   [*fields.values(), job_id, self.scope])

    async def claim_next(self) -> VideoJob | None:
        """The oldest queued job, now in_progress; None if none waits."""
        return await self._call(self._claim_next)

    def _claim_next(self, db: sqlite3.Connection) -> VideoJob | None:
        row = db.execute("UPDATE jobs SET status = 'in_progress', progress = 0 WHERE seq = "
                         "(SELECT MIN(seq) FROM jobs WHERE status = 'queued' AND scope = ?)"
                         f" RETURNING {', '.join(_COLUMNS)}", (self.scope,)).fetchone()
        return None if row is None else _job(row)

    async def requeue(self, model: str) -> int:
        """At startup: the jobs left in_progress (the server stopped under them) wait again;
        jobs of a folder from before scopes, made for `model`, become this server's.
        -> how many of its jobs are queued now."""
        return await self._call(self._requeue, model)

    def _requeue(self, db: sqlite3.Connection, model: str) -> int:
        db.execute("UPDATE jobs SET scope = ? WHERE scope IS NULL AND model = ?",
                   (self.scope, model))
        db.execute("UPDATE jobs SET status = 'queued', progress = 0 "
                   "WHERE status = 'in_progress' AND scope = ?", (self.scope,))
        return db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued' AND scope = ?",
                          (self.scope,)).fetchone()[0]

    async def num_active(self) -> int:
        """This server's jobs queued or in progress."""
        return await self._call(self._num_active)

    def _num_active(self, db: sqlite3.Connection) -> int:
        return db.execute("SELECT COUNT(*) FROM jobs WHERE status IN (?, ?) AND scope = ?",
                          (*ACTIVE, self.scope)).fetchone()[0]

    async def delete(self, job_id: str) -> None:
        """The job's row and its files."""
        await self._call(self._delete, job_id)

    def _delete(self, db: sqlite3.Connection, job_id: str) -> None:
        db.execute("DELETE FROM jobs WHERE id = ? AND scope = ?", (job_id, self.scope))
        self.remove_files(job_id)

    # -- files -------------------------------------------------------------------------------
    def remove_files(self, job_id: str) -> None:
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

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
        """What the jobs' files take (every server's: the folder's disk is shared)."""
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
