"""POST /v1/images/generations and POST /v1/images/edits, for models whose graph ends in an
image stage.

The OpenAI fields map onto the entry stage's DiffusionParams: n -> num_images, size "WxH" ->
width and height, plus the diffusion extras (negative_prompt, num_inference_steps,
guidance_scale, true_cfg_scale, seed). Images come back as PNG, JPEG or WebP, base64-encoded
(`b64_json`) or, with `response_format: url`, as URLs this server serves for an hour
(image_files.py). The other fields OpenAI documents are accepted: `background` "auto" /
"opaque" is what every model here draws and "transparent" a 400 (no alpha channel);
`quality`, `style`, `moderation`, `input_fidelity` and `safety_identifier` change nothing here
and are logged as ignored (and named in the X-Omnistage-Ignored header; the quality knob is
`num_inference_steps`); streamed partial images are a 400.

An edit is an image-to-image request: the uploaded image becomes DiffusionParams.image and
`strength` (an extension) how much of it is redrawn; an edit pipeline (Qwen-Image-Edit,
FLUX.2) conditions on it instead. The OpenAI SDK sends one image as the form field `image`
and a list as `image[]`; both are read, in order: the first becomes `image`, the others
`extra_images`. How many a model takes is its stage's `max_input_images`
(Qwen-Image-Edit-Plus: 3; FLUX.2, whose reference images they are: 10; every other
pipeline: 1); more are a 400 naming `image`. Masks (inpainting) are not supported.
The form is parsed here, strictly: an unknown field is a 400 naming it, as for JSON bodies.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse

from omnistage.diffusion_params import MAX_INPUT_IMAGES
from omnistage.engine.request import RequestFields
from omnistage.entrypoints.openai.client import EngineClient, unless_disconnected
from omnistage.entrypoints.openai.errors import (
    APIError,
    bad_request,
    invalid,
)
from omnistage.entrypoints.openai.image_files import ROUTE_NAME, ImageFiles
from omnistage.entrypoints.openai.lora_adapters import LoraAdapters
from omnistage.entrypoints.openai.media import MediaLoader, open_image
from omnistage.entrypoints.openai.params import ignore, parse_size
from omnistage.entrypoints.openai.protocol import (
    ImageData,
    ImageEditRequest,
    ImageRequest,
    ImagesResponse,
)
from omnistage.outputs import OmniOutput
from omnistage.utils.images import encode_image, mime_type

_DIFFUSION_FIELDS = ("negative_prompt", "num_inference_steps", "guidance_scale",
                     "true_cfg_scale", "seed")
_IGNORED = {"quality": "set num_inference_steps for more or fewer denoising steps",
            "style": "no style switch in these models", "moderation": "no moderation here",
            "input_fidelity": "the input image is used as given",
            "safety_identifier": "no abuse monitoring here",
            "user": "no abuse monitoring here"}
_FILES = ("image", "mask")


def edit_form_schema() -> dict[str, Any]:
    """The OpenAPI schema of the edit form: ImageEditRequest's fields plus the files."""
    schema = ImageEditRequest.model_json_schema()
    binary = {"type": "string", "format": "binary"}
    schema["properties"]["image"] = {"anyOf": [binary, {"type": "array", "items": binary}],
                                     "description": "image(s) to edit; `image[]` too"}
    schema["properties"]["mask"] = binary
    schema["required"] = [*schema.get("required", []), "image"]
    return schema


def parse_edit_form(form: FormData) -> tuple[ImageEditRequest, list[UploadFile],
                                             UploadFile | None]:
    """The edit's fields, its images (`image` or `image[]`, in order) and its mask."""
    fields: dict[str, str] = {}
    images: list[UploadFile] = []
    masks: list[UploadFile] = []
    for key, value in form.multi_items():
        name = "image" if key == "image[]" else key
        if isinstance(value, UploadFile):
            if name not in _FILES:
                raise bad_request(f"{key}: unexpected file (files go in image or mask)", key)
            (images if name == "image" else masks).append(value)
        elif name in _FILES:
            raise bad_request(f"{name}: expected a file upload, got a text field", name)
        elif key in fields:
            raise bad_request(f"{key}: given twice", key)
        else:
            fields[key] = value
    if len(masks) > 1:
        raise bad_request(f"mask: one mask at most, got {len(masks)}", "mask")
    if "lora" in fields:            # vLLM-Omni's edit form: the lora object as JSON text
        fields["lora"] = _json_object(fields["lora"], "lora")
    try:
        req = ImageEditRequest.model_validate(fields, strict=False)   # a form's fields are text
    except ValidationError as exc:
        raise invalid(exc.errors()) from None
    return req, images, (masks[0] if masks else None)


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise bad_request(f"{name}: expected a JSON object", name)
    return value


