"""A BAGEL request, step by step: its interleaved inputs into KV contexts, greedy text, and
image generation by flow matching with two guidance branches.

Three contexts are built side by side, as the upstream inferencer builds them:

    main       every input (an image as VAE latents then ViT tokens, when an image is asked for)
    cfg_text   main as it stood before the last text segment (guidance against the prompt)
    cfg_img    the text segments alone (guidance against the input images)

Each flow step runs the noisy latent tokens after each context (not stored) and mixes the
velocities: v_text = v_cfg_text + s_text (v - v_cfg_text), then v_cfg_img + s_img (v_text -
v_cfg_img), renormalised to |v| (global, per channel, or the text branch alone: text_channel).
The guidance applies while cfg_interval[0] < t <= cfg_interval[1]; outside it one branch runs.

Think mode (the upstream's `think=True` for an image answer): GEN_THINK_SYSTEM_PROMPT is the
first text segment (main and cfg_img; cfg_text is then main with it alone), the model answers
greedily after the prompt, and that answer, as text (`thought_text`: decoded, cut at the end
token, as the upstream's gen_text returns it) and encoded again, is one more text segment of
main only (`add_thought`) before the image is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from omnistage.models.bagel.llm import KVContext
from omnistage.models.bagel.model import Bagel

RENORM_TYPES = ("global", "channel", "text_channel")
BOS_TEXT, EOS_TEXT = "<|im_start|>", "<|im_end|>"
# the upstream inferencer's GEN_THINK_SYSTEM_PROMPT (056b5fd), character for character
GEN_THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the "
    "image. \nThe planning process is enclosed within <think> </think> tags, i.e. <think> "
    "planning process here </think> image here")
# ... and its VLM_THINK_SYSTEM_PROMPT: a text answer with its reasoning first
VLM_THINK_SYSTEM_PROMPT = (
    "You should first think about the reasoning process in the mind and then provide the "
    "user with the answer. \nThe reasoning process is enclosed within <think> </think> "
    "tags, i.e. <think> reasoning process here </think> answer here")


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    bos: int            # <|im_start|>: opens every text segment and starts generation
    eos: int            # <|im_end|>: closes every text segment and ends generation
    soi: int            # <|vision_start|>
    eoi: int            # <|vision_end|>


@dataclass(frozen=True, slots=True)
class FlowOptions:
    num_timesteps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.5
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: str = "global"

    def __post_init__(self) -> None:
        if self.num_timesteps < 2:
            raise ValueError(f"num_timesteps {self.num_timesteps}: at least 2")
        if self.cfg_renorm_type not in RENORM_TYPES:
            raise ValueError(f"cfg_renorm_type {self.cfg_renorm_type!r}: one of {RENORM_TYPES}")


@dataclass(slots=True)
class Contexts:
    main: KVContext
    cfg_text: KVContext
    cfg_img: KVContext


# token ids (without bos/eos), or an image: pixels (3, H, W) in [-1, 1], or a pair (as the VAE
# sees it, as the ViT sees it) when the two are resized apart
Segment = list[int] | Tensor | tuple[Tensor, Tensor]


def to_pixels(image_uint8: Tensor) -> Tensor:
    """(H, W, 3) uint8 -> (3, H, W) float in [-1, 1], as ToTensor + Normalize(0.5, 0.5)."""
    return (image_uint8.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5


@torch.no_grad()
def build_contexts(model: Bagel, vae: torch.nn.Module, segments: Sequence[Segment],
                   tokens: SpecialTokens, with_vae: bool,
                   generator: torch.Generator | None = None) -> Contexts:
    """The three contexts after `segments`. with_vae: images also enter as VAE latents (an
    image is to be generated); the posterior draw uses `generator` first."""
    main = model.new_context()
    cfg_text, cfg_img = main.copy(), main.copy()
    for seg in segments:
        if isinstance(seg, (Tensor, tuple)):
            vae_px, vit_px = seg if isinstance(seg, tuple) else (seg, seg)
            dtype = model.vae2llm.weight.dtype
            if with_vae:
                raw = vae.sample_latents(vae_px[None].to(dtype), generator)
                model.add_vae_latents(main, vae.normalize(raw)[0], tokens.soi, tokens.eoi)
            model.add_vit_image(main, vit_px.to(dtype), tokens.soi, tokens.eoi)
            cfg_text = main.copy()
        else:
            cfg_text = main.copy()
            ids = [tokens.bos, *seg, tokens.eos]
            model.add_tokens(main, ids)
            model.add_tokens(cfg_img, ids)
    return Contexts(main, cfg_text, cfg_img)


@torch.no_grad()
def greedy_text(model: Bagel, ctx: KVContext, tokens: SpecialTokens, max_new_tokens: int
                ) -> list[int]:
    """Greedy answer after ctx (left as it was): bos is fed first; eos ends it (not returned)."""
    ctx = ctx.copy()
    out: list[int] = []
    cur = tokens.bos
    for _ in range(max_new_tokens):
        hidden = model.add_tokens(ctx, [cur])
        cur = int(model.logits(hidden[-1]).argmax())
        if cur == tokens.eos:
            break
        out.append(cur)
    return out


def timesteps(opts: FlowOptions, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """(t_i for each step, dt_i): linspace(1, 0) shifted by s t / (1 + (s - 1) t)."""
    t = torch.linspace(1, 0, opts.num_timesteps, device=device)
    t = opts.timestep_shift * t / (1 + (opts.timestep_shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


@torch.no_grad()
def denoise(model: Bagel, ctxs: Contexts, hw: tuple[int, int], noise: Tensor,
            opts: FlowOptions, tokens: SpecialTokens) -> Tensor:
    """Latent tokens (h*w, p*p*C) from `noise` of the same shape by Euler steps."""
    x = noise
    ts, dts = timesteps(opts, noise.device)
    for i, t in enumerate(ts):
        inside = opts.cfg_interval[0] < t <= opts.cfg_interval[1]
        s_text = opts.cfg_text_scale if inside else 1.0
        s_img = opts.cfg_img_scale if inside else 1.0
        v = model.step_rows(ctxs.main, x, hw, t, tokens.soi, tokens.eoi, store=False)
        v_text = (model.step_rows(ctxs.cfg_text, x, hw, t, tokens.soi, tokens.eoi, store=False)
                  if s_text > 1.0 else None)
        v_img = (model.step_rows(ctxs.cfg_img, x, hw, t, tokens.soi, tokens.eoi, store=False)
                 if s_img > 1.0 else None)
        if v_text is not None:
            v = guide(v, v_text, v_img, s_text, s_img, opts)
        x = x - v.to(x.dtype) * dts[i]
    return x


def guide(v: Tensor, v_text: Tensor, v_img: Tensor | None, s_text: float, s_img: float,
          opts: FlowOptions) -> Tensor:
    """The guided velocity from the three branches (v_img None: no image guidance)."""
    mixed = v_text + s_text * (v - v_text)
    if opts.cfg_renorm_type == "text_channel":
        scale = (v.norm(dim=-1, keepdim=True) / (mixed.norm(dim=-1, keepdim=True) + 1e-8))
        mixed = mixed * scale.clamp(min=opts.cfg_renorm_min, max=1.0)
        return mixed if v_img is None else v_img + s_img * (mixed - v_img)
    if v_img is not None:
        mixed = v_img + s_img * (mixed - v_img)
    if opts.cfg_renorm_type == "global":
        scale = v.norm() / (mixed.norm() + 1e-8)
    else:
        scale = v.norm(dim=-1, keepdim=True) / (mixed.norm(dim=-1, keepdim=True) + 1e-8)
    return mixed * scale.clamp(min=opts.cfg_renorm_min, max=1.0)


@torch.no_grad()
def initial_noise(model: Bagel, hw: tuple[int, int], generator: torch.Generator | None,
                  device: torch.device | str = "cpu") -> Tensor:
    """(h*w, p*p*C) standard normal, drawn on the generator's device (CPU: the upstream's)."""
    n = hw[0] * hw[1]
    gen_device = generator.device if generator is not None else device
    x = torch.randn((n, model.cfg.patch_latent_dim), generator=generator, device=gen_device)
    return x.to(device)


@torch.no_grad()
def decode_image(model: Bagel, vae: torch.nn.Module, latent_tokens: Tensor,
                 hw: tuple[int, int]) -> Tensor:
    """Latent tokens -> (H, W, 3) uint8 (values truncated, as the upstream's `to(uint8)`)."""
    latents = model.unpack_latents(latent_tokens, hw)[None]
    image = vae.decode(vae.denormalize(latents.to(model.vae2llm.weight.dtype)))
    image = (image.float() * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 0) * 255
    return image.to(torch.uint8)


def latent_grid(model: Bagel, height: int, width: int) -> tuple[int, int]:
    """The latent token grid of an image; sides must be multiples of latent_downsample."""
    d = model.cfg.latent_downsample
    for name, side in (("height", height), ("width", width)):
        if side % d or side <= 0:
            raise ValueError(f"{name} {side}: a positive multiple of {d}")
    if max(height, width) // d > model.cfg.max_latent_size:
        raise ValueError(f"size {width}x{height}: at most {model.cfg.max_latent_size * d} a side")
    return height // d, width // d


def thought_text(tokenizer, answer_ids: Sequence[int], tokens: SpecialTokens) -> str:
    """The upstream gen_text's string from a greedy answer's ids (the start token not among
    them): the start token and the answer decoded, then the text between the first start
    token and the first end token after it."""
    text = tokenizer.decode([tokens.bos, *answer_ids])
    return text.split(EOS_TEXT)[0].split(BOS_TEXT)[1]


@torch.no_grad()
def add_thought(model: Bagel, main: KVContext, thought_ids: list[int],
                tokens: SpecialTokens) -> None:
    """Think mode: the answer's text, encoded again, enters the main context alone."""
    model.add_tokens(main, [tokens.bos, *thought_ids, tokens.eos])
