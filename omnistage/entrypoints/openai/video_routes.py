"""The /v1/videos routes (serving_videos.py does the work). Every one exists whatever the
model; one that makes no video answers 400 `model_not_video`."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from omnistage.entrypoints.openai.protocol import ErrorResponse
from omnistage.entrypoints.openai.protocol_video import (
    VideoDeleted,
    VideoFileFormat,
    VideoList,
    VideoObject,
    VideoRequest,
)
from omnistage.entrypoints.openai.serving_videos import (
    VideoServing,
    as_object,
    store_busy,
)
from omnistage.entrypoints.openai.video_store import StoreBusy

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}


def _body_schema() -> dict[str, Any]:
    """POST /v1/videos takes JSON or a multipart form (`input_reference` a file)."""
    schema = VideoRequest.model_json_schema()
    form = {**schema, "properties": {**schema["properties"], "input_reference": {
        "type": "string", "format": "binary", "description": "the first frame (an image file)"}}}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}, "multipart/form-data": {"schema": form}}}}


def add_video_routes(app: FastAPI, videos: VideoServing) -> None:
    body = _body_schema()

    @app.exception_handler(StoreBusy)
    async def busy(request: Request, exc: StoreBusy) -> Response:
        return store_busy(exc).response()

    @app.post("/v1/videos", responses=ERRORS, openapi_extra=body)
    async def create_video(request: Request) -> VideoObject:
        """Queue a job; poll GET /v1/videos/{id} until completed, then fetch its content."""
        return await videos.create(request)

    @app.post("/v1/videos/sync", responses=ERRORS, response_class=Response,
              openapi_extra=body)
    async def create_video_sync(request: Request, format: VideoFileFormat = "mp4",
                                variant: str = "video") -> Response:
        """Generate at once; the answer is the file (no job is kept); variant=audio: the
        sound track alone (WAV), for a model that makes one."""
        return await videos.sync(request, format, variant)  # type: ignore[arg-type]

    @app.get("/v1/videos", responses=ERRORS)
    async def list_videos(limit: int = 20, after: str | None = None,
                          order: Literal["asc", "desc"] = "desc") -> VideoList:
        return await videos.list(limit, after, order)

    @app.get("/v1/videos/{video_id}", responses=ERRORS)
    async def retrieve_video(video_id: str) -> VideoObject:
        return as_object(await videos.job(video_id))

    @app.get("/v1/videos/{video_id}/content", responses=ERRORS, response_class=Response)
    async def video_content(video_id: str, variant: str = "video",
                            format: VideoFileFormat = "mp4") -> Response:
        return await videos.content(video_id, variant, format)

    @app.post("/v1/videos/{video_id}/cancel", responses=ERRORS)
    async def cancel_video(video_id: str) -> VideoObject:
        return await videos.cancel(video_id)

    @app.delete("/v1/videos/{video_id}", responses=ERRORS)
    async def delete_video(video_id: str) -> VideoDeleted:
        return await videos.delete(video_id)
