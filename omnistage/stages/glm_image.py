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
SamplingParams name none.

An edit (the request's input images, which the orchestrator hands this stage as it hands
them to the DiT: `max_input_images` in its info) puts each condition image in the user turn
before the text, as the processor lays it out, and writes the target grid alone:

    <chat: <bos_img> image tokens <eos_img> ... text>  <sop>th tw<eop>  <bos>
      image tokens: the processor's patches -> vision tower -> VQ codebook ids (one per
      32 px), at 2-D positions (`prompt_positions`); max_tokens = th*tw + 1

Its condition images' tokens and grids go downstream with its first output (the DiT's prior
for each condition image): a payloads.ConditionImages, token ids (sum h*w,), grids (K, 2).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, GenerationConfig

from omnistage.ar.inputs import MultimodalInput
from omnistage.configs.parse import from_dict
from omnistage.configs.schema import StageConfig
from omnistage.diffusion.image_input import decode_image, image_files, output_size
from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InputError
from omnistage.models.glm_image import (MAX_CONDITION_IMAGES, TOKEN_FACTOR,
                                        GlmImageForConditionalGeneration,
                                        image_decode_positions, prompt_positions,
                                        target_grids)
from omnistage.models.loader import resolve_model_path
from omnistage.payloads import ConditionImages
from omnistage.sampling_params import SamplingParams
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest

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
        for name in ("grid_bos_token", "grid_eos_token", "bos_token", "image_token"):
            if getattr(self.tokenizer, name, None) is None:
                raise ValueError(f"{root / PROCESSOR_FOLDER}: the tokenizer has no {name}")
        self.image_processor = AutoImageProcessor.from_pretrained(root / PROCESSOR_FOLDER)
        fields = {**generation_defaults(root / AR_FOLDER), **stage.ar.sampling}
        self.defaults = from_dict(SamplingParams, fields, "sampling")

    def model_info(self) -> StageInfo:
        return StageInfo(text_prompt=True, max_input_images=MAX_CONDITION_IMAGES)

    def prompt_text(self, prompt: str, num_images: int, grids: list[tuple[int, int]]) -> str:
        """The chat-templated user turn (its condition images first, one image placeholder
        each), then `<sop>h w<eop>` for each grid to write (text-to-image: target, preview;
        an edit: target) and the image start token, as GlmImageProcessor builds it."""
        tok = self.tokenizer
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        text += "".join(f"{tok.grid_bos_token}{h} {w}{tok.grid_eos_token}" for h, w in grids)
        return text + tok.bos_token

    def prompt_token_ids(self, prompt: str, grids: list[tuple[int, int]]) -> list[int]:
        """A text-to-image prompt's ids (`prompt_text` without images)."""
        return self.tokenizer(self.prompt_text(prompt, 0, grids),
                              add_special_tokens=False)["input_ids"]

    def edit_prompt(self, prompt: str, images: list[Image.Image], target: tuple[int, int]
                    ) -> tuple[list[int], list[int], MultimodalInput, ConditionImages]:
        """An edit's prompt ids (each image placeholder replaced by that image's visual
        tokens), what the prefix cache hashes for them, its positions, and the tensors the
        DiT takes for its condition images. The cache ids are the ids with the token before
        each image (its start token) replaced by a negative mark of its grid: the same
        tokens in another grid (two blank images of other shapes) sit at other positions."""
        processed = self.image_processor(images=images, return_tensors="pt")
        grids = [(int(h), int(w)) for _, h, w in processed["image_grid_thw"].tolist()]
        check_condition_grids(images, grids)
        tokens = self.engine.model.image_tokens(processed["pixel_values"], grids)
        text = self.prompt_text(prompt, len(images), [target])
        placeholder = self.tokenizer.convert_tokens_to_ids(self.tokenizer.image_token)
        ids: list[int] = []
        cache_ids: list[int] = []
        images_left = iter(zip(tokens, grids))
        for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]:
            if t != placeholder:
                ids.append(t)
                cache_ids.append(t)
                continue
            codes, (h, w) = next(images_left)
            cache_ids[-1] = -1 - (h << 20 | w)
            ids += codes.tolist()
            cache_ids += codes.tolist()
        cfg = self.engine.hf_config
        positions, start = prompt_positions(ids, grids, cfg.image_start_token_id,
                                            cfg.image_end_token_id)
        mm = MultimodalInput(positions, start - len(ids), decode_positions=image_decode_positions(
            start, [target]))
        return ids, cache_ids, mm, ConditionImages(torch.cat(tokens),
                                                   torch.tensor(grids, dtype=torch.int64))

    def add(self, request: StageRequest) -> None:
        if request.streamed:
            raise ValueError("GLM-Image's AR stage is an entry stage")
        files = image_files(request.multimodal)
        if len(files) > MAX_CONDITION_IMAGES:
            raise InputError(f"image: GLM-Image takes at most {MAX_CONDITION_IMAGES} condition "
                             f"images, got {len(files)}", "image")
        images = [decode_image(f) for f in files]
        height, width = image_size(request.diffusion, images[0] if images else None)
        target, preview = target_grids(height, width)
        cond: ConditionImages | None = None
        cache_ids = None
        if images:
            ids, cache_ids, mm, cond = self.edit_prompt(request.prompt or "", images, target)
            num_tokens = target[0] * target[1] + 1
        else:
            ids = self.prompt_token_ids(request.prompt or "", [target, preview])
            mm = MultimodalInput(decode_positions=image_decode_positions(len(ids),
                                                                         [preview, target]))
            num_tokens = preview[0] * preview[1] + target[0] * target[1] + 1
        image = request.diffusion
        params = replace(request.params or self.defaults, max_tokens=num_tokens)
        if params.seed is None and image is not None and image.seed is not None:
            params = replace(params, seed=image.seed)   # one seed draws both halves
        self.engine.add_request(request.request_id, ids, params, mm=mm, cache_ids=cache_ids)
        if cond is not None:
            self.attach(request.request_id, cond)


