"""Regenerate tests/fixtures/bagel/ from the upstream BAGEL code (ByteDance-Seed/Bagel).

    python scripts/bagel_fixtures.py /path/to/Bagel-checkout [--out tests/fixtures/bagel]
                                     [--ckpt-dir DIR]

Runs in the reference's own environment (not .venv): python3 -m venv; pip install
torch==2.13.0 transformers==4.49.0 einops==0.8.1 safetensors==0.4.5 numpy==1.24.4 pillow
accelerate. Pinned upstream commit: UPSTREAM_COMMIT below (the script refuses another one
unless --any-commit).

What it does:
1. builds a TINY random BAGEL with the upstream classes (Qwen2ForCausalLM with
   Qwen2MoTDecoderLayer layers, SiglipVisionModel with its linear patch embedding, Bagel, the
   FLUX-style AutoEncoder), every tensor drawn from one seed in sorted-name order by
   `seeded_value` (tests/helpers/bagel.py draws the same), and saves it in the checkpoint
   folder's layout (llm_config.json, vit_config.json, config.json, ema.safetensors,
   ae.safetensors) to --ckpt-dir (a temp folder by default; never committed);
2. runs the upstream `InterleaveInferencer` on (a) a text question and (a2) an image plus a
   question (greedy tokens), (a3) a text question in think mode
   (VLM_THINK_SYSTEM_PROMPT; greedy tokens), (b) text-to-image with a few flow steps (initial noise, final
   latents, the decoded image), (c) an edit of an input image (VAE posterior draw, noise,
   final latents, image) and (d) text-to-image in think mode (`think=True`: the greedy
   planning tokens, then noise, final latents, image);
3. writes manifest.json (configs, seed, tensor names and shapes, checksums, case settings) and
   expected.safetensors (the tensors above) to --out.

Patches made at import time, because the reference needs a GPU as written:
- `flash_attn.flash_attn_varlen_func` (not installable here) is replaced by an SDPA
  equivalent: per packed sequence, GQA heads expanded, `causal` aligned bottom-right as
  flash-attn aligns it when queries are fewer than keys;
- the reference casts q/k/v (and the MoT 'gen' branch) to bfloat16 by hand; in
  qwen2_navit and siglip_navit `torch.bfloat16` is mapped to float32 so the whole reference
  runs in float32 (the golden tests compare in float32);
- the tokenizer is a byte-level stand-in (ids 0-255 bytes, 256-259 the four special tokens the
  upstream adds); prompts enter as ids, so the fixtures need no tokenizer files;
- image transforms are the upstream ImageTransform's ToTensor + Normalize(0.5, 0.5) on input
  images already of a size its resize keeps (sides divisible by the stride), so torchvision and
  cv2 are not needed.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

UPSTREAM_COMMIT = "056b5fd51a88c1eb4547318609e25d40080fcf87"
SEED = 1234
SPECIAL = {"bos_token_id": 256, "eos_token_id": 257, "start_of_image": 258, "end_of_image": 259}
SPECIAL_TEXT = {256: "<|im_start|>", 257: "<|im_end|>", 258: "<|vision_start|>",
                259: "<|vision_end|>"}

LLM_CONFIG = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, qk_norm=True, layer_module="Qwen2MoTDecoderLayer",
                  architectures=["Qwen2ForCausalLM"], model_type="qwen2")
VIT_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,   # 1 used (-= 1)
                  num_attention_heads=2, num_channels=3, image_size=32, patch_size=4,
                  hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, model_type="siglip_vision_model")
BAGEL_CONFIG = dict(model_type="bagel", architectures=["BagelForConditionalGeneration"],
                    visual_gen=True, visual_und=True, latent_patch_size=2,
                    max_latent_size=8, vit_max_num_patch_per_side=8,
                    connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=1.0)
VAE_PARAMS = dict(resolution=32, in_channels=3, downsample=2, ch=32, out_ch=3, ch_mult=[1, 2],
                  num_res_blocks=1, z_channels=4, scale_factor=0.3611, shift_factor=0.1159)

CASES = {
    "text": dict(prompt="What is BAGEL?", max_think_token_n=10),
    "vlm": dict(prompt="Describe it.", max_think_token_n=8, image_hw=[24, 32]),
    # a text answer in think mode: VLM_THINK_SYSTEM_PROMPT, the prompt, the greedy answer
    "vlm_think": dict(prompt="Why blue?", think=True, max_think_token_n=12),
    "t2i": dict(prompt="a red cube", image_hw=[20, 28], num_timesteps=5, timestep_shift=1.5,
                cfg_text_scale=4.0, cfg_img_scale=1.0, cfg_interval=[0.4, 1.0],
                cfg_renorm_min=0.0, cfg_renorm_type="global", seed=7),
    "edit": dict(prompt="make it blue", image_hw=[24, 32], num_timesteps=4, timestep_shift=1.0,
                 cfg_text_scale=3.0, cfg_img_scale=1.5, cfg_interval=[0.0, 1.0],
                 cfg_renorm_min=0.0, cfg_renorm_type="text_channel", seed=11),
    # think mode (interleave_inference(think=True)): GEN_THINK_SYSTEM_PROMPT, the prompt, the
    # greedy planning text (max_think_token_n counts the start token), then the image
    "think": dict(prompt="a blue ball", image_hw=[16, 24], think=True, max_think_token_n=9,
                  num_timesteps=4, timestep_shift=2.0, cfg_text_scale=3.5, cfg_img_scale=1.0,
                  cfg_interval=[0.3, 1.0], cfg_renorm_min=0.0, cfg_renorm_type="global",
                  seed=5),
}


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor of the tiny checkpoint (tests/helpers/bagel.py has the same rule): norms'
    1-D weights near 1, biases small, matrices scaled by 1/sqrt(fan_in)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
    fan_in = int(np.prod(shape[1:]))
    return x / fan_in ** 0.5


def seeded_state(names_shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: seeded_value(n, s, gen) for n, s in sorted(names_shapes)}


def flash_attn_varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, **_):
    """flash_attn_varlen_func on SDPA: q (Tq, H, D), k/v (Tk, Hkv, D) packed by cu_seqlens."""
    out = []
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1)          # (H, lq, D)
        ks = k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].repeat_interleave(rep, 1).transpose(0, 1)
        mask = None
        if causal:   # bottom-right: query j sees keys up to lk - lq + j
            lq, lk = qs.shape[1], ks.shape[1]
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    return torch.cat(out, 0)


class _Float32Torch(types.ModuleType):
    """`torch` for the reference modules, with bfloat16 meaning float32."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


