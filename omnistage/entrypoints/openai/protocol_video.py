"""Request and response bodies of /v1/videos (OpenAI's video jobs; strict, as every request
in protocol.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from omnistage.entrypoints.openai.protocol import Request

# ---- video (/v1/videos) ----------------------------------------------------------------------

VideoFileFormat = Literal["mp4", "webm", "webp", "gif"]
VideoVariant = Literal["video", "thumbnail", "audio"]   # audio: the sound track alone, WAV


class VideoParamsBlock(Request):
    """vLLM-Omni's `video_params` object: the same four fields, used where the top level
    leaves them out."""

    width: Annotated[int, Field(ge=1)] | None = None
    height: Annotated[int, Field(ge=1)] | None = None
    num_frames: Annotated[int, Field(ge=1)] | None = None
    fps: Annotated[float, Field(gt=0.0, le=120.0)] | None = None


class VideoRequest(Request):
    """POST /v1/videos (and /sync), as JSON or as a multipart form (what the OpenAI SDK
    and vLLM-Omni's curl examples send; `input_reference` then a file). `seconds` or
    `num_frames` (an extension) sets the length; `fps` (an extension) the file's rate, the
    model's by default. `size` or vLLM-Omni's `width` / `height` set the size."""

    prompt: Annotated[str, Field(min_length=1, max_length=32000)]
    model: str | None = None
    seconds: str | float | None = None          # OpenAI sends "4", "8", "12"
    num_frames: Annotated[int, Field(ge=1)] | None = None
    fps: Annotated[float, Field(gt=0.0, le=120.0)] | None = None
    size: str | None = None                     # "WxH"
    width: Annotated[int, Field(ge=1)] | None = None      # vLLM-Omni's form of the size
    height: Annotated[int, Field(ge=1)] | None = None
    video_params: VideoParamsBlock | None = None          # vLLM-Omni's, in JSON
    # an image file: a data: / file: / http(s) URL or bare base64 (JSON); {"image_url": URL}
    input_reference: str | dict[str, str] | None = None
    # vLLM-Omni's JSON-safe reference: {"image_url": URL} ({"file_id": ...}: no files here)
    image_reference: dict[str, str] | None = None
    user: str | None = None
    # diffusion extras
    negative_prompt: Annotated[str, Field(max_length=32000)] | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=200)] | None = None
    guidance_scale: Annotated[float, Field(ge=0.0)] | None = None
    guidance_scale_2: Annotated[float, Field(ge=0.0)] | None = None   # Wan2.2 A14B low-noise
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    # vLLM-Omni's Wan knobs, accepted; the model's config decides them here (video_params.py)
    boundary_ratio: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    flow_shift: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    true_cfg_scale: Annotated[float, Field(ge=0.0)] | None = None     # no true CFG in video
    # vLLM-Omni's: the sound track of a model that makes one (LTX-2); false leaves it out of
    # the file, true asks it of a model without one (400)
    generate_sound: bool | None = None
    # LTX-2's two-stage recipe (base -> latent upsampler -> refine) for this request, on a
    # folder with a latent_upsampler/; false: one stage; absent: the server's graph decides
    upsample: bool | None = None


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