def image_size(params: DiffusionParams | None, image: Image.Image | None = None
               ) -> tuple[int, int]:
    """(height, width) of the image a request asks for (an edit that names none: its first
    condition image's, rounded down to the token side, as the DiT's); ValueError naming the
    field when it is missing or not a multiple of the token side."""
    params = params or DiffusionParams()
    if image is None and (params.height is None or params.width is None):
        raise ValueError("height / width: GLM-Image's AR stage needs the image size (pass "
                         "DiffusionParams(height=..., width=...))")
    height, width = output_size(params.height, params.width, image, TOKEN_FACTOR, 0)
    for name, side in (("height", height), ("width", width)):
        if side < TOKEN_FACTOR or side % TOKEN_FACTOR:
            raise ValueError(f"{name}={side}: GLM-Image needs a multiple of {TOKEN_FACTOR} "
                             f"(AR visual tokens of {TOKEN_FACTOR} px)")
    return height, width


def check_condition_grids(images: list[Image.Image], grids: list[tuple[int, int]]) -> None:
    """Each condition image's (rows, cols) of visual tokens, as the processor resized it,
    must be half the DiT's patch grid of the image (side // 16 each way), which its tokens,
    upsampled 2x, cover; InputError naming `image` otherwise."""
    patch = TOKEN_FACTOR // 2
    for i, (image, (h, w)) in enumerate(zip(images, grids)):
        width, height = image.size
        if (2 * h, 2 * w) != (height // patch, width // patch):
            raise InputError(f"image {i}: {width}x{height} px gives a {h}x{w} token grid "
                             f"after the processor's resize, not half the {height // patch}"
                             f"x{width // patch} DiT patches of the image: use sides that "
                             f"are multiples of {TOKEN_FACTOR} px within the processor's "
                             "pixel limits", "image")
