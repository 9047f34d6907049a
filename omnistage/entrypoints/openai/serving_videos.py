"""/v1/videos: video generation as jobs (OpenAI's video API), for models whose family
declares video (`registry.VideoSpec`); any other model answers 400 `model_not_video`.

    POST /v1/videos            check, store (video_store.py), queue -> the job (queued)
    GET  /v1/videos[/{id}]     the jobs, newest first (limit, after, order) / one job
    GET  /v1/videos/{id}/content   the MP4; ?format=webm|webp|gif, ?variant=thumbnail (WebP)
    POST /v1/videos/{id}/cancel    stop a queued or running job: status cancelled
    DELETE /v1/videos/{id}     cancel it if active, then drop it and its files
    POST /v1/videos/sync       the same request run at once; the answer is the file

A request becomes one engine request: the prompt, and the diffusion stages' DiffusionParams
with num_frames, fps, height and width always set (the VideoSpec's defaults filled in, every
value checked against it and the server's limits here, before anything is queued), the
diffusion extras when given, a seed (drawn here when none is given, so that a job run again
after a restart makes the same video) and for image-to-video the `input_reference` image as
DiffusionParams.image. The final output carries tensors["video"], uint8 (1, F, H, W, 3),
written as MP4 (utils/video.py) at the request's fps.

`max_running` workers take the oldest queued job each; the engine reports progress per
denoising step, kept as the job's `progress` (percent). A job ends completed, or failed with
the engine's error: any failure, never in_progress (the worker's last resort). At startup,
jobs left in progress are queued again.
"""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from PIL import Image
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from omnistage.entrypoints.openai.client import EngineClient, failed, unless_disconnected
from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model, invalid
from omnistage.entrypoints.openai.media import MediaLoader, decode_b64, decode_image
from omnistage.entrypoints.openai.params import ignore, parse_size, stage_params
from omnistage.entrypoints.openai.protocol import (VideoDeleted, VideoError, VideoFileFormat,
                                                   VideoList, VideoObject, VideoRequest)
from omnistage.entrypoints.openai.video_store import ACTIVE, VideoJob, VideoStore, now
from omnistage.registry import VideoSpec
from omnistage.utils.video import MEDIA_TYPES, decode_video, encode_video

logger = logging.getLogger(__name__)
_EXTRAS = ("negative_prompt", "num_inference_steps", "guidance_scale")
MAX_SEED = 2**31


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_jobs: int = 64                 # queued + in progress; more: 429
    max_frames: int = 241              # below the model's own maximum, if lower
    max_size: int = 1920               # longest side, pixels
    max_disk_bytes: int = 20 << 30     # the jobs' files; more: 429 until some are deleted
    max_running: int = 1               # jobs the engine runs at once


