"""Tiny random HunyuanVideo-1.5 parts built with diffusers' own classes and saved with
`save_pretrained` (the Hub's layout): the transformer alone, and the whole t2v / i2v folders
(diffusers' HunyuanVideo15Pipeline / HunyuanVideo15ImageToVideoPipeline) whose text encoders
are tiny Qwen2.5-VL and T5 models; plus random conditioning in the shapes the encoders give.

    transformer  2 heads x 16 (rope axes 4 + 6 + 6), 2 blocks, 1 refiner block, 4 latent
                 channels (in: 4 + 4 + 1), Qwen width 24, byT5 width 20, SigLIP width 12
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from tests.helpers.diffusion_golden import randomize

LATENT = 4
TEXT_DIM, GLYPH_DIM, IMAGE_DIM = 24, 20, 12
NUM_IMAGE_TOKENS = 5


def tiny_transformer(task_type: str = "t2v", use_meanflow: bool = False,
                     text_dim: int = TEXT_DIM, glyph_dim: int = GLYPH_DIM):
    import diffusers

    model = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT + 1, out_channels=LATENT, num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0,
        patch_size=1, patch_size_t=1, text_embed_dim=text_dim, text_embed_2_dim=glyph_dim,
        image_embed_dim=IMAGE_DIM, rope_axes_dim=(4, 6, 6), target_size=64,
        task_type=task_type, use_meanflow=use_meanflow).eval()
    torch.manual_seed(0)
    randomize(model, std=0.2)
    with torch.no_grad():           # norm gains near 1, as trained ones are
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model


def save_transformer(path: Path, **kwargs) -> Path:
    tiny_transformer(**kwargs).save_pretrained(path)
    return path


def conditioning(batch: int, lengths: list[int], glyph_lengths: list[int], text_len: int = 9,
                 glyph_len: int = 7, seed: int = 1) -> dict[str, Tensor]:
    """Random Qwen and byT5 states with right-padded masks of the given valid lengths (a
    glyph length 0: no quoted text, the states zero as diffusers' encode_prompt gives)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, text_len, TEXT_DIM, generator=g)
    glyph = torch.randn(batch, glyph_len, GLYPH_DIM, generator=g)
    mask = (torch.arange(text_len)[None] < torch.tensor(lengths)[:, None]).float()
    glyph_mask = (torch.arange(glyph_len)[None] < torch.tensor(glyph_lengths)[:, None]).float()
    glyph = glyph * (torch.tensor(glyph_lengths) > 0).float()[:, None, None]
    return {"encoder_hidden_states": text, "encoder_attention_mask": mask,
            "encoder_hidden_states_2": glyph, "encoder_attention_mask_2": glyph_mask}


def build_tiny_t2v(path: Path, guidance_scale: float = 4.0, text: bool = False, **guider):
    """diffusers' HunyuanVideo15Pipeline of the tiny transformer and VAE (8x in space, 4x in
    time), flow-match Euler at shift 5, CFG at `guidance_scale` (`guider`: its other config),
    saved to `path`; -> the pipeline. text False: no text encoders (conditioning comes as
    embeddings); True: HV-B's tiny Qwen2.5-VL and byT5 (widths 32 and 24)."""
    import diffusers

    from tests.helpers.diffusion_golden import save_reference
    from tests.helpers.hunyuan_video15_parts import build_tiny_text_parts, build_tiny_vae

    parts = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
    widths = {}
    if text:
        parts = build_tiny_text_parts(path)
        widths = {"text_dim": 32, "glyph_dim": 24}
    pipe = diffusers.HunyuanVideo15Pipeline(
        transformer=tiny_transformer(**widths), vae=build_tiny_vae(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        guider=diffusers.ClassifierFreeGuidance(guidance_scale=guidance_scale, **guider),
        **parts)
    return save_reference(pipe, path)


class FakePromptEncoder:
    """Stands in for the Qwen2.5-VL + byT5 encoders: each text gets fixed random states (its
    valid tokens only, as our encoder keeps them; a text without a quote no glyph tokens);
    `padded` gives diffusers the same states padded, with masks."""

    device = torch.device("cpu")

    def states(self, text: str) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(sum(map(ord, text)) + len(text))
        n = 2 + len(text) % 7
        glyph = 3 if '"' in text else 0
        return torch.randn(n, TEXT_DIM, generator=g), torch.randn(glyph, GLYPH_DIM, generator=g)

    def validate(self, prompt: str, params) -> None:
        pass

    def encode(self, prompts: list[str], params: list) -> list[dict[str, Tensor]]:
        out = []
        for prompt, p in zip(prompts, params):
            text, glyph = self.states(prompt)
            cond = {"prompt_embeds": text, "prompt_embeds_2": glyph}
            if p.guidance_scale is None or p.guidance_scale != 1.0:
                neg, neg_glyph = self.states(p.negative_prompt or "")
                cond |= {"negative_prompt_embeds": neg, "negative_prompt_embeds_2": neg_glyph}
            out.append(cond)
        return out

    def padded(self, text: str, prefix: str = "") -> dict[str, Tensor]:
        """diffusers' keyword arguments for `text` (prefix "negative_" for the negative one):
        Qwen states padded to 9 tokens, byT5 to 7, with their masks."""
        states, glyph = self.states(text)
        out = {}
        for key, s, length in (("prompt_embeds", states, 9), ("prompt_embeds_2", glyph, 7)):
            full = torch.zeros(1, length, s.shape[-1])
            full[0, :s.shape[0]] = s
            mask = (torch.arange(length) < s.shape[0]).long()[None]
            suffix = "_2" if key.endswith("_2") else ""
            out[prefix + key] = full
            out[f"{prefix}prompt_embeds_mask{suffix}"] = mask
        return out


# ---- several CPU ranks (tests/system/diffusion/test_parallel_hunyuan_video15.py) ------------

RANK_CASES = [
    {"id": "a", "prompt": 'a sign that says "open"', "steps": 3, "seed": 1},
    {"id": "b", "prompt": "a red car", "steps": 5, "seed": 2, "negative_prompt": "blur",
     "cache_threshold": 0.5},                      # skips a step per branch
    {"id": "c", "prompt": "waves", "steps": 3, "seed": 3, "cfg": 1.0},
]


def ranks_forward(ranks, folder: str) -> list[float]:
    """One forward of the tiny transformer on these ranks (2 rows at different timesteps, a
    2 x 3 x 5 grid: 30 video tokens, context of two lengths, i2v image tokens) -> flat."""
    from omnistage.models.hunyuan_video15_transformer import HunyuanVideo15Transformer3DModel

    model = HunyuanVideo15Transformer3DModel.from_pretrained(folder, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    kw = conditioning(2, lengths=[9, 4], glyph_lengths=[3, 0])
    with torch.inference_mode():
        out = model(torch.randn(2, 2 * LATENT + 1, 2, 3, 5, generator=g),
                    torch.tensor([900.0, 250.0]),
                    image_embeds=torch.randn(2, NUM_IMAGE_TOKENS, IMAGE_DIM, generator=g), **kw)
    return out.flatten().tolist()


def ranks_run(ranks, folder: str, cases: list[dict]) -> dict:
    """RANK_CASES (fake-encoded prompts, 5 frames of 40x56) through the engine to the end on
    these ranks: rank 0 serves, the others follow (omnistage.testing.diffusion_ranks)."""
    from omnistage.diffusion.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline
    from omnistage.diffusion_params import DiffusionParams
    from omnistage.testing.diffusion_ranks import _serve

    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, "hunyuan_video15",
                                                  torch.device("cpu"), torch.float32,
                                                  text_encoders=False)
    pipe.prompt_encoder = FakePromptEncoder()
    pipe.graphs = None          # what _serve reports replays of: no CUDA graphs here

    def submit(engine) -> None:
        for case in cases:
            engine.add_request(case["id"], case["prompt"], DiffusionParams(
                height=40, width=56, num_frames=5, num_inference_steps=case["steps"],
                seed=case["seed"], guidance_scale=case.get("cfg"),
                negative_prompt=case.get("negative_prompt"),
                cache_threshold=case.get("cache_threshold")))

    return _serve(ranks, pipe, submit)


def build_tiny_i2v(path: Path, use_meanflow: bool = False, text: bool = False):
    """diffusers' HunyuanVideo15ImageToVideoPipeline: the tiny i2v transformer (MeanFlow if
    asked), VAE and a tiny SigLIP (width 12, 32x32 pixels in 8x8 patches: 16 image tokens),
    saved to `path`; -> the pipeline. text: as build_tiny_t2v's."""
    import diffusers
    import transformers

    from tests.helpers.diffusion_golden import save_reference
    from tests.helpers.hunyuan_video15_parts import build_tiny_text_parts, build_tiny_vae

    parts = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
    widths = {}
    if text:
        parts = build_tiny_text_parts(path)
        widths = {"text_dim": 32, "glyph_dim": 24}
    torch.manual_seed(0)
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8)).eval()
    pipe = diffusers.HunyuanVideo15ImageToVideoPipeline(
        **parts, transformer=tiny_transformer("i2v", use_meanflow, **widths), vae=build_tiny_vae(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0),
        guider=diffusers.ClassifierFreeGuidance(guidance_scale=4.0), image_encoder=siglip,
        feature_extractor=transformers.SiglipImageProcessor(size={"height": 32, "width": 32}))
    return save_reference(pipe, path)