def import_upstream(src: Path) -> types.SimpleNamespace:
    import transformers.modeling_utils  # noqa: F401  (it probes flash_attn: before the stand-in)
    fa = types.ModuleType("flash_attn")
    fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)   # found, no metadata
    fa.flash_attn_varlen_func = flash_attn_varlen_sdpa
    sys.modules["flash_attn"] = fa
    sys.path.insert(0, str(src))
    from modeling.autoencoder import AutoEncoder, AutoEncoderParams
    from modeling.bagel import (Bagel, BagelConfig, Qwen2Config, Qwen2ForCausalLM,
                                SiglipVisionConfig, SiglipVisionModel)
    from modeling.bagel import qwen2_navit, siglip_navit
    import inferencer
    qwen2_navit.torch = _Float32Torch()
    siglip_navit.torch = _Float32Torch()
    return types.SimpleNamespace(
        AutoEncoder=AutoEncoder, AutoEncoderParams=AutoEncoderParams, Bagel=Bagel,
        BagelConfig=BagelConfig, Qwen2Config=Qwen2Config, Qwen2ForCausalLM=Qwen2ForCausalLM,
        SiglipVisionConfig=SiglipVisionConfig, SiglipVisionModel=SiglipVisionModel,
        inferencer=inferencer)


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return "".join(SPECIAL_TEXT.get(int(i), chr(int(i))) for i in ids)


