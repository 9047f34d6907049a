"""GLM-Image's AR stage: the first half of diffusers' `GlmImagePipeline` (`generate_prior_tokens`)
on our AR engine; the DiT stage downstream decodes its tokens (diffusion/pipelines/glm_image.py).

    prompt text + the request's image size (its DiffusionParams, `StageRequest.diffusion`)
      -> the processor's chat template over one user turn, then the grids to write, as
         transformers' GlmImageProcessor appends them for text-to-image:
             <chat>  <sop>th tw<eop>  <sop>ph pw<eop>  <bos>        (target, then preview)
      -> greedy or sampled visual tokens: the ph x pw preview, the th x tw target, the end
         token (max_tokens = ph*pw + th*tw + 1), each at its grid's (t, h, w) rotary
         position (`image_decode_positions`)

The checkpoint is the diffusers folder: the AR model in vision_language_encoder/, the
tokenizer and chat template in processor/. Its sampling defaults are the AR model's
generation_config.json (what the reference's `generate(do_sample=True)` draws with), under
the graph's `sampling:`; the request's DiffusionParams seed seeds its sampling when its
SamplingParams name none. Editing (input images) is not supported yet.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from omnistage.ar.inputs import MultimodalInput
from omnistage.configs.parse import from_dict
from omnistage.configs.schema import StageConfig
from omnistage.diffusion.params import DiffusionParams
from omnistage.models.glm_image import (TOKEN_FACTOR, GlmImageForConditionalGeneration,
                                        image_decode_positions, target_grids)
from omnistage.models.loader import resolve_model_path
from omnistage.sampling_params import SamplingParams
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import TEXT_PROMPT, StageInfo, StageRequest

AR_FOLDER = "vision_language_encoder"
PROCESSOR_FOLDER = "processor"


def _load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    model = GlmImageForConditionalGeneration.from_pretrained(path / AR_FOLDER, device, dtype)
    return model, model.model_config, AutoConfig.from_pretrained(path / AR_FOLDER)


def generation_defaults(path: Path) -> dict[str, object]:
    """The AR model's generation_config.json as SamplingParams fields: its temperature, top_k
    and top_p when it samples, greedy when it does not."""
    if not (path / "generation_config.json").is_file():
        return {}
    cfg = GenerationConfig.from_pretrained(path)
    if not cfg.do_sample:
        return {"temperature": 0.0}
    return {"temperature": cfg.temperature if cfg.temperature is not None else 1.0,
            "top_k": cfg.top_k or 0, "top_p": cfg.top_p if cfg.top_p is not None else 1.0}


class GlmImageARStage(ARStage):
    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=_load)
        root = resolve_model_path(stage.model or model)
        self.tokenizer = AutoTokenizer.from_pretrained(root / PROCESSOR_FOLDER)
        for name in ("grid_bos_token", "grid_eos_token", "bos_token"):
            if getattr(self.tokenizer, name, None) is None:
                raise ValueError(f"{root / PROCESSOR_FOLDER}: the tokenizer has no {name}")
        fields = {**generation_defaults(root / AR_FOLDER), **stage.sampling}
        self.defaults = from_dict(SamplingParams, fields, "sampling")

    def model_info(self) -> StageInfo:
        return {TEXT_PROMPT: 1}

    def prompt_token_ids(self, prompt: str, grids: list[tuple[int, int]]) -> list[int]:
        """The chat-templated prompt, then `<sop>h w<eop>` for each grid (target first) and the
        image start token, tokenized as GlmImageProcessor does."""
        tok = self.tokenizer
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = tok.apply_chat_template(messages, tokenize=False)
        text += "".join(f"{tok.grid_bos_token}{h} {w}{tok.grid_eos_token}" for h, w in grids)
        return tok(text + tok.bos_token, add_special_tokens=False)["input_ids"]

    def add(self, request: StageRequest) -> None:
        if request.streamed:
            raise ValueError("GLM-Image's AR stage is an entry stage")
        image = request.diffusion
        height, width = image_size(image)
        target, preview = target_grids(height, width)
        ids = self.prompt_token_ids(request.prompt or "", [target, preview])
        num_tokens = preview[0] * preview[1] + target[0] * target[1] + 1
        params = replace(request.params or self.defaults, max_tokens=num_tokens)
        if params.seed is None and image is not None and image.seed is not None:
            params = replace(params, seed=image.seed)   # one seed draws both halves
        mm = MultimodalInput(decode_positions=image_decode_positions(len(ids), [preview, target]))
        self.engine.add_request(request.request_id, ids, params, mm=mm)


def image_size(params: DiffusionParams | None) -> tuple[int, int]:
    """(height, width) of the image a request asks for; ValueError naming the field when it
    is missing, not a multiple of the token side, or an input image is given."""
    if params is None or params.height is None or params.width is None:
        raise ValueError("height / width: GLM-Image's AR stage needs the image size (pass "
                         "DiffusionParams(height=..., width=...))")
    if params.image is not None:
        raise ValueError("image: GLM-Image editing is not supported yet (text-to-image only)")
    for name, side in (("height", params.height), ("width", params.width)):
        if side < TOKEN_FACTOR or side % TOKEN_FACTOR:
            raise ValueError(f"{name}={side}: GLM-Image needs a multiple of {TOKEN_FACTOR} "
                             f"(AR visual tokens of {TOKEN_FACTOR} px)")
    return params.height, params.width

