"""What a /v1/videos request becomes: its body read (JSON, or the multipart form the OpenAI
SDK and vLLM-Omni's curl examples send), then `plan` checks every value against the model's
VideoSpec and the server's limits and returns the engine fields (DiffusionParams' names:
num_frames, fps, height, width, seed, and the diffusion extras given), all before anything is
queued.

vLLM-Omni's forms are read too: `width` / `height` make the size (a side left out: the
model's default; with `size` as well, they must agree, else 400), a `video_params` object
fills in width, height, num_frames and fps the top level leaves out, `image_reference:
{"image_url": URL}` is the first frame as `input_reference` would be (a form sends these two
objects as JSON text). `boundary_ratio` and `flow_shift` set this request's schedule (a model
without an expert switch names `boundary_ratio` ignored); `true_cfg_scale` is accepted and
ignored (`ignore`: logged, and named in the answer's X-Omnistage-Ignored header): Wan guides
with guidance_scale (and guidance_scale_2).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request

from omnistage.entrypoints.openai.errors import (
    APIError,
    bad_request,
    check_model,
    invalid,
)
from omnistage.entrypoints.openai.json_body import parse_json
from omnistage.entrypoints.openai.media import MediaLoader, decode_b64, open_image
from omnistage.entrypoints.openai.params import ignore, parse_size
from omnistage.entrypoints.openai.protocol_video import VideoRequest
from omnistage.registry import VideoSpec

_EXTRAS = ("negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2",
           "boundary_ratio", "flow_shift")   # the last two: this request's schedule (Wan)
# accepted with no effect here, and why (logged, and named in the answer's header)
_IGNORED = {"true_cfg_scale": "video models here guide with guidance_scale (and "
                              "guidance_scale_2)",
            "user": "no abuse monitoring here"}
_OBJECTS = ("image_reference", "video_params")     # objects: JSON text in a form
_BLOCK = ("width", "height", "num_frames", "fps")  # what video_params may fill in
NO_SOUND = "no_sound"  # a job's own field: the client left the sound track out
MAX_SEED = 2**31       # a seed drawn for a request without one (kept with its job)
# "4", "2.5", ".5": ASCII digits only (float() also takes "４", "٤", "1_0", "1e3", "nan")
_SECONDS = re.compile(r"[0-9]{1,6}(?:\.[0-9]{0,6})?|\.[0-9]{1,6}", re.ASCII)


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_jobs: int = 64                 # queued + in progress; more: 429
    max_frames: int = 241              # below the model's own maximum, if lower
    max_size: int = 1920               # longest side, pixels
    max_disk_bytes: int = 20 << 30     # the jobs' files; more: 429 until some are deleted
    max_running: int = 1               # jobs the engine runs at once


async def read_request(request: Request, media: MediaLoader, model_name: str
                       ) -> tuple[VideoRequest, bytes | None]:
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
                    image = await _upload(value, media.policy.max_bytes)
                else:
                    fields[key] = _form_object(key, value) if key in _OBJECTS else value
        body: Any = fields
    else:
        body = await request.body()
    try:
        # a form's fields are text; a JSON body is held to the app's JSON policy
        req = (VideoRequest.model_validate(body, strict=False) if isinstance(body, dict)
               else VideoRequest.model_validate(parse_json(body or b"{}")))
    except ValidationError as exc:
        raise invalid(exc.errors()) from None
    check_model(req.model, model_name)
    ref = _reference_given(req, image)
    if ref is not None:
        image = await run_in_threadpool(_reference, media, ref)
    if image is not None:   # its header only: the engine decodes it
        open_image(image, "input_reference", media.policy.max_image_pixels)
    return req, image


async def _upload(upload: UploadFile, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise APIError(413, f"input_reference: the file is larger than {limit} bytes",
                       param="input_reference", code="media_too_large")
    return data


def _form_object(key: str, value: str) -> Any:
    """A form field that holds an object (vLLM-Omni's `image_reference`, `video_params`)."""
    try:
        return parse_json(value.encode())
    except APIError:
        raise bad_request(f"{key}: expected a JSON object", key) from None


def _reference_given(req: VideoRequest, upload: bytes | None) -> str | dict[str, str] | None:
    """The first frame's reference (an uploaded file is read already): `input_reference`,
    or vLLM-Omni's `image_reference` {"image_url": URL}; both: 400."""
    ref = req.image_reference
    if ref is None:
        return req.input_reference
    if upload is not None or req.input_reference is not None:
        raise bad_request("image_reference, input_reference: give the first frame once",
                          "image_reference")
    if "file_id" in ref:
        raise bad_request("image_reference.file_id: this server has no files API; send "
                          "{\"image_url\": URL} or upload input_reference",
                          "image_reference.file_id")
    if set(ref) != {"image_url"}:
        raise bad_request("image_reference: expected {\"image_url\": URL}", "image_reference")
    return ref


def _reference(media: MediaLoader, ref: str | dict[str, str]) -> bytes:
    url = ref.get("image_url") if isinstance(ref, dict) else ref
    if not url:
        raise bad_request("input_reference: expected an image (a data: URL, base64, or "
                          "{\"image_url\": URL})", "input_reference")
    if ":" in url[:12]:
        return media.fetch(url, "input_reference")
    return decode_b64(url, "input_reference")


def plan(spec: VideoSpec, limits: VideoLimits, req: VideoRequest, image: bytes | None
         ) -> tuple[dict[str, Any], str, str]:
    """(the engine fields, "WxH", seconds) of a request, every value checked (400)."""
    req = _with_block(req)
    fps = req.fps or spec.fps
    num_frames = _num_frames(spec, limits, req, fps)
    width, height = _size(spec, limits, req)
    if image is not None and not spec.image_to_video:
        raise bad_request("input_reference: this model makes video from text only",
                          "input_reference", "image_to_video_not_supported")
    if image is None and not spec.text_to_video:
        raise bad_request("input_reference: this model needs a first-frame image",
                          "input_reference")
    for name, why in _IGNORED.items():
        if getattr(req, name) is not None:
            ignore(name, why)
    fields: dict[str, Any] = {"num_frames": num_frames, "fps": fps, "height": height,
                              "width": width,
                              "seed": secrets.randbelow(MAX_SEED) if req.seed is None
                              else req.seed}
    fields.update({k: getattr(req, k) for k in _EXTRAS if getattr(req, k) is not None})
    if req.upsample is not None:
        if req.upsample and not spec.upsample:
            raise bad_request("upsample: this model has no latent upsampler (LTX-2's "
                              "two-stage recipe needs the folder's latent_upsampler/)",
                              "upsample", "upsample_not_supported")
        fields["upsample"] = req.upsample
    if req.generate_sound and not spec.audio:
        raise bad_request("generate_sound: this model makes video without sound",
                          "generate_sound", "audio_not_supported")
    if req.generate_sound is False and spec.audio:
        fields[NO_SOUND] = True         # the server's, not the engine's (serving_videos.py)
    return fields, f"{width}x{height}", f"{num_frames / fps:g}"


def _with_block(req: VideoRequest) -> VideoRequest:
    """The request with `video_params`' values where the top level has none."""
    block = req.video_params
    if block is None:
        return req
    return req.model_copy(update={k: getattr(block, k) for k in _BLOCK
                                  if getattr(req, k) is None
                                  and getattr(block, k) is not None})


def _size(spec: VideoSpec, limits: VideoLimits, req: VideoRequest) -> tuple[int, int]:
    """(width, height): `size`, or `width` / `height` (a side left out: the model's default),
    or the model's default; checked against the model's multiple and the server's limit,
    the 400 naming the field it came from."""
    height, width = parse_size(req.size)
    if req.width is not None or req.height is not None:
        if width is not None and height is not None:     # size given too: they must agree
            for name, given, side in (("width", req.width, width),
                                      ("height", req.height, height)):
                if given is not None and given != side:
                    raise bad_request(f"size={req.size!r} and {name}={given} disagree: give "
                                      "the size once", name)
        default_w, default_h = spec.default_size
        width, height = width or req.width or default_w, height or req.height or default_h
    elif width is None or height is None:
        width, height = spec.default_size
    for name, side in (("width", width), ("height", height)):
        param = "size" if req.size is not None or getattr(req, name) is None else name
        if side % spec.size_multiple:
            raise bad_request(f"size={width}x{height}: width and height must be multiples "
                              f"of {spec.size_multiple} for this model", param)
        if side > limits.max_size:
            raise bad_request(f"size={width}x{height}: the longest side is at most "
                              f"{limits.max_size} pixels here", param, "size_too_large")
    return width, height


def _num_frames(spec: VideoSpec, limits: VideoLimits, req: VideoRequest, fps: float) -> int:
    if req.seconds is not None and req.num_frames is not None:
        raise bad_request("seconds, num_frames: give one of them", "num_frames")
    param = "num_frames" if req.num_frames is not None else "seconds"
    if req.num_frames is not None:
        num_frames = req.num_frames
        if not spec.valid_num_frames(num_frames):
            raise bad_request(f"num_frames={num_frames}: this model makes "
                              f"{spec.frame_rule}", "num_frames")
    elif req.seconds is not None:
        if isinstance(req.seconds, str) and not _SECONDS.fullmatch(req.seconds):
            raise bad_request(f"seconds={req.seconds!r}: expected a number of seconds in "
                              "ASCII digits, e.g. \"4\" or \"2.5\"", "seconds")
        seconds = float(req.seconds)
        if not 0 < seconds < 3600:
            raise bad_request(f"seconds={req.seconds!r}: must be > 0", "seconds")
        num_frames = spec.num_frames_for(seconds, fps)
    else:
        num_frames = spec.default_num_frames
    most = min(spec.max_num_frames, limits.max_frames)
    if num_frames > most:
        raise bad_request(f"{param}: {num_frames} frames asked, at most {most} "
                          f"({most / fps:g} s at {fps:g} fps)", param, "too_many_frames")
    return num_frames
