"""vLLM-Omni's form of a diffusion request through chat completions.

vLLM-Omni's image, edit, GLM-Image and video clients post to /v1/chat/completions without
`model` and with the generation parameters either as a literal `extra_body` object in the JSON
body (raw HTTP) or as top-level fields (what the `openai` SDK makes of its `extra_body`
argument). `merge_extra_body` folds the first into the second (a key given both ways: 400
naming it); `diffusion_fields` maps the top-level fields to DiffusionParams' names.
"""

from __future__ import annotations

from typing import Any

from omnistage.entrypoints.openai.errors import bad_request
from omnistage.engine.request import ignore

# vLLM-Omni's name -> DiffusionParams' field
DIFFUSION_FIELDS = {"height": "height", "width": "width",
                    "num_inference_steps": "num_inference_steps",
                    "guidance_scale": "guidance_scale", "guidance_scale_2": "guidance_scale_2",
                    "true_cfg_scale": "true_cfg_scale", "negative_prompt": "negative_prompt",
                    "num_outputs_per_prompt": "num_images", "num_frames": "num_frames",
                    "fps": "fps", "boundary_ratio": "boundary_ratio",
                    "flow_shift": "flow_shift", "lora": "lora"}
# accepted, with no effect here (logged): the pipeline's own schedule decides them
UNUSED_FIELDS: dict[str, str] = {}


def merge_extra_body(data: Any) -> Any:
    """A body's `extra_body` object merged into the body: its keys as if top-level. The
    merged body keeps `extra_body: {}`: that the request came in vLLM-Omni's form."""
    if not isinstance(data, dict) or "extra_body" not in data:
        return data
    extra = data["extra_body"]
    if extra is None:
        return {k: v for k, v in data.items() if k != "extra_body"}
    if not isinstance(extra, dict):
        raise bad_request("extra_body: expected an object", "extra_body")
    for key in extra:
        if key in data:
            raise bad_request(f"{key}: given both at the top level and in extra_body; give it "
                              "once", key)
        if key == "extra_body":
            raise bad_request("extra_body.extra_body: not nested", "extra_body.extra_body")
    return {**{k: v for k, v in data.items() if k != "extra_body"}, **extra,
            "extra_body": {}}


def diffusion_fields(req: Any) -> dict[str, Any]:
    """The diffusion stage's fields a request set in vLLM-Omni's names, in DiffusionParams'."""
    out: dict[str, Any] = {}
    for name, target in DIFFUSION_FIELDS.items():
        value = getattr(req, name)
        if value is not None:       # lora: protocol.LoraBody -> DiffusionParams' LoraRequest
            out[target] = value.to_params() if target == "lora" else value
    for name, why in UNUSED_FIELDS.items():
        if getattr(req, name) is not None:
            ignore(name, why)
    return out


def refuse_on_text_model(req: Any) -> None:
    """vLLM-Omni's diffusion fields sent to a model that makes no images: 400 naming one."""
    for name in sorted(set(DIFFUSION_FIELDS) | set(UNUSED_FIELDS)):
        if getattr(req, name) is not None:
            raise bad_request(f"{name}: a diffusion parameter; this model makes no images or "
                              "video", name)
