"""/v1/videos: video generation as jobs (OpenAI's video API), for models whose family
declares video (`registry.VideoSpec`); any other model answers 400 `model_not_video`.

    POST /v1/videos            check, store (video_store.py), queue -> the job (queued)
    GET  /v1/videos[/{id}]     the jobs, newest first (limit, after, order) / one job
    GET  /v1/videos/{id}/content   the MP4; ?format=webm|webp|gif, ?variant=thumbnail (WebP),
                               ?variant=audio (the sound track alone, WAV)
    POST /v1/videos/{id}/cancel    stop a queued or running job: status cancelled
    DELETE /v1/videos/{id}     cancel it if active, then drop it and its files
    POST /v1/videos/sync       the same request run at once; the answer is the file

A request becomes one engine request: the prompt, and the diffusion stages' DiffusionParams
with num_frames, fps, height and width always set (the VideoSpec's defaults filled in, every
value checked against it and the server's limits before anything is queued:
video_params.py), the diffusion extras when given, a seed (drawn when none is given, so
that a job run again after a restart makes the same video) and for image-to-video the
`input_reference` image as DiffusionParams.image. The final output carries
tensors["video"], uint8 (1, F, H, W, 3), written as MP4 (utils/video.py) at the request's
fps. A model whose VideoSpec says `audio` (LTX-2) also returns a sound track (the output's
AudioChunk): the MP4 carries it as AAC (WebM as Opus; WebP and GIF have no sound), and
`variant=audio` serves it alone as WAV, from the job's files or from /sync. `generate_sound`
(vLLM-Omni's) false leaves it out; `variant=audio` or `generate_sound` true of a model without
sound is a 400 naming the field.

`max_running` workers take the oldest queued job each; the engine reports progress per
denoising step, kept as the job's `progress` (percent). A job ends completed, or failed with
the engine's error: any failure, never in_progress (the worker's last resort). At startup,
jobs left in progress are queued again.

The store is the server's own (its scope: video_store.server_scope) and runs its database
calls on a thread of its own; while another process holds the database locked, a route
answers 503 `video_store_busy` with Retry-After, and the workers wait and try again.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from omnistage.engine.request import RequestFields
from omnistage.entrypoints.openai.client import EngineClient, unless_disconnected
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLoader
from omnistage.entrypoints.openai.protocol_video import (
    VideoDeleted,
    VideoError,
    VideoFileFormat,
    VideoList,
    VideoObject,
    VideoVariant,
)
from omnistage.entrypoints.openai.video_params import NO_SOUND, VideoLimits, plan, read_request
from omnistage.entrypoints.openai.video_store import (
    ACTIVE,
    StoreBusy,
    VideoJob,
    VideoStore,
    now,
)
from omnistage.payloads import AudioChunk
from omnistage.registry import VideoSpec
from omnistage.utils.audio import decode_audio, encode_audio
from omnistage.utils.video import (MEDIA_TYPES, SoundTrack, decode_sound_track, decode_video,
                                   encode_video)

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1          # a busy store: when a client may try again, when a worker does
SOUND_FILE = "audio.wav"   # a job's sound track alone (16-bit PCM), beside video.mp4


def store_busy(exc: StoreBusy) -> APIError:
    """The 503 for a store whose database another process holds locked."""
    return APIError(503, f"{exc}; retry in {RETRY_AFTER_S} s", code="video_store_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


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
        """Queue again what the last run left in progress, then start the workers."""
        if self.store is not None:
            self.workers = [asyncio.create_task(self._serve())]

    async def stop(self) -> None:
        """Shutdown: generations stop where they are (their jobs stay in_progress, to run
        again at the next start)."""
        for task in self.workers:
            task.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)

    async def _serve(self) -> None:
        assert self.store is not None
        queued = await _retrying(self.store.requeue, self.model_name)
        if queued:
            logger.info("videos: %d job(s) queued from before the restart", queued)
        # (cancelling this gather, at stop, cancels every worker)
        await asyncio.gather(*(self._work() for _ in range(self.limits.max_running)))

    async def _work(self) -> None:
        assert self.store is not None
        while True:
            self.wake.clear()       # before the claim: a job added while it runs wakes us
            job = await _retrying(self.store.claim_next)
            if job is None:
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

        async def progress(share: float) -> None:
            if int(share * 100) > seen[0]:
                seen[0] = int(share * 100)
                with contextlib.suppress(StoreBusy):    # progress is news, not state
                    await store.update(job.id, progress=min(seen[0], 99))

        try:
            image = await run_in_threadpool(store.input_image, job.id)
            frames, sound = await self._generate(job.prompt, job.request, image, progress)
            data = await run_in_threadpool(encode_video, frames, job.request["fps"], "mp4",
                                           sound)
            if sound is not None:
                await run_in_threadpool(store.write, job.id, SOUND_FILE, _wav(sound))
            await run_in_threadpool(store.write, job.id, "video.mp4", data)
        except APIError as exc:
            return await self._fail(job, exc.code or "engine_error", exc.message)
        except Exception:   # the last resort: a job never stays in_progress; its text (file
            logger.exception("video job %s failed", job.id)   # paths, internals) stays in the log
            return await self._fail(job, "internal_error", "the job failed in the server; the "
                                                           "server's log has the details")
        await _retrying(store.update, job.id, status="completed", progress=100,
                        completed_at=now())

    async def _fail(self, job: VideoJob, code: str, message: str) -> None:
        assert self.store is not None
        logger.warning("video job %s failed: %s", job.id, message)
        await _retrying(self.store.update, job.id, status="failed", completed_at=now(),
                        error={"code": code, "message": message})

    async def _generate(self, prompt: str, fields: dict[str, Any], image: bytes | None,
                        progress: Callable[[float], Awaitable[None]] | None
                        ) -> tuple[np.ndarray, SoundTrack | None]:
        """One engine request through the front door (admitted like any other) -> its
        frames, uint8 (F, H, W, 3), and its sound track if it made one (and the client did not
        leave it out); APIError if it failed. A job (`progress` given) asks for the engine's
        progress, and waits for a slot in a full queue; a sync request gets 429."""
        engine_fields = {k: v for k, v in fields.items() if k != NO_SOUND}
        request = self.client.request(
            prompt, RequestFields(engine_fields, images=(image,) if image else (),
                                  image_fields=True),
            {"video"}, "video", param="prompt", want_progress=progress is not None)
        while True:
            try:
                out = None
                async for out in self.client.generate([request]):
                    if out.progress is not None and progress is not None:
                        await progress(out.progress)
                break
            except APIError as err:
                if err.status != 429 or progress is None or out is not None:
                    raise
                await asyncio.sleep(RETRY_AFTER_S)    # the queue (or the pool) is full
        if out is None or out.video is None:
            raise APIError(500, "the model finished without a video", code="engine_error")
        audio = AudioChunk.unpack(out.tensors)
        if audio is None or audio.samples is None or fields.get(NO_SOUND):
            return out.video, None                                    # (F, H, W, 3)
        samples = audio.samples[0] if audio.samples.dim() == 3 else audio.samples  # video 0's
        if audio.sample_rate is None:
            raise APIError(500, "the model's sound track came without its sample rate",
                           code="engine_error")
        return out.video, SoundTrack(samples.float().cpu().numpy(), int(audio.sample_rate))

    # -- routes ------------------------------------------------------------------------------
    async def create(self, request: Request) -> VideoObject:
        spec, store = self.require_video()
        req, image = await read_request(request, self.media, self.model_name)
        fields, size, seconds = plan(spec, self.limits, req, image)
        if await store.num_active() >= self.limits.max_jobs:
            raise APIError(429, f"{self.limits.max_jobs} video jobs are queued or running, the "
                                "limit here; retry later", code="too_many_video_jobs")
        used = await run_in_threadpool(store.disk_bytes)
        if used >= self.limits.max_disk_bytes:
            raise APIError(429, f"the stored videos take {used} bytes, the limit is "
                                f"{self.limits.max_disk_bytes}: delete some (DELETE "
                                "/v1/videos/{id})", code="video_storage_full")
        job = VideoJob(f"video_{uuid.uuid4().hex}", now(), None, "queued", 0, self.model_name,
                       req.prompt, size, seconds, fields, None)
        await store.add(job, image)
        self.wake.set()
        return as_object(job)

    async def sync(self, request: Request, fmt: VideoFileFormat, variant: VideoVariant = "video"
                   ) -> Response:
        """The file itself (`variant=audio`: the sound track alone, WAV); its headers say what
        vLLM-Omni's say (X-Request-Id, X-Model, X-Inference-Time-S: the seconds from the
        request read to the file made)."""
        spec, _ = self.require_video()
        if variant not in ("video", "audio"):
            raise bad_request(f"variant={variant!r}: video or audio", "variant")
        if variant == "audio":
            _check_sound(spec)
        started = time.monotonic()
        req, image = await read_request(request, self.media, self.model_name)
        fields, _, _ = plan(spec, self.limits, req, image)
        frames, sound = await unless_disconnected(
            request, lambda: self._generate(req.prompt, fields, image, None))
        if variant == "audio":
            if sound is None:
                raise bad_request("variant=audio: the model made no sound track for this "
                                  "request (generate_sound false?)", "variant", "no_audio")
            data, media = await run_in_threadpool(_wav, sound), "audio/wav"
        else:
            data = await run_in_threadpool(encode_video, frames, fields["fps"], fmt, sound)
            media = MEDIA_TYPES[fmt]
        return Response(data, media_type=media, headers={
            "X-Request-Id": f"video_{uuid.uuid4().hex}", "X-Model": self.model_name,
            "X-Inference-Time-S": f"{time.monotonic() - started:.3f}"})

    async def job(self, job_id: str) -> VideoJob:
        """This server's job `job_id` (another server's, in a shared folder, is a 404)."""
        _, store = self.require_video()
        job = await store.get(job_id)
        if job is None:
            raise APIError(404, f"no video {job_id!r}", param="video_id", code="video_not_found")
        return job

    async def list(self, limit: int, after: str | None, order: Literal["asc", "desc"]
                   ) -> VideoList:
        _, store = self.require_video()
        if not 1 <= limit <= 100:
            raise bad_request(f"limit={limit}: must be in [1, 100]", "limit")
        page = await store.list(limit, after, order)
        if page is None:
            raise bad_request(f"after={after!r}: no such video", "after")
        jobs, more = page
        return VideoList(data=[as_object(j) for j in jobs], has_more=more,
                         first_id=jobs[0].id if jobs else None,
                         last_id=jobs[-1].id if jobs else None)

    async def cancel(self, job_id: str) -> VideoObject:
        job = await self.job(job_id)
        if job.status not in ACTIVE:
            raise bad_request(f"video {job_id!r} is {job.status}: only a queued or running "
                              "job can be cancelled", "video_id", "video_not_active")
        await self._stop(job_id)
        assert self.store is not None
        await self.store.update(job_id, status="cancelled", completed_at=now())
        return as_object(await self.job(job_id))

    async def delete(self, job_id: str) -> VideoDeleted:
        await self.job(job_id)
        await self._stop(job_id)
        assert self.store is not None
        await self.store.delete(job_id)
        return VideoDeleted(id=job_id)

    async def _stop(self, job_id: str) -> None:
        """Cancel the job's generation if it runs (its engine request is aborted)."""
        task = self.running.get(job_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def content(self, job_id: str, variant: str, fmt: VideoFileFormat) -> Response:
        job = await self.job(job_id)
        if job.status != "completed":
            raise bad_request(f"video {job_id!r} is {job.status}: its content exists once it "
                              "is completed", "video_id", "video_not_ready")
        if variant not in ("video", "thumbnail", "audio"):
            raise bad_request(f"variant={variant!r}: video, thumbnail or audio", "variant")
        assert self.spec is not None and self.store is not None
        if variant == "audio":
            _check_sound(self.spec)
            path = self.store.folder(job_id) / SOUND_FILE
            if not path.is_file():
                raise bad_request(f"variant=audio: video {job_id!r} has no sound track "
                                  "(made with generate_sound false)", "variant", "no_audio")
            return FileResponse(path, media_type="audio/wav", filename=f"{job_id}.wav")
        name = "thumbnail.webp" if variant == "thumbnail" else f"video.{fmt}"
        path = self.store.folder(job_id) / name
        if not path.is_file():
            path = await run_in_threadpool(self._derive, job, name)
        media = "image/webp" if variant == "thumbnail" else MEDIA_TYPES[fmt]
        return FileResponse(path, media_type=media, filename=f"{job_id}.{path.suffix[1:]}")

    def _derive(self, job: VideoJob, name: str) -> Path:
        """Another format of a completed video (or its first frame), made from the MP4 once
        and kept beside it."""
        assert self.store is not None
        mp4 = (self.store.folder(job.id) / "video.mp4").read_bytes()
        frames, _ = decode_video(mp4)
        if name == "thumbnail.webp":
            buf = io.BytesIO()
            Image.fromarray(frames[0]).save(buf, "WEBP", quality=90)
            data = buf.getvalue()
        else:
            data = encode_video(frames, job.request["fps"], _format(name),
                                self._sound(job.id, mp4))      # WebM keeps the sound
        return self.store.write(job.id, name, data)


    def _sound(self, job_id: str, mp4: bytes) -> SoundTrack | None:
        """A completed job's sound track: its WAV (the waveform to 16 bits), else the MP4's."""
        assert self.store is not None
        wav = self.store.folder(job_id) / SOUND_FILE
        if wav.is_file():
            return SoundTrack(*decode_audio(wav.read_bytes()))
        return decode_sound_track(mp4)


async def _retrying(call: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
    """A worker's store call, tried again every RETRY_AFTER_S while the store is busy (a
    job's state is never dropped; stop() cancels the wait)."""
    while True:
        try:
            return await call(*args, **kw)
        except StoreBusy as exc:
            logger.warning("videos: %s; the worker retries in %d s", exc, RETRY_AFTER_S)
            await asyncio.sleep(RETRY_AFTER_S)


def _check_sound(spec: VideoSpec) -> None:
    if not spec.audio:
        raise bad_request("variant=audio: this model makes video without sound", "variant",
                          "audio_not_supported")


def _wav(sound: SoundTrack) -> bytes:
    return encode_audio(sound.samples, sound.sample_rate, "wav")


def _format(name: str) -> VideoFileFormat:
    fmt = name.rpartition(".")[2]
    assert fmt in MEDIA_TYPES, f"no video format in {name!r}"
    return fmt  # type: ignore[return-value]


def as_object(job: VideoJob) -> VideoObject:
    return VideoObject(id=job.id, status=job.status, progress=job.progress,
                       created_at=job.created_at, completed_at=job.completed_at,
                       error=VideoError(**job.error) if job.error else None, model=job.model,
                       prompt=job.prompt, size=job.size, seconds=job.seconds)
