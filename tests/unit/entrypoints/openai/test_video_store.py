"""The video jobs' store on its own: the queue in creation order, a job claimed once, jobs
in progress queued again by a new store over the same folder (a restart), pages in both
orders, files written whole and removed with their job."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.entrypoints.openai import video_store
from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.entrypoints.openai.video_store import StoreBusy, VideoJob, VideoStore
from omnistage.testing.toy_video import SPEC
from omnistage.stages.info import StageInfo

HEALTH_DEADLINE_S = 2.0     # a stalled loop: the old store held it for the whole busy wait


def job(i: int, model: str = "m") -> VideoJob:
    return VideoJob(f"video_{i}", 1000 + i, None, "queued", 0, model, f"p{i}", "64x48", "1",
                    {"num_frames": 9, "fps": 8.0, "seed": i}, None)


def test_queue_claims_in_order_and_a_restart_requeues(tmp_path: Path) -> None:
    async def go() -> None:
        store = VideoStore(tmp_path, "scope-a")
        for i in range(3):
            await store.add(job(i), b"png" if i == 1 else None)
        other = VideoStore(tmp_path, "scope-b")          # another server on the folder
        await other.add(VideoJob("video_other", 999, None, "queued", 0, "another model", "q",
                                 "64x48", "1", {}, None), None)
        assert (await store.claim_next()).id == "video_0"
        assert (await store.claim_next()).id == "video_1"
        await store.update("video_0", status="failed", error={"code": "x", "message": "boom"})
        assert (await store.get("video_0")).error == {"code": "x", "message": "boom"}
        assert await store.num_active() == 2 and await other.num_active() == 1
        store.close()
        again = VideoStore(tmp_path, "scope-a")          # video_1 was in progress: queued again
        assert await again.requeue("m") == 2
        assert (await again.get("video_1")).status == "queued"
        assert (await again.get("video_1")).request == {"num_frames": 9, "fps": 8.0, "seed": 1}
        assert again.input_image("video_1") == b"png" and again.input_image("video_2") is None
        assert [(await again.claim_next()).id for _ in range(2)] == ["video_1", "video_2"]
        assert await again.claim_next() is None
        assert await again.get("video_other") is None
        assert (await other.get("video_other")).status == "queued"
        for s in (again, other):
            s.close()

    asyncio.run(go())


def test_pages_and_files(tmp_path: Path) -> None:
    async def go() -> None:
        store = VideoStore(tmp_path, "scope-a")
        for i in range(5):
            await store.add(job(i), None)
        await VideoStore(tmp_path, "scope-b").add(job(9), None)     # not listed here
        jobs, more = await store.list(2, None, "desc")
        assert [j.id for j in jobs] == ["video_4", "video_3"] and more
        jobs, more = await store.list(2, "video_1", "desc")
        assert [j.id for j in jobs] == ["video_0"] and not more
        jobs, more = await store.list(10, "video_2", "asc")
        assert [j.id for j in jobs] == ["video_3", "video_4"] and not more
        assert await store.list(2, "video_nope", "asc") is None
        assert await store.list(2, "video_9", "asc") is None
        path = store.write("video_3", "video.mp4", b"x" * 100)
        assert path.read_bytes() == b"x" * 100 and store.disk_bytes() == 100
        assert not list(path.parent.glob(".*.part"))
        await store.delete("video_3")
        assert await store.get("video_3") is None and store.disk_bytes() == 0

    asyncio.run(go())


def test_jobs_from_before_scopes_go_to_the_first_server_of_their_model(tmp_path: Path) -> None:
    """A folder written by the store before scopes (no scope column): its jobs become the
    first server's of their model to start, not any other's."""
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute(_OLD_SCHEMA)
    db.execute("INSERT INTO jobs (id, created_at, status, model, prompt, size, seconds, "
               "request) VALUES ('video_old', 1, 'in_progress', 'm', 'p', '64x48', '1', '{}')")
    db.commit()
    db.close()

    async def go() -> None:
        other, mine = VideoStore(tmp_path, "scope-b"), VideoStore(tmp_path, "scope-a")
        assert await other.requeue("another model") == 0
        assert await mine.requeue("m") == 1
        assert (await mine.get("video_old")).status == "queued"
        assert await other.get("video_old") is None

    asyncio.run(go())


def test_a_busy_store_waits_at_most_its_timeout(tmp_path: Path) -> None:
    """Calls queued behind a call that waits for the lock share its deadline: each is
    refused within its own busy timeout of being made, however many wait."""
    async def go() -> None:
        store = VideoStore(tmp_path, "scope-a", busy_timeout_s=0.3)
        await store.add(job(0), None)
        other = sqlite3.connect(tmp_path / "jobs.sqlite3", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            results = await asyncio.wait_for(asyncio.gather(
                *(store.update("video_0", progress=i) for i in range(20)),
                return_exceptions=True), 20 * 0.3 / 2)        # not one timeout after another
            assert all(isinstance(r, StoreBusy) for r in results), results
            assert (await store.get("video_0")).progress == 0   # reads go on (WAL)
        finally:
            other.rollback()
            other.close()
        await store.update("video_0", progress=7)
        assert (await store.get("video_0")).progress == 7

    asyncio.run(go())


_OLD_SCHEMA = """
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
    created_at INTEGER NOT NULL, completed_at INTEGER, status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0, model TEXT NOT NULL, prompt TEXT NOT NULL,
    size TEXT NOT NULL, seconds TEXT NOT NULL, request TEXT NOT NULL, error TEXT
)"""


# ---- the store under the app: off the event loop, scoped to its server -------------------------

class VideoEngine:
    """What the server uses of AsyncOmni for /v1/videos: one diffusion stage whose final is
    video (the toy's VideoSpec). No lifespan runs here, so no job is ever taken from the
    queue: the tests see only what the routes do with the store."""

    def __init__(self) -> None:
        self.graph = GraphConfig(stages=(StageConfig(name="dit", kind="diffusion",
                                                     final="video"),))
        self.tokenizer, self.processor = None, None
        self.entry, self.text_entry, self.is_healthy = ["dit"], False, True
        self.audio_sample_rate, self.speech, self.video = None, None, SPEC
        self.orchestrator = SimpleNamespace(stage_info={"dit": StageInfo()}, dead_reason=None,
                                            degraded_reason=None,
                                            stage_stats=lambda timeout: {},
                                            replica_status=lambda: {})


def video_app(videos_dir: Path, port: int, model: str = "toy", scope: str | None = None
              ) -> FastAPI:
    return build_app(VideoEngine(), ServerConfig(served_model_name=model, port=port,
                                                 videos_dir=str(videos_dir),
                                                 videos_scope=scope))


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_servers_sharing_a_folder_see_only_their_own_jobs(tmp_path: Path) -> None:
    """Two servers (ports 8123 and 8124) on one --videos-dir: each lists and serves only the
    jobs it made; the first one started again (same model, host and port) still has its."""
    async def go() -> None:
        first, second = video_app(tmp_path, 8123), video_app(tmp_path, 8124)
        async with client(first) as a, client(second) as b:
            mine = (await a.post("/v1/videos", json={"prompt": "a red kite"})).json()["id"]
            theirs = (await b.post("/v1/videos", json={"prompt": "a boat"})).json()["id"]
            for c, own, other in ((a, mine, theirs), (b, theirs, mine)):
                assert (await c.get(f"/v1/videos/{own}")).status_code == 200
                r = await c.get(f"/v1/videos/{other}")
                assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"
                for path in (f"/v1/videos/{other}/content", f"/v1/videos/{other}/cancel",
                             f"/v1/videos/{other}"):
                    method = "POST" if path.endswith("cancel") else (
                        "DELETE" if path.endswith(other) else "GET")
                    assert (await c.request(method, path)).status_code == 404, path
                listed = [v["id"] for v in (await c.get("/v1/videos")).json()["data"]]
                assert listed == [own]
                r = await c.get("/v1/videos", params={"after": other})
                assert r.status_code == 400 and r.json()["error"]["param"] == "after"
        async with client(video_app(tmp_path, 8123)) as again:     # the first, restarted
            listed = [v["id"] for v in (await again.get("/v1/videos")).json()["data"]]
            assert listed == [mine]

    asyncio.run(go())


def test_servers_of_one_scope_share_their_jobs(tmp_path: Path) -> None:
    """--videos-scope: replicas at different addresses that share a folder on purpose."""
    async def go() -> None:
        async with client(video_app(tmp_path, 8126, scope="kites")) as a, \
                client(video_app(tmp_path, 8127, scope="kites")) as b, \
                client(video_app(tmp_path, 8128)) as c:
            made = (await a.post("/v1/videos", json={"prompt": "a red kite"})).json()["id"]
            assert (await b.get(f"/v1/videos/{made}")).status_code == 200
            assert (await c.get(f"/v1/videos/{made}")).status_code == 404

    asyncio.run(go())


def test_a_locked_database_is_a_503_and_health_answers_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds the jobs database's write lock: POST /v1/videos waits at most
    the store's busy timeout, then answers 503 with Retry-After; /health answers all along
    (the old store ran SQLite on the event loop: a 500 after 5 s, /health stalled)."""
    monkeypatch.setattr(video_store, "BUSY_TIMEOUT_S", 0.5, raising=False)
    app = video_app(tmp_path, 8125)

    async def go() -> None:
        async with client(app) as c:
            assert (await c.post("/v1/videos", json={"prompt": "first"})).status_code == 200
            other = sqlite3.connect(tmp_path / "jobs.sqlite3", isolation_level=None)
            other.execute("BEGIN IMMEDIATE")            # holds the write lock
            try:
                post = asyncio.ensure_future(c.post("/v1/videos", json={"prompt": "later"},
                                                    timeout=30))
                pings = 0
                while not post.done():
                    r = await asyncio.wait_for(c.get("/health"), HEALTH_DEADLINE_S)
                    assert r.status_code == 200
                    pings += 1
                    await asyncio.sleep(0.02)
                r = await asyncio.wait_for(post, 30)
            finally:
                other.rollback()
                other.close()
            assert pings >= 3, pings                   # /health answered while it waited
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "video_store_busy"
            assert int(r.headers["Retry-After"]) >= 1
            # the lock gone, the store works again
            assert (await c.post("/v1/videos", json={"prompt": "again"})).status_code == 200
            assert len((await c.get("/v1/videos")).json()["data"]) == 2

    asyncio.run(go())


@pytest.mark.parametrize("field, value", [
    ("size", "\uff16\uff14x\uff14\uff18"),         # fullwidth ６４x４８
    ("size", "\u0666\u0664x\u0664\u0668"),         # Arabic-Indic ٦٤x٤٨
    ("seconds", "\uff12"),                         # fullwidth ２
    ("seconds", "\u0662"),                         # Arabic-Indic ٢
    ("seconds", "0_1"), ("seconds", "0x1"), ("seconds", "1e0"), ("seconds", "nan"),
])
def test_numbers_in_other_digits_are_400(tmp_path: Path, field: str, value: str) -> None:
    """As JSON and as the SDK's form: only ASCII digits make a size or a length."""
    async def go() -> None:
        async with client(video_app(tmp_path, 8129)) as c:
            for kw in ({"json": {"prompt": "a cat", field: value}},
                       {"data": {"prompt": "a cat", field: value}}):
                r = await c.post("/v1/videos", **kw)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == field, r.text
            assert (await c.get("/v1/videos")).json()["data"] == []

    asyncio.run(go())


def test_a_negative_prompt_is_held_to_the_prompts_length(tmp_path: Path) -> None:
    """prompt takes at most 32000 characters; negative_prompt (tokenized by the same text
    encoder) took any length."""
    async def go() -> None:
        async with client(video_app(tmp_path, 8130)) as c:
            r = await c.post("/v1/videos", json={"prompt": "a cat",
                                                  "negative_prompt": "blur " * 7000})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "negative_prompt"
            r = await c.post("/v1/videos", json={"prompt": "a cat",
                                                  "negative_prompt": "blur " * 6000})
            assert r.status_code == 200, r.text

    asyncio.run(go())
