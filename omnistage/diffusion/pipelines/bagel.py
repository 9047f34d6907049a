"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT) as a diffusion pipeline: text-to-image and edits, the
upstream `InterleaveInferencer.interleave_inference` split into the engine's phases on our
model (omnistage/models/bagel/):

    prepare:  the prompt (the folder's tokenizer) and, for an edit, the input image (resized as
              the upstream ImageTransform does: VAE side multiples of 16 within 512..1024, ViT
              multiples of 14 within 224..980) into three KV contexts (main, cfg_text, cfg_img:
              generate.build_contexts), carried as the request's conditioning tensors; the
              initial noise tokens (num_images, h*w, p*p*C); the shifted schedule
    velocity: per request, the noisy tokens after each context, mixed by the guidance rule
              (generate.guide); the engine's Euler step is the upstream's
    decode:   tokens -> VAE latents -> uint8 images

Request fields: guidance_scale is the text guidance (cfg_text_scale, default 4.0);
num_inference_steps the Euler steps (the upstream's num_timesteps - 1); height / width the
output size (an edit keeps its input's resized size); seed the posterior draw of the input
image, then the noise (as torch.manual_seed(seed) before the upstream call). The image
guidance, its interval, the renorm and the timestep shift are the stage's options
(`BagelOptions`, defaults the upstream inferencer's; image guidance only for an edit, as the
upstream app). A negative prompt has no meaning here (the text guidance runs against the
context without the prompt) and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.image_input import input_image, peek_image
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest
from omnistage.errors import InputError
from omnistage.models.bagel.generate import (GEN_THINK_SYSTEM_PROMPT, FlowOptions,
                                             SpecialTokens, add_thought, build_contexts,
                                             decode_image, guide, initial_noise, thought_text,
                                             timesteps, to_pixels)
from omnistage.models.bagel.llm import KVContext
from omnistage.models.bagel.model import Bagel
from omnistage.payloads import TOKEN_IDS

DEFAULT_SIZE = 1024
DEFAULT_GUIDANCE = 4.0
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
CONTEXTS = ("main", "cfg_text", "cfg_img")


@dataclass(frozen=True, slots=True)
class BagelOptions:
    """A BAGEL stage's `diffusion.options` (defaults: the upstream inferencer's)."""
    cfg_img_scale: float = 1.5
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: str = "global"
    timestep_shift: float = 3.0
    # an edit's input image resized for the VAE (upstream ImageTransform(1024, 512, 16)) and for
    # the ViT (ImageTransform(980, 224, 14)): long / short side bounds; None: the upstream's,
    # capped to what the checkpoint's position tables hold
    vae_max_size: int | None = None
    vae_min_size: int | None = None
    vit_max_size: int | None = None
    vit_min_size: int | None = None


def resize_size(width: int, height: int, max_size: int, min_size: int, stride: int,
                max_pixels: int = 14 * 14 * 9 * 1024) -> tuple[int, int]:
    """The upstream MaxLongEdgeMinShortEdgeResize: (width, height) scaled into the long/short
    bounds, sides rounded to multiples of `stride`, at most `max_pixels`."""
    def scaled(w: int, h: int, s: float) -> tuple[int, int]:
        return (max(stride, int(round(round(w * s) / stride) * stride)),
                max(stride, int(round(round(h * s) / stride) * stride)))
    scale = max(min(max_size / max(width, height), 1.0), min_size / min(width, height))
    w, h = scaled(width, height, scale)
    if w * h > max_pixels:
        w, h = scaled(w, h, max_pixels / (w * h))
    if max(w, h) > max_size:
        w, h = scaled(w, h, max_size / max(w, h))
    return w, h


class BagelPipeline(DiffusionPipeline):
    label = "BAGEL"
    Options = BagelOptions
    max_input_images = 1

    def __init__(self, model: Bagel, vae: torch.nn.Module, tokenizer, device: torch.device
                 ) -> None:
        self.model, self.vae, self.tokenizer, self.device = model, vae, tokenizer, device
        ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL]
        missing = [t for t, i in zip(SPECIAL, ids) if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ValueError(f"BAGEL tokenizer: no token {missing}")
        self.tokens = SpecialTokens(*ids)
        self.options = BagelOptions()

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True) -> BagelPipeline:
        model, vae = Bagel.from_pretrained(path, device, dtype or torch.float32)
        return cls(model, vae, AutoTokenizer.from_pretrained(str(path)), device)

    def configure(self, options: object) -> None:
        assert isinstance(options, BagelOptions), options
        FlowOptions(cfg_renorm_type=options.cfg_renorm_type)       # checks the renorm type
        self.options = options
        vae_max, _, vit_max, _ = self._bounds()
        cfg = self.model.cfg
        if vae_max > self._max_side() or \
                vit_max > cfg.vit_max_num_patch_per_side * cfg.vit.patch_size:
            raise ValueError(f"BAGEL options: vae_max_size {vae_max} / vit_max_size {vit_max} "
                             "exceed the checkpoint's position tables")

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.model]

    # ---- checks -------------------------------------------------------------------------

    def _max_side(self) -> int:
        return self.model.cfg.max_latent_size * self.model.cfg.latent_downsample

    def _size(self, params: DiffusionParams) -> tuple[int, int]:
        side = min(DEFAULT_SIZE, self._max_side())
        return params.height or side, params.width or side

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if not prompt:
            raise InputError("prompt: BAGEL needs a text prompt", "prompt")
        if params.negative_prompt is not None or params.true_cfg_scale != 1.0:
            name = "negative_prompt" if params.negative_prompt is not None else "true_cfg_scale"
            raise InputError(f"{name}: BAGEL guides against its context without the prompt "
                             "(guidance_scale); it takes no negative prompt", name)
        if params.num_inference_steps < 1:
            raise InputError("num_inference_steps: at least 1", "num_inference_steps")
        if image is None and params.image is not None:
            peek_image(params.image)
        if image is None and params.image is None:
            d, top = self.model.cfg.latent_downsample, self._max_side()
            for name, side in zip(("height", "width"), self._size(params)):
                if side % d or not 0 < side <= top:
                    raise InputError(f"size: {name} {side} must be a multiple of {d} up to "
                                     f"{top}", "size")

    # ---- phases ---------------------------------------------------------------------------

    def _flow(self, params: DiffusionParams, edit: bool) -> FlowOptions:
        o = self.options
        return FlowOptions(num_timesteps=params.num_inference_steps + 1,
                           timestep_shift=o.timestep_shift,
                           cfg_text_scale=params.guidance(DEFAULT_GUIDANCE),
                           cfg_img_scale=o.cfg_img_scale if edit else 1.0,
                           cfg_interval=tuple(o.cfg_interval), cfg_renorm_min=o.cfg_renorm_min,
                           cfg_renorm_type=o.cfg_renorm_type)

    def _bounds(self) -> tuple[int, int, int, int]:
        """(VAE max, VAE min, ViT max, ViT min) sides of an edit's input image."""
        o, cfg = self.options, self.model.cfg
        vae_max = o.vae_max_size or min(1024, self._max_side())
        vit_max = o.vit_max_size or min(980, cfg.vit_max_num_patch_per_side * cfg.vit.patch_size)
        return (vae_max, o.vae_min_size or min(512, vae_max), vit_max,
                o.vit_min_size or min(224, vit_max))

    def _pixels(self, image: Image.Image) -> tuple[Tensor, Tensor]:
        """An edit's input as the VAE and as the ViT see it, (3, H, W) each in [-1, 1]."""
        cfg = self.model.cfg
        vae_max, vae_min, vit_max, vit_min = self._bounds()
        rgb = image.convert("RGB")
        w, h = resize_size(*rgb.size, vae_max, vae_min, cfg.latent_downsample)
        vae_img = rgb.resize((w, h), Image.Resampling.BICUBIC) if (w, h) != rgb.size else rgb
        vw, vh = resize_size(w, h, vit_max, vit_min, cfg.vit.patch_size)
        vit_img = vae_img.resize((vw, vh), Image.Resampling.BICUBIC) \
            if (vw, vh) != vae_img.size else vae_img
        return tuple(to_pixels(torch.from_numpy(np.asarray(x).copy())).to(self.device)
                     for x in (vae_img, vit_img))

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        image = input_image(params, image)
        segments = self._segments(prompt, image)
        hw = self._grid(params, image)
        ctxs = build_contexts(self.model, self.vae, segments, self.tokens, with_vae=True,
                              generator=generator)
        noise = torch.stack([initial_noise(self.model, hw, generator, self.device)
                             for _ in range(params.num_images)])      # (n, h*w, p*p*C)
        t, dt = timesteps(self._flow(params, image is not None))
        sigmas = torch.cat([t, (t[-1] - dt[-1]).reshape(1)])
        cond = {"grid": torch.tensor(hw)}      # (2,): h, w latent tokens
        for name in CONTEXTS:
            cond.update(pack_context(name, getattr(ctxs, name)))
        return noise, sigmas, cond

    def _segments(self, prompt: str, image: Image.Image | None) -> list:
        """The request's inputs in order: an edit's image, then the prompt's ids."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return [ids] if image is None else [self._pixels(image), ids]

    def _ready(self, r: DiffusionRequest) -> None:
        """Called before a request's steps (think mode adds its thought here)."""

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Each request's images after its own contexts (contexts differ in length)."""
        out, row = torch.empty_like(latents), 0
        for r in requests:
            self._ready(r)
            hw = tuple(int(v) for v in r.cond["grid"])
            ctxs = {n: unpack_context(n, r.cond, self.model.cfg.llm.num_hidden_layers)
                    for n in CONTEXTS}
            flow = self._flow(r.params, r.params.image is not None)
            for i in range(r.latents.shape[0]):
                out[row + i] = self._guided(latents[row + i], sigmas[row + i], hw, ctxs, flow)
            row += r.latents.shape[0]
        return out

    def _guided(self, x: Tensor, t: Tensor, hw: tuple[int, int], ctxs: dict[str, KVContext],
                flow: FlowOptions) -> Tensor:
        inside = flow.cfg_interval[0] < t <= flow.cfg_interval[1]
        s_text = flow.cfg_text_scale if inside else 1.0
        s_img = flow.cfg_img_scale if inside else 1.0
        tok, step = self.tokens, self.model.step_rows
        v = step(ctxs["main"], x, hw, t, tok.soi, tok.eoi, store=False)
        if s_text <= 1.0:
            return v
        v_text = step(ctxs["cfg_text"], x, hw, t, tok.soi, tok.eoi, store=False)
        v_img = step(ctxs["cfg_img"], x, hw, t, tok.soi, tok.eoi, store=False) \
            if s_img > 1.0 else None
        return guide(v, v_text, v_img, s_text, s_img, flow)

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """(n, h*w, p*p*C) -> uint8 (n, H, W, 3)."""
        grid = self._grid(params, input_image(params, None))
        return torch.stack([decode_image(self.model, self.vae, x, grid) for x in latents]).cpu()

    def _grid(self, params: DiffusionParams, image: Image.Image | None) -> tuple[int, int]:
        """The latent token grid: the output size's, or an edit's resized input's."""
        d = self.model.cfg.latent_downsample
        if image is None:
            height, width = self._size(params)
        else:
            vae_max, vae_min = self._bounds()[:2]
            width, height = resize_size(*image.size, vae_max, vae_min, d)
        return height // d, width // d

    def unused_params(self, params: DiffusionParams) -> dict[str, str]:
        unused = super().unused_params(params)
        if params.image is not None:
            unused.update({name: "an edit keeps its input image's (resized) size"
                           for name in ("height", "width") if getattr(params, name)})
        return unused


