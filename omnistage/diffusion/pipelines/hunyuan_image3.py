"""HunyuanImage-3.0 (Tencent) text-to-image as a diffusion pipeline: the upstream
`HunyuanImage3ForCausalMM.generate_image(image_size=...)` (bot_task "image", no system prompt)
split into the engine's phases on our model (omnistage/models/hunyuan_image3/):

    prepare:  the prompt in the upstream template (models/hunyuan_image3/template.py), conditional
              and unconditional (<cfg>) rows up to the <timestep> token (their ids are the
              request's conditioning); the noise (num_images, C, h, w), drawn as the upstream
              draws it (bfloat16 from the seed); the shifted schedule
    velocity: a request's first step runs its prefix once through the MoE transformer and keeps
              its keys and values; per request, the timestep and image tokens of both rows after
              that prefix, mixed by CFG (v_u + g (v_c - v_u)); the engine's Euler step is the
              upstream's
    decode:   the Conv3D VAE -> uint8 images

Request fields: guidance_scale (default: the checkpoint's generation_config diff_guidance_scale),
num_inference_steps, flow_shift (default: generation_config flow_shift), height / width (one of
the checkpoint's resolution group; neither: the model picks the ratio with one greedy token, as
the upstream's image_size "auto", and the latent grid is the size floored to the VAE factor, as
upstream), seed, num_images. Not here: its think / recaption text before the image, negative
prompts (the unconditional row is the <cfg> prompt) and edits.

Over several ranks (tensor_parallel_size: each rank holds whole kv heads and a slice of every
expert, models/hunyuan_image3/transformer.py) rank 0 alone prepares, and the others get what it
prepared in the engine's step plan; so prepare runs no transformer: the prefix runs in the
request's first step, where every rank runs the same forward (its own heads' keys and values).
With no size asked the model's ratio token would need the transformer in prepare: over several
ranks such a request takes the base size (1:1, upstream's own fallback), see the docs' Limits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest
from omnistage.errors import InputError
from omnistage.layers.parallel import tp_group
from omnistage.models.hunyuan_image3 import HunyuanImage3
from omnistage.models.hunyuan_image3.generate import (prefix_kv, sigmas, step_geometry,
                                                      velocity)
from omnistage.models.hunyuan_image3.template import (build_prompt, build_ratio_prompt,
                                                      ratio_index, ratio_of_token,
                                                      resolution_group)
from omnistage.models.hunyuan_image3.text import greedy_text

PREFIX_K, PREFIX_V, LAYOUT = "hunyuan_image3.prefix_k", "hunyuan_image3.prefix_v", \
    "hunyuan_image3.layout"
PREFIX_IDS = "hunyuan_image3.prefix_ids"      # (2, P) the rows' ids before <timestep>


class HunyuanImage3Pipeline(DiffusionPipeline):
    label = "HunyuanImage-3.0"
    max_input_images = 0
    # the MoE transformer splits by TP (models/hunyuan_image3/transformer.py): whole kv heads
    # per rank, so they must divide (read from the folder's config.json)
    parallel_axes = ("tp",)
    heads_key = "num_key_value_heads"

    def __init__(self, model: HunyuanImage3, tokenizer, generation: dict,
                 device: torch.device) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.default_guidance = float(generation.get("diff_guidance_scale", 5.0))
        self.default_shift = float(generation.get("flow_shift", 3.0))

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True
                        ) -> HunyuanImage3Pipeline:
        path = Path(path)
        model = HunyuanImage3.from_pretrained(path, device, dtype or torch.float32)
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls(model, AutoTokenizer.from_pretrained(str(path)), generation, device)

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.model]

    # ---- checks -------------------------------------------------------------------------

    def _size(self, params: DiffusionParams) -> tuple[int, int]:
        base = self.model.cfg.image_base_size
        return params.height or base, params.width or base

    def auto_ratio(self, prompt: str) -> int:
        """No size asked: the model picks the ratio index (upstream image_size "auto")."""
        tok, base = self.tokenizer, self.model.cfg.image_base_size
        ids = build_ratio_prompt(lambda s: tok.encode(s, add_special_tokens=False),
                                 tok.convert_tokens_to_ids, tok.bos_token_id, prompt, base)
        (token,) = greedy_text(self.model, ids.to(self.device), 1)
        return ratio_of_token(token, tok.convert_tokens_to_ids("<img_ratio_0>"), base)

    def validate(self, prompt: str | None, params: DiffusionParams, image=None) -> None:
        if not prompt or not prompt.strip():
            raise InputError("prompt: HunyuanImage-3.0 needs a non-empty text prompt", "prompt")
        if params.image is not None or image is not None:
            raise InputError("image: HunyuanImage-3.0 here generates from text only", "image")
        for name, bad in (("negative_prompt", params.negative_prompt is not None),
                          ("true_cfg_scale", params.true_cfg_scale != 1.0)):
            if bad:
                raise InputError(f"{name}: HunyuanImage-3.0 guides against its <cfg> prompt "
                                 "(guidance_scale); it takes no negative prompt", name)
        if params.num_inference_steps < 1:
            raise InputError("num_inference_steps: at least 1", "num_inference_steps")
        if params.height is None and params.width is None:
            return                                          # the model picks (prepare)
        base, (h, w) = self.model.cfg.image_base_size, self._size(params)
        fh, fw = self.model.cfg.vae_downsample_factor
        if ratio_index(base, h, w) is None or h % fh or w % fw:
            sizes = [f"{a}x{b}" for a, b in resolution_group(base) if a % fh == 0 and b % fw == 0]
            raise InputError(f"size: {h}x{w} (height x width) is not one of this checkpoint's "
                             f"sizes: {', '.join(sizes)}", "size")

    def unused_params(self, params: DiffusionParams) -> dict[str, str]:
        return {"boundary_ratio": "a single transformer"} if params.boundary_ratio else {}

    # ---- phases ---------------------------------------------------------------------------

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image=None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        cfg, tok = self.model.cfg, self.tokenizer
        if params.height is None and params.width is None:
            base = cfg.image_base_size          # over several ranks: 1:1 (module docstring)
            ratio = (self.auto_ratio(prompt) if tp_group().world_size == 1
                     else ratio_index(base, base, base))
            h, w = resolution_group(base)[ratio]
        else:
            h, w = self._size(params)
            ratio = ratio_index(cfg.image_base_size, h, w)
        layout = build_prompt(lambda s: tok.encode(s, add_special_tokens=False),
                              tok.convert_tokens_to_ids, tok.bos_token_id, prompt,
                              cfg.image_base_size, ratio)
        th, tw = h // cfg.vae_downsample_factor[0], w // cfg.vae_downsample_factor[1]
        noise = torch.cat([torch.randn((1, cfg.vae.latent_channels, th, tw), generator=generator,
                                       dtype=torch.bfloat16) for _ in range(params.num_images)])
        shift = params.flow_shift if params.flow_shift is not None else self.default_shift
        cond = {PREFIX_IDS: layout.tokens[:, :-1],
                LAYOUT: torch.tensor([layout.timestep_index, th, tw])}
        return noise.float().to(self.device), sigmas(params.num_inference_steps, shift), cond

    def velocity(self, latents: Tensor, sigmas_now: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        out, row = torch.empty_like(latents), 0
        for r in requests:
            if PREFIX_K not in r.cond:
                self.run_prefix(r)
            n = r.latents.shape[0]
            ts_index, th, tw = (int(v) for v in r.cond[LAYOUT])
            kv = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0))
                  for k, v in zip(r.cond[PREFIX_K], r.cond[PREFIX_V])]
            geometry = step_geometry(self.model, ts_index, ts_index + 1, th, tw, self.device)
            x = latents[row:row + n].to(self.model.cfg_dtype())
            t = (sigmas_now[row:row + n].float() * 1000).repeat(2)
            v_c, v_u = velocity(self.model, torch.cat([x, x]), t, kv, geometry).float().chunk(2)
            g = r.params.guidance(self.default_guidance)
            out[row:row + n] = (v_u + g * (v_c - v_u)).to(out.dtype)
            row += n
        return out

    def run_prefix(self, r: DiffusionRequest) -> None:
        """The request's first step: its prefix through the transformer, on every rank alike
        (the same batches in the same order keep the TP all-reduces paired); the keys and
        values replace the ids in its conditioning."""
        kv = prefix_kv(self.model, r.cond.pop(PREFIX_IDS).to(self.device))
        r.cond[PREFIX_K] = torch.stack([k for k, _ in kv])          # (layers, 2, h_kv, P, D)
        r.cond[PREFIX_V] = torch.stack([v for _, v in kv])

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """(n, C, h, w) -> uint8 (n, H, W, 3), as the upstream's VaeImageProcessor rounds."""
        image = self.model.vae.decode(latents.to(self.model.cfg_dtype())).float()
        image = ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return image.permute(0, 2, 3, 1).cpu()
