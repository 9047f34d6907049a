"""POST /v1/images/generations and POST /v1/images/edits, for models whose graph ends in an
image stage.

The OpenAI fields map onto the entry stage's DiffusionParams: n -> num_images, size "WxH" ->
width and height, plus the diffusion extras (negative_prompt, num_inference_steps,
guidance_scale, true_cfg_scale, seed). Images come back base64-encoded (`b64_json`) as PNG,
JPEG or WebP; this server hosts no files, so `response_format: url` is refused.

An edit is an image-to-image request: the uploaded image becomes DiffusionParams.image and
`strength` (an extension) how much of it is redrawn. Masks (inpainting) are not supported.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import UploadFile
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from omnistage.entrypoints.openai.client import EngineClient, failed, unless_disconnected
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLoader, decode_image
from omnistage.entrypoints.openai.params import parse_size, stage_params
from omnistage.entrypoints.openai.protocol import ImageData, ImageGenerationRequest, ImagesResponse
from omnistage.outputs import OmniOutput
from omnistage.utils.images import encode_image_b64

_DIFFUSION_FIELDS = ("negative_prompt", "num_inference_steps", "guidance_scale",
                     "true_cfg_scale", "seed")


class ImageServing:
    def __init__(self, client: EngineClient, media: MediaLoader, model_name: str) -> None:
        self.client = client
        self.media = media
        self.model_name = model_name

    def _check_endpoint(self) -> None:
        if "image" not in self.client.outputs:
            raise bad_request("this model does not produce images (it produces "
                              f"{', '.join(sorted(self.client.outputs))}); use "
                              "/v1/chat/completions", "model", "unsupported_endpoint")

    async def generate(self, req: ImageGenerationRequest, request: Request) -> ImagesResponse:
        self._check_endpoint()
        return await self._run(req, request)

    async def edit(self, req: ImageGenerationRequest, images: list[UploadFile],
                   mask: UploadFile | None, strength: float | None, request: Request
                   ) -> ImagesResponse:
        self._check_endpoint()
        if not images:
            raise bad_request("image: one image file is required", "image")
        if len(images) > 1:
            raise bad_request(f"image: one image per edit, got {len(images)}", "image")
        if mask is not None:
            raise bad_request("mask: masked edits (inpainting) are not supported; the whole "
                              "image is redrawn, as much as `strength` says", "mask")
        data = await self._upload(images[0], "image")
        return await self._run(req, request, data, strength)

    async def _upload(self, upload: UploadFile, param: str) -> bytes:
        limit = self.media.policy.max_bytes
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise APIError(413, f"{param}: the file is larger than {limit} bytes", param=param,
                           code="media_too_large")
        if not data:
            raise bad_request(f"{param}: the file is empty", param, "invalid_image")
        await run_in_threadpool(decode_image, data, param)     # a clear 400 if it is no image
        return data

    async def _run(self, req: ImageGenerationRequest, request: Request,
                   image: bytes | None = None, strength: float | None = None) -> ImagesResponse:
        if req.response_format != "b64_json":
            raise bad_request("response_format: this server returns images inline only; use "
                              "b64_json", "response_format")
        height, width = parse_size(req.size)
        fields: dict[str, Any] = {"num_images": req.n}
        if height is not None:
            fields.update(height=height, width=width)
        for name in _DIFFUSION_FIELDS:
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if strength is not None:
            fields["strength"] = strength
        # an edit's image bytes travel as they are (the engine decodes them where used)
        params = stage_params(self.client.graph, self.client.entry, fields, None, image)
        prepared = self.client.prepare(req.prompt, params, "prompt")
        ticket = self.client.admit()
        try:
            handle = self.client.submit(req.prompt, prepared, {"image"}, "img")
            try:
                out = await unless_disconnected(request, lambda: _last(handle.outputs()))
            finally:
                handle.close()
        finally:
            ticket.release()
        if failed(out):
            err = self.client.failure(out, "prompt")
            if err.param in ("height", "width"):
                err.param = "size"
            raise err
        pixels = out.tensors.get("images")
        if pixels is None:
            raise APIError(500, "the model finished without an image", code="engine_error")
        quality = max(1, req.output_compression) if req.output_compression is not None else 90
        data = await run_in_threadpool(
            lambda: [ImageData(b64_json=encode_image_b64(img, req.output_format, quality))
                     for img in pixels])                               # pixels: (n, H, W, C)
        return ImagesResponse(data=data, output_format=req.output_format,
                              size=f"{pixels.shape[2]}x{pixels.shape[1]}")


async def _last(outputs: AsyncIterator[OmniOutput]) -> OmniOutput:
    last = None
    async for out in outputs:
        last = out
    assert last is not None and last.finished
    return last