class VideoServing:
    def __init__(self, client: EngineClient, media: MediaLoader, spec: VideoSpec | None,
                 store: VideoStore | None, limits: VideoLimits, model_name: str) -> None:
        if spec is not None and "video" not in client.outputs:
            raise ValueError("the model's family declares video, but no stage of its graph "
                             "says `final: video`")
        self.client, self.media, self.spec, self.store = client, media, spec, store
        self.limits = limits
        self.model_name = model_name
        self.wake = asyncio.Event()
        self.workers: list[asyncio.Task] = []
        self.running: dict[str, asyncio.Task] = {}     # job id -> its generation

    def require_video(self) -> tuple[VideoSpec, VideoStore]:
        if self.spec is None or self.store is None:
            raise bad_request("this model does not make video: /v1/videos is served by models "
                              "whose family declares video (e.g. Wan)", "model",
                              "model_not_video")
        return self.spec, self.store

    # -- the workers -------------------------------------------------------------------------
    def start(self) -> None:
        """Queue again what the last run left in progress; start the workers."""
        if self.store is None:
            return
        queued = self.store.requeue()
        if queued:
            logger.info("videos: %d job(s) queued from before the restart", queued)
        self.workers = [asyncio.create_task(self._work())
                        for _ in range(self.limits.max_running)]

    async def stop(self) -> None:
        """Shutdown: generations stop where they are (their jobs stay in_progress, to run
        again at the next start)."""
        for task in self.workers:
            task.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)

    async def _work(self) -> None:
        assert self.store is not None
        while True:
            job = self.store.claim_next()
            if job is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            task = asyncio.create_task(self._run(job))
            self.running[job.id] = task
            try:    # a cancelled job (DELETE, cancel) ends its task only, not this worker
                await asyncio.gather(task, return_exceptions=True)
            finally:
                self.running.pop(job.id, None)

    async def _run(self, job: VideoJob) -> None:
        store = self.store
        assert store is not None
        seen = [0]

        def progress(share: float) -> None:
            if int(share * 100) > seen[0]:
                seen[0] = int(share * 100)
                store.update(job.id, progress=min(seen[0], 99))

        try:
            frames = await self._generate(job.prompt, job.request, store.input_image(job.id),
                                          progress)
            data = await run_in_threadpool(encode_video, frames, job.request["fps"], "mp4")
            store.write(job.id, "video.mp4", data)
            store.update(job.id, status="completed", progress=100, completed_at=now())
        except APIError as exc:
            self._fail(job, exc.code or "engine_error", exc.message)
        except Exception as exc:   # the last resort: a job never stays in_progress
            logger.exception("video job %s failed", job.id)
            self._fail(job, "internal_error", f"{type(exc).__name__}: {exc}")

    def _fail(self, job: VideoJob, code: str, message: str) -> None:
        assert self.store is not None
        logger.warning("video job %s failed: %s", job.id, message)
        self.store.update(job.id, status="failed", completed_at=now(),
                          error={"code": code, "message": message})

    async def _generate(self, prompt: str, fields: dict[str, Any], image: bytes | None,
                        progress: Callable[[float], None]) -> np.ndarray:
        """One engine request -> its frames, uint8 (F, H, W, 3); APIError if it failed."""
        params = stage_params(self.client.graph, self.client.entry, fields, None, image)
        prepared = self.client.prepare(prompt, params, "prompt")
        handle = self.client.submit(prompt, prepared, {"video"}, "video")
        try:
            async for out in handle.outputs():
                if out.progress is not None:
                    progress(out.progress)
        finally:
            handle.close()
        if failed(out):
            raise self.client.failure(out, "prompt")
        video = out.tensors.get("video")
        if video is None:
            raise APIError(500, "the model finished without a video", code="engine_error")
        return video[0].numpy()                                       # (F, H, W, 3)

    # -- requests ----------------------------------------------------------------------------
    async def read(self, request: Request) -> tuple[VideoRequest, bytes | None]:
        """The body (JSON, or the SDK's multipart form) and the first-frame image file."""
        image: bytes | None = None
        if request.headers.get("content-type", "").startswith(("multipart/", "application/x-")):
            fields: dict[str, Any] = {}
            async with request.form() as form:
                for key, value in form.multi_items():
                    if isinstance(value, UploadFile):
                        if key != "input_reference":
                            raise bad_request(f"{key}: unexpected file (the image goes in "
                                              "input_reference)", key)
                        image = await value.read()
                    else:
                        fields[key] = value
            body: Any = fields
        else:
            body = await request.body()
        try:
            req = (VideoRequest.model_validate(body) if isinstance(body, dict)
                   else VideoRequest.model_validate_json(body or b"{}"))
        except ValidationError as exc:
            raise invalid(exc.errors()) from None
        check_model(req.model, self.model_name)
        if req.input_reference is not None:
            image = await run_in_threadpool(self._reference, req.input_reference)
        if image is not None:
            await run_in_threadpool(decode_image, image, "input_reference")
        return req, image

    def _reference(self, ref: str | dict[str, str]) -> bytes:
        url = ref.get("image_url") if isinstance(ref, dict) else ref
        if not url:
            raise bad_request("input_reference: expected an image (a data: URL, base64, or "
                              "{\"image_url\": URL})", "input_reference")
        if ":" in url[:12]:
            return self.media.fetch(url, "input_reference")
        return decode_b64(url, "input_reference")

    def plan(self, req: VideoRequest, image: bytes | None) -> tuple[dict[str, Any], str, str]:
        """(the engine fields, "WxH", seconds) of a request, every value checked (400)."""
        spec, _ = self.require_video()
        fps = req.fps or spec.fps
        num_frames = self._num_frames(spec, req, fps)
        height, width = parse_size(req.size)
        if height is None or width is None:
            width, height = spec.default_size
        for side in (width, height):
            if side % spec.size_multiple:
                raise bad_request(f"size={width}x{height}: width and height must be multiples "
                                  f"of {spec.size_multiple} for this model", "size")
        if max(width, height) > self.limits.max_size:
            raise bad_request(f"size={width}x{height}: the longest side is at most "
                              f"{self.limits.max_size} pixels here", "size", "size_too_large")
        if image is not None and not spec.image_to_video:
            raise bad_request("input_reference: this model makes video from text only",
                              "input_reference", "image_to_video_not_supported")
        if image is None and not spec.text_to_video:
            raise bad_request("input_reference: this model needs a first-frame image",
                              "input_reference")
        if req.user is not None:
            ignore("user", "no abuse monitoring here")
        fields: dict[str, Any] = {"num_frames": num_frames, "fps": fps, "height": height,
                                  "width": width,
                                  "seed": secrets.randbelow(MAX_SEED) if req.seed is None
                                  else req.seed}
        fields.update({k: getattr(req, k) for k in _EXTRAS if getattr(req, k) is not None})
        return fields, f"{width}x{height}", f"{num_frames / fps:g}"

    def _num_frames(self, spec: VideoSpec, req: VideoRequest, fps: float) -> int:
        if req.seconds is not None and req.num_frames is not None:
            raise bad_request("seconds, num_frames: give one of them", "num_frames")
        param = "num_frames" if req.num_frames is not None else "seconds"
        if req.num_frames is not None:
            num_frames = req.num_frames
            if not spec.valid_num_frames(num_frames):
                raise bad_request(f"num_frames={num_frames}: this model makes "
                                  f"{spec.frame_rule}", "num_frames")
        elif req.seconds is not None:
            try:
                seconds = float(req.seconds)
            except ValueError:
                raise bad_request(f"seconds={req.seconds!r}: expected a number", "seconds") \
                    from None
            if not 0 < seconds < 3600:
                raise bad_request(f"seconds={req.seconds!r}: must be > 0", "seconds")
            num_frames = spec.num_frames_for(seconds, fps)
        else:
            num_frames = spec.default_num_frames
        most = min(spec.max_num_frames, self.limits.max_frames)
        if num_frames > most:
            raise bad_request(f"{param}: {num_frames} frames asked, at most {most} "
                              f"({most / fps:g} s at {fps:g} fps)", param, "too_many_frames")
        return num_frames

    # -- routes ------------------------------------------------------------------------------
    async def create(self, request: Request) -> VideoObject:
        _, store = self.require_video()
        req, image = await self.read(request)
        fields, size, seconds = self.plan(req, image)
        if store.num_active() >= self.limits.max_jobs:
            raise APIError(429, f"{self.limits.max_jobs} video jobs are queued or running, the "
                                "limit here; retry later", code="too_many_video_jobs")
        used = await run_in_threadpool(store.disk_bytes)
        if used >= self.limits.max_disk_bytes:
            raise APIError(429, f"the stored videos take {used} bytes, the limit is "
                                f"{self.limits.max_disk_bytes}: delete some (DELETE "
                                "/v1/videos/{id})", code="video_storage_full")
        job = VideoJob(f"video_{uuid.uuid4().hex}", now(), None, "queued", 0, self.model_name,
                       req.prompt, size, seconds, fields, None)
        store.add(job, image)
        self.wake.set()
        return as_object(job)

    async def sync(self, request: Request, fmt: VideoFileFormat) -> Response:
        self.require_video()
        req, image = await self.read(request)
        fields, _, _ = self.plan(req, image)
        ticket = self.client.admit()
        try:
            frames = await unless_disconnected(
                request, lambda: self._generate(req.prompt, fields, image, lambda _: None))
        finally:
            ticket.release()
        data = await run_in_threadpool(encode_video, frames, fields["fps"], fmt)
        return Response(data, media_type=MEDIA_TYPES[fmt])

    def job(self, job_id: str) -> VideoJob:
        _, store = self.require_video()
        job = store.get(job_id)
        if job is None:
            raise APIError(404, f"no video {job_id!r}", param="video_id", code="video_not_found")
        return job

    def list(self, limit: int, after: str | None, order: Literal["asc", "desc"]) -> VideoList:
        _, store = self.require_video()
        if not 1 <= limit <= 100:
            raise bad_request(f"limit={limit}: must be in [1, 100]", "limit")
        page = store.list(limit, after, order)
        if page is None:
            raise bad_request(f"after={after!r}: no such video", "after")
        jobs, more = page
        return VideoList(data=[as_object(j) for j in jobs], has_more=more,
                         first_id=jobs[0].id if jobs else None,
                         last_id=jobs[-1].id if jobs else None)

    async def cancel(self, job_id: str) -> VideoObject:
        job = self.job(job_id)
        if job.status not in ACTIVE:
            raise bad_request(f"video {job_id!r} is {job.status}: only a queued or running "
                              "job can be cancelled", "video_id", "video_not_active")
        await self._stop(job_id)
        assert self.store is not None
        self.store.update(job_id, status="cancelled", completed_at=now())
        return as_object(self.job(job_id))

    async def delete(self, job_id: str) -> VideoDeleted:
        self.job(job_id)
        await self._stop(job_id)
        assert self.store is not None
        await run_in_threadpool(self.store.delete, job_id)
        return VideoDeleted(id=job_id)

    async def _stop(self, job_id: str) -> None:
        """Cancel the job's generation if it runs (its engine request is aborted)."""
        task = self.running.get(job_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def content(self, job_id: str, variant: str, fmt: VideoFileFormat) -> Response:
        job = self.job(job_id)
        if job.status != "completed":
            raise bad_request(f"video {job_id!r} is {job.status}: its content exists once it "
                              "is completed", "video_id", "video_not_ready")
        if variant not in ("video", "thumbnail"):
            raise bad_request(f"variant={variant!r}: video or thumbnail", "variant")
        name = "thumbnail.webp" if variant == "thumbnail" else f"video.{fmt}"
        path = self.store.folder(job_id) / name if self.store else None
        if path is None or not path.is_file():
            path = await run_in_threadpool(self._derive, job, name)
        media = "image/webp" if variant == "thumbnail" else MEDIA_TYPES[fmt]
        return FileResponse(path, media_type=media, filename=f"{job_id}.{path.suffix[1:]}")

    def _derive(self, job: VideoJob, name: str) -> Path:
        """Another format of a completed video (or its first frame), made from the MP4 once
        and kept beside it."""
        assert self.store is not None
        frames, _ = decode_video((self.store.folder(job.id) / "video.mp4").read_bytes())
        if name == "thumbnail.webp":
            buf = io.BytesIO()
            Image.fromarray(frames[0]).save(buf, "WEBP", quality=90)
            data = buf.getvalue()
        else:
            data = encode_video(frames, job.request["fps"], _format(name))
        return self.store.write(job.id, name, data)


def _format(name: str) -> VideoFileFormat:
    fmt = name.rpartition(".")[2]
    assert fmt in MEDIA_TYPES, f"no video format in {name!r}"
    return fmt  # type: ignore[return-value]


def as_object(job: VideoJob) -> VideoObject:
    return VideoObject(id=job.id, status=job.status, progress=job.progress,
                       created_at=job.created_at, completed_at=job.completed_at,
                       error=VideoError(**job.error) if job.error else None, model=job.model,
                       prompt=job.prompt, size=job.size, seconds=job.seconds)