class ImageTransform:
    """The upstream ImageTransform's ToTensor + Normalize(0.5, 0.5) for images of a valid size."""

    def __init__(self, stride: int) -> None:
        self.stride = stride

    def resize_transform(self, image):
        w, h = image.size
        assert h % self.stride == 0 and w % self.stride == 0, (h, w, self.stride)
        return image

    def __call__(self, image) -> torch.Tensor:
        x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
        return (x.permute(2, 0, 1) - 0.5) / 0.5


def build(up: types.SimpleNamespace):
    llm_config = up.Qwen2Config(**LLM_CONFIG)
    vit_config = up.SiglipVisionConfig(**VIT_CONFIG)
    vit_config.rope = False                      # as the upstream app.py / inference notebook
    vit_config.num_hidden_layers -= 1
    vae = up.AutoEncoder(up.AutoEncoderParams(**VAE_PARAMS))
    config = up.BagelConfig(llm_config=llm_config, vit_config=vit_config,
                            vae_config=up.AutoEncoderParams(**VAE_PARAMS),
                            **{k: v for k, v in BAGEL_CONFIG.items() if k not in ("model_type", "architectures")})
    model = up.Bagel(up.Qwen2ForCausalLM(llm_config), up.SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    ema = seeded_state([(n, tuple(t.shape)) for n, t in model.state_dict().items()], SEED)
    ae = seeded_state([(n, tuple(t.shape)) for n, t in vae.state_dict().items()], SEED + 1)
    model.load_state_dict(ema, strict=True)
    vae.load_state_dict(ae, strict=True)
    return model.eval(), vae.eval(), ema, ae


def save_checkpoint(folder: Path, ema: dict, ae: dict) -> None:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "llm_config.json").write_text(json.dumps(LLM_CONFIG, indent=1))
    (folder / "vit_config.json").write_text(json.dumps(VIT_CONFIG, indent=1))
    (folder / "config.json").write_text(json.dumps(BAGEL_CONFIG, indent=1))
    save_file({k: v.contiguous() for k, v in ema.items()}, str(folder / "ema.safetensors"))
    save_file({k: v.contiguous() for k, v in ae.items()}, str(folder / "ae.safetensors"))


def test_image(h: int, w: int):
    from PIL import Image
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([(xx * 255) // max(w - 1, 1), (yy * 255) // max(h - 1, 1),
                    ((xx + yy) * 37) % 256], -1).astype(np.uint8)
    return Image.fromarray(rgb)