class BagelThinkPipeline(BagelPipeline):
    """Think mode (graph bagel_think.yaml): the upstream's GEN_THINK_SYSTEM_PROMPT before the
    prompt in the contexts, and the understanding stage's greedy planning answer (its token
    ids along the edge und -> dit, payloads.TOKEN_IDS) added to the main context as the
    upstream does: decoded, cut at the end token, encoded again (generate.thought_text). The
    request is prepared (contexts, noise) when it arrives and waits for the answer."""

    text_with_upstream = True      # the prompt is read here, the plan comes along the edge
    splits_text = True             # (what lets a stage of it take an input edge)

    def _segments(self, prompt: str, image: Image.Image | None) -> list:
        system = self.tokenizer.encode(GEN_THINK_SYSTEM_PROMPT, add_special_tokens=False)
        return [system, *super()._segments(prompt, image)]

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """{TOKEN_IDS: the answer's ids (T,)} -> {"thought_ids": the thought re-encoded}."""
        ids = tensors.get(TOKEN_IDS)
        if set(tensors) != {TOKEN_IDS} or ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"conditioning: expected {TOKEN_IDS!r} (T,) integer ids (the "
                             f"understanding stage's answer), got {sorted(tensors)}")
        text = thought_text(self.tokenizer, ids.tolist(), self.tokens)
        thought = self.tokenizer.encode(text, add_special_tokens=False)
        return {"thought_ids": torch.tensor(thought, dtype=torch.int64)}

    def _ready(self, r: DiffusionRequest) -> None:
        thought = r.cond.pop("thought_ids", None)
        if thought is None:
            return
        main = unpack_context("main", r.cond, self.model.cfg.llm.num_hidden_layers)
        add_thought(self.model, main, thought.tolist(), self.tokens)
        r.cond.update(pack_context("main", main))


def pack_context(name: str, ctx: KVContext) -> dict[str, Tensor]:
    """A context as conditioning tensors: K and V (layers, S, Hkv, D) and its rope position."""
    if ctx.num_tokens == 0:
        return {f"{name}_rope": torch.tensor(ctx.rope)}
    return {f"{name}_k": torch.stack(ctx.keys), f"{name}_v": torch.stack(ctx.values),
            f"{name}_rope": torch.tensor(ctx.rope)}


def unpack_context(name: str, cond: dict[str, Tensor], num_layers: int) -> KVContext:
    rope = int(cond[f"{name}_rope"])
    if f"{name}_k" not in cond:
        return KVContext([None] * num_layers, [None] * num_layers, 0, rope)
    k, v = cond[f"{name}_k"], cond[f"{name}_v"]
    return KVContext(list(k.unbind(0)), list(v.unbind(0)), k.shape[1], rope)