class ImageServing:
    def __init__(self, client: EngineClient, media: MediaLoader, model_name: str,
                 files: ImageFiles | None = None, loras: LoraAdapters | None = None) -> None:
        self.client = client
        self.loras = loras or LoraAdapters(model_name, True)   # lora_adapters.py
        self.media = media
        self.model_name = model_name
        self.files = files or ImageFiles()      # the images answered as URLs

    def _check_endpoint(self) -> None:
        if "image" not in self.client.outputs:
            raise bad_request("this model does not produce images (it produces "
                              f"{', '.join(sorted(self.client.outputs))}); use "
                              "/v1/chat/completions", "model", "unsupported_endpoint")

    async def generate(self, req: ImageRequest, request: Request
                       ) -> ImagesResponse | JSONResponse:
        self._check_endpoint()
        return await self._run(req, request)

    async def edit(self, request: Request) -> ImagesResponse | JSONResponse:
        """The multipart form of /v1/images/edits, read here (see parse_edit_form)."""
        self._check_endpoint()
        async with request.form() as form:
            req, images, mask = parse_edit_form(form)
            req = self.loras.with_adapter(req)     # `model`: the served one or an adapter
            if not images:
                raise bad_request("image: one image file is required", "image")
            if len(images) > MAX_INPUT_IMAGES:
                raise bad_request(f"image: at most {MAX_INPUT_IMAGES} image files, got "
                                  f"{len(images)}", "image")
            if mask is not None:
                raise bad_request("mask: masked edits (inpainting) are not supported; the "
                                  "whole image is redrawn, as much as `strength` says", "mask")
            files = [await self._upload(upload, "image") for upload in images]
        return await self._run(req, request, files, req.strength)

    async def _upload(self, upload: UploadFile, param: str) -> bytes:
        limit = self.media.policy.max_bytes
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise APIError(413, f"{param}: the file is larger than {limit} bytes", param=param,
                           code="media_too_large")
        if not data:
            raise bad_request(f"{param}: the file is empty", param, "invalid_image")
        # its header only: a clear 400 if it is no image or too large; the engine decodes it
        open_image(data, param, self.media.policy.max_image_pixels)
        return data

    async def _run(self, req: ImageRequest, request: Request, images: list[bytes] | None = None,
                   strength: float | None = None) -> ImagesResponse | JSONResponse:
        _check_openai_fields(req)
        height, width = parse_size(req.size)
        fields: dict[str, Any] = {"num_images": req.n}
        if height is not None:
            fields.update(height=height, width=width)
        for name in _DIFFUSION_FIELDS:
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if strength is not None:
            fields["strength"] = strength
        if req.lora is not None:
            fields["lora"] = req.lora.to_params()
        # an edit's image bytes travel as they are (the engine decodes them where used);
        # no progress asked: the answer comes whole
        engine_req = self.client.request(
            req.prompt, RequestFields(fields, images=tuple(images or ()), image_fields=True),
            {"image"}, "img", param="prompt")
        try:
            out = await unless_disconnected(
                request, lambda: _last(self.client.generate([engine_req])))
        except APIError as err:
            if err.param in ("height", "width"):
                err.param = "size"
            raise
        pixels = out.pixels
        if pixels is None:
            raise APIError(500, "the model finished without an image", code="engine_error")
        quality = max(1, req.output_compression) if req.output_compression is not None else 90
        files = await run_in_threadpool(
            lambda: [encode_image(img, req.output_format, quality)
                     for img in pixels])                               # pixels: (n, H, W, C)
        size = f"{pixels.shape[2]}x{pixels.shape[1]}"
        if req.response_format == "url":
            return self._as_urls(files, req, request, size)
        data = [ImageData(b64_json=base64.b64encode(f).decode("ascii")) for f in files]
        return ImagesResponse(data=data, output_format=req.output_format, size=size)

    def _as_urls(self, files: list[bytes], req: ImageRequest, request: Request, size: str
                 ) -> JSONResponse:
        """OpenAI's answer with `url` in place of `b64_json` (the image files kept here)."""
        media = mime_type(req.output_format)
        urls = [str(request.url_for(ROUTE_NAME, file_id=self.files.put(f, media)))
                for f in files]
        answer = ImagesResponse(data=[], output_format=req.output_format, size=size)
        return JSONResponse({**answer.model_dump(exclude={"data"}),
                             "data": [{"url": url} for url in urls]})


def _check_openai_fields(req: ImageRequest) -> None:
    """OpenAI's image fields: refused where the answer could not be what they ask for,
    logged as ignored where it is the same either way."""
    if req.background == "transparent":
        raise bad_request("background=transparent: this model draws no alpha channel; use "
                          "opaque or auto", "background")
    if req.stream or req.partial_images:
        name = "stream" if req.stream else "partial_images"
        raise bad_request(f"{name}: streamed (partial) images are not supported; the answer "
                          "comes whole", name)
    for name, why in _IGNORED.items():
        if getattr(req, name, None) is not None:
            ignore(name, why)


async def _last(outputs: AsyncIterator[OmniOutput]) -> OmniOutput:
    last = None
    async for out in outputs:
        last = out
    assert last is not None and last.finished
    return last
