"""The video jobs' store on its own: the queue in creation order, a job claimed once, jobs
in progress queued again by a new store over the same folder (a restart), pages in both
orders, files written whole and removed with their job."""

from __future__ import annotations

from pathlib import Path

from omnistage.entrypoints.openai.video_store import VideoJob, VideoStore


def job(i: int) -> VideoJob:
    return VideoJob(f"video_{i}", 1000 + i, None, "queued", 0, "m", f"p{i}", "64x48", "1",
                    {"num_frames": 9, "fps": 8.0, "seed": i}, None)


def test_queue_claims_in_order_and_a_restart_requeues(tmp_path: Path) -> None:
    store = VideoStore(tmp_path)
    for i in range(3):
        store.add(job(i), b"png" if i == 1 else None)
    store.add(VideoJob("video_other", 999, None, "queued", 0, "another model", "q", "64x48",
                       "1", {}, None), None)
    assert store.claim_next("m").id == "video_0"
    assert store.claim_next("m").id == "video_1"
    store.update("video_0", status="failed", error={"code": "x", "message": "boom"})
    assert store.get("video_0").error == {"code": "x", "message": "boom"}
    assert store.num_active() == 3
    store.close()
    again = VideoStore(tmp_path)                       # video_1 was in progress: queued again
    assert again.requeue("m") == 2 and again.get("video_1").status == "queued"
    assert again.get("video_1").request == {"num_frames": 9, "fps": 8.0, "seed": 1}
    assert again.input_image("video_1") == b"png" and again.input_image("video_2") is None
    assert [again.claim_next("m").id for _ in range(2)] == ["video_1", "video_2"]
    assert again.claim_next("m") is None and again.get("video_other").status == "queued"


def test_pages_and_files(tmp_path: Path) -> None:
    store = VideoStore(tmp_path)
    for i in range(5):
        store.add(job(i), None)
    jobs, more = store.list(2, None, "desc")
    assert [j.id for j in jobs] == ["video_4", "video_3"] and more
    jobs, more = store.list(2, "video_1", "desc")
    assert [j.id for j in jobs] == ["video_0"] and not more
    jobs, more = store.list(10, "video_2", "asc")
    assert [j.id for j in jobs] == ["video_3", "video_4"] and not more
    assert store.list(2, "video_nope", "asc") is None
    path = store.write("video_3", "video.mp4", b"x" * 100)
    assert path.read_bytes() == b"x" * 100 and store.disk_bytes() == 100
    assert not list(path.parent.glob(".*.part"))
    store.delete("video_3")
    store.remove_files("video_3")
    assert store.get("video_3") is None and store.disk_bytes() == 0