def run_cases(up, model, vae) -> dict[str, torch.Tensor]:
    tok = ByteTokenizer()
    inf = up.inferencer.InterleaveInferencer(model, vae, tok, ImageTransform(
        model.latent_downsample), ImageTransform(model.vit_patch_size), dict(SPECIAL))
    seen: dict[str, list] = {"text": [], "noise": [], "latent": [], "vae": []}
    gen_text, gen_image = model.generate_text, model.generate_image
    model.generate_text = lambda **kw: _keep(seen["text"], gen_text(**kw))
    model.generate_image = lambda **kw: (seen["noise"].append(kw["packed_init_noises"].clone()),
                                         _keep(seen["latent"], gen_image(**kw)))[1]
    encode = vae.encode
    vae.encode = lambda x: _keep(seen["vae"], encode(x))
    out: dict[str, torch.Tensor] = {}
    c = CASES["text"]
    inf.interleave_inference([c["prompt"]], understanding_output=True, do_sample=False,
                             max_think_token_n=c["max_think_token_n"])
    out["text.tokens"] = seen["text"].pop()[:, 0].clone()
    c = CASES["vlm"]
    img = test_image(*c["image_hw"])
    out["vlm.image"] = torch.from_numpy(np.asarray(img).copy())
    inf.interleave_inference([img, c["prompt"]], understanding_output=True, do_sample=False,
                             max_think_token_n=c["max_think_token_n"])
    out["vlm.tokens"] = seen["text"].pop()[:, 0].clone()
    c = CASES["vlm_think"]
    inf.interleave_inference([c["prompt"]], understanding_output=True, think=True,
                             do_sample=False, max_think_token_n=c["max_think_token_n"])
    out["vlm_think.tokens"] = seen["text"].pop()[:, 0].clone()
    for name in ("t2i", "edit", "think"):
        c = CASES[name]
        kw = {k: c[k] for k in ("num_timesteps", "timestep_shift", "cfg_text_scale",
                                "cfg_img_scale", "cfg_interval", "cfg_renorm_min",
                                "cfg_renorm_type")}
        inputs: list = [c["prompt"]]
        if name == "edit":
            img = test_image(*c["image_hw"])
            out["edit.input_image"] = torch.from_numpy(np.asarray(img).copy())
            inputs = [img, c["prompt"]]
        if name == "think":
            kw.update(think=True, max_think_token_n=c["max_think_token_n"], do_sample=False)
        torch.manual_seed(c["seed"])
        res = inf.interleave_inference(inputs, image_shapes=tuple(c["image_hw"]), **kw)
        if name == "think":
            out["think.tokens"] = seen["text"].pop()[:, 0].clone()   # the start token first
        out[f"{name}.noise"] = seen["noise"].pop()
        out[f"{name}.latents"] = seen["latent"].pop()[0].clone()
        out[f"{name}.image"] = torch.from_numpy(np.asarray(res[-1]).copy())
        if name == "edit":
            out["edit.vae_latent"] = seen["vae"].pop()
    return out


def _keep(bucket: list, value):
    bucket.append(value)
    return value


def _abs_sum(state: dict) -> float:
    return sum(float(v.double().abs().sum()) for _, v in sorted(state.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("upstream", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "tests/fixtures/bagel")
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--any-commit", action="store_true")
    args = ap.parse_args()
    commit = _commit(args.upstream)
    if commit != UPSTREAM_COMMIT and not args.any_commit:
        sys.exit(f"upstream at {commit}, the fixtures pin {UPSTREAM_COMMIT} (--any-commit)")
    torch.set_grad_enabled(False)
    up = import_upstream(args.upstream.resolve())
    model, vae, ema, ae = build(up)
    save_checkpoint(args.ckpt_dir or Path(tempfile.mkdtemp()) / "BAGEL-tiny", ema, ae)
    out = run_cases(up, model, vae)
    from safetensors.torch import save_file
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(args.out / "expected.safetensors"))
    manifest = dict(upstream="ByteDance-Seed/Bagel", commit=commit, seed=SEED,
                    special_tokens=SPECIAL, llm_config=LLM_CONFIG, vit_config=VIT_CONFIG,
                    bagel_config=BAGEL_CONFIG, vae_params=VAE_PARAMS, cases=CASES,
                    ema={k: list(v.shape) for k, v in sorted(ema.items())},
                    ae={k: list(v.shape) for k, v in sorted(ae.items())},
                    ema_abs_sum=_abs_sum(ema), ae_abs_sum=_abs_sum(ae),
                    magnitudes={k: float(v.float().abs().mean()) for k, v in out.items()})
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (args.out / "README.md").write_text(
        f"Expected outputs of the upstream BAGEL code (ByteDance-Seed/Bagel at {commit}) on a "
        f"tiny random checkpoint rebuilt from seed {SEED}; regenerate with "
        "`scripts/bagel_fixtures.py` (its docstring says how and what it patches).\n")
    for k, v in out.items():
        print(k, tuple(v.shape), v.dtype, float(v.float().abs().mean()))


def _commit(src: Path) -> str:
    return subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main()
