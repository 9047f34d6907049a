"""What a chat answer carries for an image or a video model, and what a video model's chat
request becomes.

    image model   message.content = [{"type": "image_url",
                                      "image_url": {"url": "data:image/png;base64,..."}}, ...]
    video model   message.content = [{"type": "video_url",
                                      "video_url": {"url": "data:video/mp4;base64,..."}}]

That is vLLM-Omni's answer for both; its clients take the part's data URL and split it at the
comma. A video model's chat request is planned as a /v1/videos request is (video_params.plan:
the model's VideoSpec and the server's video limits, checked before anything is queued), from
vLLM-Omni's fields: `width` / `height` make the size (a side not given: the model's default),
`num_frames`, `fps`, `seed`, `negative_prompt`, `num_inference_steps`, `guidance_scale`,
`guidance_scale_2` as /v1/videos takes them. A frame count the model cannot make is rounded
as diffusers' Wan pipeline rounds it, `n // 4 * 4 + 1` (logged), where /v1/videos refuses it:
vLLM-Omni's own curl example asks for 32 frames.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import numpy as np
from pydantic import ValidationError
from torch import Tensor

from omnistage.entrypoints.openai.errors import APIError, bad_request, invalid
from omnistage.entrypoints.openai.params import ignore
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest
from omnistage.entrypoints.openai.protocol_video import VideoRequest
from omnistage.entrypoints.openai.video_params import VideoLimits, plan
from omnistage.registry import VideoSpec
from omnistage.utils.images import encode_image_b64
from omnistage.utils.video import encode_video

logger = logging.getLogger(__name__)
# the chat fields /v1/videos takes under the same name
_VIDEO_FIELDS = ("fps", "seed", "negative_prompt", "num_inference_steps", "guidance_scale",
                 "guidance_scale_2")
# vLLM-Omni's fields that mean nothing to a video model here, and why
_NOT_FOR_VIDEO = {"true_cfg_scale": "video models here guide with guidance_scale",
                  "lora": "LoRA adapters reach image models only (docs/lora.md)"}
# vLLM-Omni's Wan knobs: passed on where /v1/videos takes them, else logged as ignored
_SCHEDULE_FIELDS = ("boundary_ratio", "flow_shift")


def image_parts(images: Tensor) -> list[dict[str, Any]]:
    """The content parts of an image model's answer; images: uint8 (n, H, W, C)."""
    return [{"type": "image_url",
             "image_url": {"url": f"data:image/png;base64,{encode_image_b64(img, 'png')}"}}
            for img in images]


def video_parts(frames: np.ndarray, fps: float) -> list[dict[str, Any]]:
    """The content part of a video model's answer: the MP4 of frames uint8 (F, H, W, 3)."""
    data = base64.b64encode(encode_video(frames, fps, "mp4")).decode("ascii")
    return [{"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{data}"}}]


def video_fields(req: ChatCompletionRequest, spec: VideoSpec, limits: VideoLimits,
                 has_image: bool) -> dict[str, Any]:
    """The diffusion stage's fields of a video model's chat request (num_frames, fps, height,
    width, seed always set), every value checked as /v1/videos checks it (400 naming the chat
    field). `has_image`: the last user message holds an image (image-to-video); its file is
    loaded later, on the preparation pool."""
    if req.num_outputs_per_prompt not in (None, 1):
        raise bad_request(f"num_outputs_per_prompt={req.num_outputs_per_prompt}: one video "
                          "per request", "num_outputs_per_prompt")
    for name, why in _NOT_FOR_VIDEO.items():
        if getattr(req, name) is not None:
            ignore(name, why)
    body: dict[str, Any] = {k: getattr(req, k) for k in _VIDEO_FIELDS
                            if getattr(req, k) is not None}
    for name in _SCHEDULE_FIELDS:
        if getattr(req, name) is None:
            continue
        if name in VideoRequest.model_fields:
            body[name] = getattr(req, name)
        else:
            ignore(name, "the model's config decides it")
    if req.num_frames is not None:
        body["num_frames"] = _frames_made(spec, req.num_frames)
    if req.width is not None or req.height is not None:
        width, height = spec.default_size
        body["size"] = f"{req.width or width}x{req.height or height}"
    try:
        video = VideoRequest.model_validate({"prompt": "(the chat's last user message)", **body})
        fields, _, _ = plan(spec, limits, video, b"" if has_image else None)
    except ValidationError as exc:
        raise invalid(exc.errors()) from None
    except APIError as err:
        raise _chat_param(err, req, spec, limits) from None
    return fields


def _frames_made(spec: VideoSpec, num_frames: int) -> int:
    """A frame count the model makes: `num_frames` itself, or rounded as diffusers' Wan
    pipeline does (its VAE makes offset + multiple * k frames)."""
    if num_frames < 1 or spec.valid_num_frames(num_frames):
        return num_frames                   # (below 1: refused by the plan, naming it)
    made = num_frames // spec.frame_multiple * spec.frame_multiple + spec.frame_offset
    logger.warning("num_frames=%d: this model makes %s; %d frames made instead (as diffusers "
                   "rounds)", num_frames, spec.frame_rule, made)
    return made


def _chat_param(err: APIError, req: ChatCompletionRequest, spec: VideoSpec,
                limits: VideoLimits) -> APIError:
    """A /v1/videos refusal named as the chat request's field: the size is width or height
    (the one that breaks the rule), the first-frame image an image part of the messages."""
    if err.param == "size":
        def bad(side: int | None) -> bool:
            return side is not None and bool(side % spec.size_multiple or side < 1
                                             or side > limits.max_size)
        err.param = "width" if bad(req.width) or req.height is None else "height"
    elif err.param == "input_reference":
        err.param = "messages"
    return err
