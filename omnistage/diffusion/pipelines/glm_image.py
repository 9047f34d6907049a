"""GLM-Image's decode stage: the DiT half of diffusers' `GlmImagePipeline.__call__` split into
the engine's phases (omnistage/diffusion/pipeline.py), numerics kept step for step. The AR half
(the visual tokens) runs in a stage of its own upstream; its tokens arrive along the edge.

    encode:   glyph texts (the prompt's quoted spans, "" when none) -> ByT5 encoder -> the
              real tokens' states of every span, one after another: (L, D) per prompt; with
              CFG the negative is always "" (GlmGlyphEncoder, batched over requests)
    prepare:  randn (n, C, H/8, W/8) on the request's CPU generator; timesteps
              int(linspace(1000, 1, N+1)[:-1]), sigmas = timesteps / 1000 shifted by
              mu = sqrt(image tokens / 256) * max_shift + base_shift; then the request waits
              for the AR stage's tokens (`check_conditioning`)
    condition: the AR's generated tokens: t2i writes a small preview grid first, then the
              target grid (H/32 x W/32), an edit the target grid alone; the target grid's
              tokens, upsampled 2x nearest to the DiT's patch grid, are the prior tokens.
              An edit's condition images (the request's input images, 1..4): each resized
              down to a multiple of 16 px, VAE-encoded (the posterior mean), normalised, run
              once through the transformer under its own AR tokens (from the AR stage,
              upsampled 2x) with no text at timestep 0: every block's image keys and values
              (`condition_kv`), concatenated over the images, are "image_kv"
    velocity: one transformer call over all rows: every row with its glyphs and prior (an
              edit's rows also attend to its image_kv), then the rows of requests with CFG
              again with the "" glyphs, the prior dropped and no image_kv;
              timestep = the request's unshifted timestep - 1; glyphs zero-padded and masked
              comb = uncond + g * (cond - uncond)  (guidance_scale g, default 1.5; CFG if > 1)
    decode:   z * latents_std + latents_mean per channel -> VAE -> (x/2 + 0.5).clamp(0, 1)

Every network is ours (the ByT5 encoder, the transformer, the VAE); the tokenizer comes from
transformers. diffusers' "write / read / skip" KV cache modes are the condition pass, the
conditional rows and the unconditional rows here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.image_input import input_images, preprocess
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.diffusion.cfg import GuidedRows
from omnistage.diffusion.pipeline import encode_with_negatives
from omnistage.diffusion.pipelines.qwen_image import pad_captions
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers import flow_match_euler as solver
from omnistage.models.autoencoder_kl import AutoencoderKL
from omnistage.payloads import CONDITION_GRIDS, CONDITION_TOKEN_IDS, TOKEN_IDS
from omnistage.models.glm_image import MAX_CONDITION_IMAGES, TOKEN_FACTOR, target_grids
from omnistage.models.glm_image_transformer import GlmImageTransformer2DModel
from omnistage.models.text_encoders import T5Encoder

MAX_SIZE = 2048
DEFAULT_GUIDANCE = 1.5
MAX_GLYPH_TOKENS = 2048             # ByT5 tokens per quoted span, diffusers' default
GLYPH_PATTERNS = (r"'([^']*)'", r"\u201c([^\u201c\u201d]*)\u201d", r'"([^"]*)"',
                  r"「([^「」]*)」")


def glyph_texts(prompt: str) -> list[str]:
    """The prompt's quoted spans (the text to draw), in diffusers' order: single quotes, curly
    double quotes, straight double quotes, corner brackets; [""] when there are none."""
    return [t for pattern in GLYPH_PATTERNS for t in re.findall(pattern, prompt)] or [""]


def has_cfg(params: DiffusionParams) -> bool:
    return params.guidance(DEFAULT_GUIDANCE) > 1.0


def check_text_params(prompt: str | None, params: DiffusionParams) -> None:
    if prompt is not None and not prompt.strip():
        raise ValueError("prompt: must be non-empty")
    if params.negative_prompt is not None or params.true_cfg_scale != 1.0:
        raise ValueError("negative_prompt / true_cfg_scale: GLM-Image's CFG always uses an "
                         "empty negative (set guidance_scale)")
    if params.strength is not None:
        raise ValueError("strength: a GLM-Image edit draws from noise under its condition "
                         "images; it has no strength")


class GlmGlyphEncoder:
    """ByT5 over the glyph texts: `GlmImagePipeline.encode_prompt`, batched over requests."""

    def __init__(self, text_encoder: T5Encoder, tokenizer, device: torch.device) -> None:
        self.text_encoder = text_encoder.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> GlmGlyphEncoder:
        """The pipeline folder's text_encoder/ (in `dtype`; None: its own) and tokenizer/."""
        path = Path(path)
        return cls(T5Encoder.from_pretrained(path / "text_encoder", device, dtype),
                   AutoTokenizer.from_pretrained(path / "tokenizer"), device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_text_params(prompt, params)

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (L, D), and negative_prompt_embeds (the "" glyphs)
        with CFG."""
        return encode_with_negatives(self.encode_texts, prompts, params, has_cfg)

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str]) -> list[Tensor]:
        """-> per prompt, its spans' real-token states one after another (L, D). Every span of
        every prompt in one encoder call, right-padded and masked. diffusers prepends one pad
        token to each span when a prompt has an even number of spans; kept."""
        spans, owners = [], []
        for i, prompt in enumerate(prompts):
            texts = glyph_texts(prompt)
            ids = self.tokenizer(texts, max_length=MAX_GLYPH_TOKENS, truncation=True).input_ids
            lead = [self.tokenizer.pad_token_id] * ((len(ids) + 1) % 2)
            spans += [lead + s for s in ids]
            owners += [i] * len(ids)
        longest = max(len(s) for s in spans)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([s + [pad] * (longest - len(s)) for s in spans])
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in spans])
        hidden = self.text_encoder(input_ids.to(self.device), mask.to(self.device))
        states = [h[m.bool().to(h.device)] for h, m in zip(hidden, mask)]   # (L_span, D)
        return [torch.cat([s for s, o in zip(states, owners) if o == i])
                for i in range(len(prompts))]


class GlmImagePipeline(LatentPipelineBase):
    """The DiT decode stage. Its prompt is encoded here (the glyphs) while the AR stage's
    visual tokens come along the input edge: `text_with_upstream` tells the stage to keep the
    request's prompt and still park the request until the tokens arrive."""

    label = "GLM-Image"
    transformer_cls = GlmImageTransformer2DModel
    vae_cls = AutoencoderKL
    prompt_encoder_cls = GlmGlyphEncoder
    max_size = MAX_SIZE
    packed = False
    text_with_upstream = True
    max_input_images = MAX_CONDITION_IMAGES
    check_text_params = staticmethod(check_text_params)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.multiple = TOKEN_FACTOR                    # the AR's token grid: 32 px a side
        self.size_rule = f"AR visual tokens of {TOKEN_FACTOR} px"
        vae = self.vae.cfg
        if vae.latents_mean is None or vae.latents_std is None:
            raise ValueError("GLM-Image's VAE config needs latents_mean and latents_std")
        self.latents_mean = torch.tensor(vae.latents_mean).view(1, -1, 1, 1)
        self.latents_std = torch.tensor(vae.latents_std).view(1, -1, 1, 1)

    # ---- 1. prepare --------------------------------------------------------------------------

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """The glyphs encoded and the latents drawn; the prior tokens come later
        (`check_conditioning`)."""
        if self.prompt_encoder is None:
            raise ValueError("this GLM-Image stage loads no glyph encoder")
        (encoded,) = self.prompt_encoder.encode([prompt], [params])
        latents, sigmas, cond = self.prepare_latents(params, generator, image)
        return latents, sigmas, {**{k: v.to(self.device, self.dtype) for k, v in
                                    encoded.items()}, **cond}

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> latents (n, C, H/8, W/8), sigmas, {"timesteps": the unshifted ones (N,),
        "size": (height, width)}."""
        height, width = self._size(params, image)
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        num_steps = params.num_inference_steps
        cfg = self.scheduler
        timesteps = np.linspace(cfg.num_train_timesteps, 1.0, num_steps + 1)[:-1]
        timesteps = timesteps.astype(np.int64).astype(np.float32)
        seq_len = (h * w) // self.transformer.cfg.patch_size ** 2
        mu = math.sqrt(seq_len / cfg.base_image_seq_len) * cfg.max_shift + cfg.base_shift
        sigmas, _ = solver.make_sigmas(cfg, num_steps, mu=mu,
                                       sigmas=timesteps / cfg.num_train_timesteps)
        latents = torch.randn((params.num_images, self.transformer.cfg.in_channels, h, w),
                              generator=generator, device=generator.device,
                              dtype=self.dtype).to(self.device)
        return latents, sigmas, {"timesteps": torch.from_numpy(timesteps),
                                 "size": torch.tensor([height, width])}

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """What the AR stage sends: its generated tokens {"token_ids": (T,)}, and for an edit
        its condition images' tokens ("condition_token_ids", "condition_grids") ->
        {"prior_token_ids": (1, N)}: the target grid's tokens upsampled 2x to the patches,
        and for an edit "image_kv" (`condition_kv`)."""
        images = input_images(params)
        expected = {TOKEN_IDS} | ({CONDITION_TOKEN_IDS, CONDITION_GRIDS} if images else set())
        if set(tensors) != expected:
            raise ValueError(f"conditioning: expected tensors {sorted(expected)} (the AR "
                             f"stage's visual tokens), got {sorted(tensors)}")
        (th, tw), (ph, pw) = target_grids(*self._size(params))
        start = 0 if images else ph * pw            # t2i writes its preview grid first
        what = (f"the {th}x{tw} image" if images
                else f"a {ph}x{pw} preview, then the {th}x{tw} image")
        grid = self._codes(tensors[TOKEN_IDS], start, th * tw, TOKEN_IDS, what)
        out = {"prior_token_ids": upsample_tokens(grid, th, tw).to(self.device)}
        if images:
            out["image_kv"] = self.condition_kv(images, tensors[CONDITION_TOKEN_IDS],
                                                tensors[CONDITION_GRIDS])
        return out

    def _codes(self, ids: Tensor, start: int, count: int, key: str, what: str) -> Tensor:
        """ids[start:start + count] checked: integer, long enough, inside the codebook."""
        codebook = self.transformer.cfg.prior_vq_quantizer_codebook_size
        if ids.dim() != 1 or ids.is_floating_point() or ids.shape[0] < start + count:
            raise ValueError(f"conditioning[{key!r}]: expected at least {start + count} "
                             f"integer tokens ({what}), got {ids.dtype} {tuple(ids.shape)}")
        grid = ids[start:start + count].long()
        if grid.numel() and (grid.min() < 0 or grid.max() >= codebook):
            raise ValueError(f"conditioning[{key!r}]: image tokens outside the codebook "
                             f"[0, {codebook})")
        return grid

    @torch.inference_mode()
    def condition_kv(self, images: list[Image.Image], token_ids: Tensor, grids: Tensor
                     ) -> Tensor:
        """An edit's condition images, with their AR tokens (sum of h*w,) and (h, w) token
        grids (K, 2) -> every block's keys and values over all their patches, image after
        image, as diffusers' KV cache holds them: (L, 2, M, H, hd)."""
        if grids.dim() != 2 or grids.shape != (len(images), 2):
            raise ValueError(f"conditioning['condition_grids']: expected ({len(images)}, 2) "
                             f"for {len(images)} condition images, got {tuple(grids.shape)}")
        sizes = [int(h) * int(w) for h, w in grids.tolist()]
        codes = self._codes(token_ids, 0, sum(sizes), CONDITION_TOKEN_IDS,
                            f"{len(images)} condition images' grids").split(sizes)
        multiple = self.vae_scale_factor * self.transformer.cfg.patch_size
        kvs = []
        for i, (image, ids, (h, w)) in enumerate(zip(images, codes, grids.tolist())):
            height = image.height - image.height % multiple
            width = image.width - image.width % multiple
            if (2 * h * multiple, 2 * w * multiple) != (height, width):
                raise ValueError(f"image {i}: its {h}x{w} AR tokens do not cover the "
                                 f"{height}x{width} px the DiT encodes of it")
            pixels = preprocess(image, height, width).to(self.device, self.vae_dtype)
            z = self.vae.encode(pixels)                                      # (1, C, h, w)
            z = (z - self.latents_mean.to(z)) / self.latents_std.to(z)
            size = torch.tensor([[height, width]], device=self.device, dtype=self.dtype)
            kvs.append(self.transformer.condition_kv(
                z.to(self.dtype), upsample_tokens(ids, h, w).to(self.device), size))
        return torch.cat(kvs, dim=2)

    # ---- 2. velocity -------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, C, h, w) -> (R, C, h, w), one size for all (the engine's batch key).

            rows:  | r0 img0 | r0 img1 | r1 img0 | ... |  r0 img0 | r0 img1 |  (r1: no CFG)
                   |<-- glyphs + prior, R rows ---->|  |<- "" + no prior -->|
                   |<-- + image_kv (edits) -------->|  |<- no image_kv ---->|
        """
        counts = [r.latents.shape[0] for r in requests]
        guided = GuidedRows.of(requests, lambda r: "negative_prompt_embeds" in r.cond,
                               lambda r: r.params.guidance(DEFAULT_GUIDANCE))
        idx = guided.idx.to(latents.device)

        def rows(key: str, reqs: list[DiffusionRequest]) -> list[Tensor]:
            return [r.cond[key] for r in reqs for _ in range(r.latents.shape[0])]

        uncond = [r for r, g in zip(requests, guided.guided) if g]
        captions = rows("prompt_embeds", requests) + rows("negative_prompt_embeds", uncond)
        prior = torch.cat(rows("prior_token_ids", requests) + rows("prior_token_ids", uncond))
        drop = torch.zeros_like(prior, dtype=torch.bool)
        drop[latents.shape[0]:] = True
        timestep = torch.cat([(r.cond["timesteps"][r.step_idx] - 1).expand(n)
                              for r, n in zip(requests, counts)]).to(self.device)
        size = torch.cat([r.cond["size"][None].expand(n, -1) for r, n in zip(requests, counts)])
        embeds, mask = pad_captions(captions)                                # (R+U, T, D)
        kv, kv_mask = image_kv_rows([r.cond.get("image_kv") for r in requests], counts,
                                    len(prior))
        out = self.transformer(torch.cat([latents, latents[idx]]), embeds, prior, drop,
                               torch.cat([timestep, timestep[idx]]),
                               torch.cat([size, size[idx.cpu()]]).to(self.device, self.dtype),
                               torch.zeros(len(prior), 2, device=self.device, dtype=self.dtype),
                               text_mask=mask, image_kv=kv, image_kv_mask=kv_mask
                               ).float()                                   # (R+U, C, h, w)
        return guided.mix(out[:latents.shape[0]], out[latents.shape[0]:])

    # ---- 3. decode ---------------------------------------------------------------------------

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """latents (n, C, h, w) -> float32 images (n, 3, H, W) in [0, 1], what diffusers
        returns for output_type="pt"."""
        z = latents.to(self.device, self.vae_dtype)
        z = z * self.latents_std.to(z) + self.latents_mean.to(z)
        images = self.vae.decode(z)                                          # (n, 3, H, W)
        return (images / 2 + 0.5).clamp(0, 1).float()


def upsample_tokens(grid: Tensor, h: int, w: int) -> Tensor:
    """An h x w grid of AR tokens (h*w,) -> (1, 4*h*w): each repeated 2x2, the DiT's patches
    (nearest upsampling, as diffusers' `_upsample_token_ids`)."""
    up = F.interpolate(grid.view(1, 1, h, w).float(), scale_factor=2, mode="nearest")
    return up.long().view(1, -1)


def image_kv_rows(kvs: list[Tensor | None], counts: list[int], num_rows: int
                  ) -> tuple[Tensor | None, Tensor | None]:
    """Each request's condition keys and values (L, 2, M_r, H, hd) or None, for its `counts`
    conditional rows (the first sum(counts) of `num_rows`; the rest, CFG's unconditional
    rows, attend to none) -> (L, 2, num_rows, max M, H, hd) and its (num_rows, max M) mask
    (None: every row has all of them); (None, None) without an edit. With one edit in the
    batch every row views its tensor (no copy: the rows without it are masked), else the
    rows are zero-padded copies."""
    given = [kv for kv in kvs if kv is not None]
    if not given:
        return None, None
    longest = max(kv.shape[2] for kv in given)
    L, _, _, H, hd = given[0].shape
    mask = torch.zeros(num_rows, longest, dtype=torch.bool, device=given[0].device)
    if len(given) == 1:
        out = given[0][:, :, None].expand(-1, -1, num_rows, -1, -1, -1)
    else:
        out = given[0].new_zeros(L, 2, num_rows, longest, H, hd)
    start = 0
    for kv, n in zip(kvs, counts):
        if kv is not None:
            if len(given) > 1:
                out[:, :, start:start + n, :kv.shape[2]] = kv[:, :, None]
            mask[start:start + n, :kv.shape[2]] = True
        start += n
    return out, None if bool(mask.all()) else mask
