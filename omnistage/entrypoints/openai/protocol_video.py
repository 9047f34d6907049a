"""Request and response bodies of /v1/videos (OpenAI's video jobs; strict, as every request
in protocol.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from omnistage.entrypoints.openai.protocol import Request

# ---- video (/v1/videos) ----------------------------------------------------------------------

VideoFileFormat = Literal["mp4", "webm", "webp", "gif"]


class VideoRequest(Request):
    """POST /v1/videos (and /sync), as JSON or as a multipart form (what the OpenAI SDK
    sends; `input_reference` then a file). `seconds` or `num_frames` (an extension) sets the
    length; `fps` (an extension) the file's rate, the model's by default."""

    prompt: Annotated[str, Field(min_length=1, max_length=32000)]
    model: str | None = None
    seconds: str | float | None = None          # OpenAI sends "4", "8", "12"
    num_frames: Annotated[int, Field(ge=1)] | None = None
    fps: Annotated[float, Field(gt=0.0, le=120.0)] | None = None
    size: str | None = None                     # "WxH"
    # an image file: a data: / file: / http(s) URL or bare base64 (JSON); {"image_url": URL}
    input_reference: str | dict[str, str] | None = None
    user: str | None = None
    # diffusion extras
    negative_prompt: Annotated[str, Field(max_length=32000)] | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=200)] | None = None
    guidance_scale: Annotated[float, Field(ge=0.0)] | None = None
    guidance_scale_2: Annotated[float, Field(ge=0.0)] | None = None   # Wan2.2 A14B low-noise
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    """A video job, as OpenAI's `Video` (status `cancelled` after POST .../cancel)."""

    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    model: str
    prompt: str
    size: str
    seconds: str
    remixed_from_video_id: str | None = None


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True
