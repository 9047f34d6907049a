"""Regenerate tests/fixtures/hunyuan_video15_sr/ from the upstream HunyuanVideo-1.5 code
(its super-resolution pass, which diffusers does not ship).

    python scripts/hunyuan_video15_sr_fixtures.py /path/to/HunyuanVideo-1.5-checkout
                                                  [--out tests/fixtures/hunyuan_video15_sr]

Upstream: github.com/Tencent-Hunyuan/HunyuanVideo-1.5 at UPSTREAM_COMMIT (the script refuses
another commit unless --any-commit). Runs in the reference's own environment, not .venv:
python3 -m venv; pip install torch==2.13.0 diffusers==0.35.0 transformers==4.57.1
einops==0.8.0 loguru==0.7.3 numpy==1.26.4 pillow==11.3.0 safetensors psutil (the versions its
requirements.txt pins; torchvision is not installed, see below).

What it does:
1. builds TINY random upstream networks of the released SR layout: the SR DiT
   (`HunyuanVideo_1_5_DiffusionTransformer`, in_channels 98 = [noisy z | z cond + mask | LQ z +
   mask], concat_condition false, 2 dual-stream blocks, hidden 64, the byT5 mapper, the linear
   vision projection, the condition-type embedding) and both latent upsamplers
   (`SRTo720pUpsampler`, `SRTo1080pUpsampler`); every tensor drawn from one seed in
   sorted-name order by `seeded_value` (tests/helpers/hunyuan_video15_sr.py draws the same);
   the manifest keeps configs, names and shapes, so the tests rebuild the checkpoints;
2. the upsamplers on one random latent clip;
3. the upstream SR pipeline (`HunyuanVideo_1_5_SR_Pipeline.__call__`, output_type "latent")
   for three cases: text-to-video 480p -> 720p with the 720p upsampler (4 steps, shift 2, 2
   latent frames) and 720p -> 1080p with the 1080p upsampler (3 steps, shift 3, 1 frame);
   image-to-video 480p -> 720p (sr720_i2v: `reference_image` a random 30 x 23 RGB image, so
   task "i2v": its latents on frame 0 + mask as the condition, its vision tokens beside the
   text, mask_type "i2v");
4. writes manifest.json and expected.safetensors (inputs, noises, upsampled LQ latents, final
   latents; for i2v also the image, the pixels upstream feeds its VAE (uint8), the image
   latents and vision tokens, and in the manifest the vision encoder's input size and sha256)
   to --out.

Patches (none changes the math of what is compared):
- the resolution tiers (`SizeMap`: 480p 640, 720p 960, 1080p 1440 px) are shrunk to 64 / 96 /
  128 px so the latents stay a few tokens: the bucket rule and the 1.5x / 1.33x ratios are
  the same code, and the manifest records the sizes used;
- the text encoders are not built: `encode_prompt` and `_prepare_byt5_embeddings` return the
  fixture's random Qwen / byT5 states and masks (the tests feed the same states);
- the LQ noise (`add_noise_to_lq`, an unseeded `torch.randn_like`) and the initial latents are
  recorded (the tests feed them);
- the pipeline's target dtype is float32 (the upstream draws bfloat16 latents for a CUDA
  autocast) and attention is its "torch" mode; the VAE and text encoder are stand-ins that only
  carry the config values the latent path reads (no decode: output_type "latent");
- torchvision (its transforms serve image-to-video only) is a stand-in module
  (`standin_transforms`: Resize, CenterCrop, ToTensor, Normalize as torchvision's PIL path
  computes them; the PyPI torchvision wheel for torch 2.13.0 fails to load against the CPU
  torch build: "operator torchvision::nms does not exist"), and the parallel state is one
  process without sequence parallelism (the default builds a CUDA mesh);
- image-to-video's VAE encode and vision encoder are seeded stand-ins at a seam: they record
  their inputs (the transformed first frame at the high-resolution size; the image cropped
  to the real 720p bucket of its aspect, as upstream's `target_size_config` is not shrunk)
  and return seeded latents (1, 32, 1, h, w) and vision tokens (1, 5, 40), which the tests
  feed to our pass.

Regenerate (reference venv as above, upstream checked out at UPSTREAM_COMMIT):
    /tmp/hv15env/bin/python scripts/hunyuan_video15_sr_fixtures.py /tmp/hv15
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

UPSTREAM_COMMIT = "60783e704160023913bee78f0b47036d393d4dfa"
SEED = 2024
SIZES = {"480p": 64, "720p": 96, "1080p": 128}
TEXT_DIM, BYT5_DIM, VISION_DIM = 48, 1472, 40
DIT = dict(patch_size=[1, 1, 1], in_channels=98, concat_condition=False, out_channels=32,
           hidden_size=64, heads_num=2, mlp_width_ratio=4, mlp_act_type="gelu_tanh",
           mm_double_blocks_depth=2, mm_single_blocks_depth=0, rope_dim_list=[8, 12, 12],
           qkv_bias=True, qk_norm=True, qk_norm_type="rms", guidance_embed=False,
           use_meanflow=False, text_projection="single_refiner", use_attention_mask=True,
           text_states_dim=TEXT_DIM, text_states_dim_2=768, text_pool_type=None, rope_theta=256,
           attn_mode="torch", glyph_byT5_v2=True, vision_projection="linear",
           vision_states_dim=VISION_DIM, is_reshape_temporal_channels=False,
           use_cond_type_embedding=True, ideal_task=None)
UP720 = dict(in_channels=32, out_channels=32, hidden_channels=16, num_blocks=2,
             global_residual=True)
UP1080 = dict(z_channels=32, out_channels=32, block_out_channels=[64, 48], num_res_blocks=1,
              is_residual=True)
CASES = {
    "sr720": dict(version="720p_sr_distilled", base_resolution="480p", lr_bucket=2,
                  video_length=5, steps=4, flow_shift=2.0, seed=7),
    "sr1080": dict(version="1080p_sr_distilled", base_resolution="720p", lr_bucket=9,
                   video_length=1, steps=3, flow_shift=3.0, seed=3),
    # image-to-video: the reference image's latents on frame 0 (+ mask), its vision tokens
    "sr720_i2v": dict(version="720p_sr_distilled", base_resolution="480p", lr_bucket=5,
                      video_length=5, steps=4, flow_shift=2.0, seed=11, image_size=[30, 23],
                      vision_tokens=5),
}
TEXT_MASK, BYT5_MASK = [1, 1, 1, 1, 1, 0], [1, 1, 1, 0]


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor of a tiny checkpoint (tests/helpers/hunyuan_video15_sr.py has the same rule):
    1-D weights near 1, biases small, matrices scaled by 1/sqrt(fan_in)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith(("weight", "gamma")) else 0.05 * x
    fan_in = int(np.prod(shape[1:]))
    return x / fan_in ** 0.5


def seeded_state(names_shapes, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: seeded_value(n, tuple(s), gen) for n, s in sorted(names_shapes)}


def patch_for_cpu() -> None:
    # transformers' and diffusers' torchvision checks run before the stand-in exists
    import transformers  # noqa: F401
    import transformers.image_processing_utils_fast  # noqa: F401
    import diffusers.models.modeling_utils  # noqa: F401
    tv = types.ModuleType("torchvision")
    tv.transforms = standin_transforms()
    sys.modules.setdefault("torchvision", tv)
    sys.modules.setdefault("torchvision.transforms", tv.transforms)
    # one process, no sequence parallelism: the upstream's default state builds a CUDA mesh
    from hyvideo.commons import parallel_states
    parallel_states.__dict__["__parallel_dims"] = types.SimpleNamespace(
        sp=1, sp_enabled=False, sp_rank=0, sp_group=None)


def standin_transforms() -> types.ModuleType:
    """What `get_image_condition_latents` (image-to-video) calls of torchvision.transforms, on
    a PIL image, as torchvision's PIL path computes it: Resize((h, w), LANCZOS) is PIL's
    resize, CenterCrop((h, w)) cuts at int(round((H - h) / 2)), int(round((W - w) / 2)),
    ToTensor is (C, H, W) / 255, Normalize([0.5], [0.5]) is (x - 0.5) / 0.5."""
    from PIL import Image
    t = types.ModuleType("torchvision.transforms")
    t.InterpolationMode = types.SimpleNamespace(LANCZOS=Image.Resampling.LANCZOS)

    def resize(size, interpolation):
        return lambda img: img.resize((size[1], size[0]), resample=interpolation)

    def center_crop(size):
        def crop(img):
            top, left = (int(round((n - c) / 2.0)) for n, c in zip(img.size[::-1], size))
            assert top >= 0 and left >= 0, "the image covers the crop after Resize"
            return img.crop((left, top, left + size[1], top + size[0]))
        return crop

    def compose(steps):
        def run(x):
            for step in steps:
                x = step(x)
            return x
        return run

    t.Compose, t.Resize, t.CenterCrop = compose, resize, center_crop
    t.ToTensor = lambda: lambda img: torch.from_numpy(
        np.array(img.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
    t.Normalize = lambda mean, std: lambda x: (x - mean[0]) / std[0]
    return t


def seeded(model, seed: int) -> list:
    names_shapes = [(n, list(t.shape)) for n, t in model.state_dict().items()]
    model.load_state_dict(seeded_state(names_shapes, seed), strict=True)
    return sorted(names_shapes)


def build_networks(ckpt: Path) -> dict:
    from hyvideo.models.transformers.hunyuanvideo_1_5_transformer import (
        HunyuanVideo_1_5_DiffusionTransformer)
    from hyvideo.models.transformers.modules.upsample import SRTo720pUpsampler, SRTo1080pUpsampler
    nets = {}
    for version, resolution in (("720p_sr_distilled", "720p"), ("1080p_sr_distilled", "1080p")):
        dit = HunyuanVideo_1_5_DiffusionTransformer(**DIT, ideal_resolution=resolution).eval()
        names = seeded(dit, SEED)
        dit.save_pretrained(ckpt / "transformer" / version, safe_serialization=True)
        nets[f"transformer/{version}"] = (dit, names)
    for version, cls, cfg, seed in (("720p_sr_distilled", SRTo720pUpsampler, UP720, SEED + 1),
                                    ("1080p_sr_distilled", SRTo1080pUpsampler, UP1080, SEED + 2)):
        up = cls(**cfg).eval()
        names = seeded(up, seed)
        up.save_pretrained(ckpt / "upsampler" / version, safe_serialization=True)
        nets[f"upsampler/{version}"] = (up, names)
    return nets


def text_inputs() -> dict:
    gen = torch.Generator().manual_seed(SEED + 10)
    return {"prompt_embeds": torch.randn(1, len(TEXT_MASK), TEXT_DIM, generator=gen),
            "prompt_mask": torch.tensor([TEXT_MASK]),
            "byt5_states": torch.randn(1, len(BYT5_MASK), BYT5_DIM, generator=gen),
            "byt5_mask": torch.tensor([BYT5_MASK])}


class StandInVAE:
    """What the SR pipeline's latent path reads of its VAE (the config values)."""
    config = types.SimpleNamespace(block_out_channels=[8] * 5, ffactor_spatial=16,
                                   ffactor_temporal=4, scaling_factor=1.0)


class StandInTextEncoder:
    max_length = len(TEXT_MASK)


def make_pipeline(dit, upsampler, case: dict, text: dict):
    from hyvideo.pipelines import hunyuan_video_sr_pipeline as sr
    from hyvideo.schedulers.scheduling_flow_match_discrete import FlowMatchDiscreteScheduler
    vae, encoder = StandInVAE(), StandInTextEncoder()
    pipe = sr.HunyuanVideo_1_5_SR_Pipeline(
        vae=vae, text_encoder=encoder, transformer=dit,
        scheduler=FlowMatchDiscreteScheduler(shift=case["flow_shift"]), upsampler=upsampler,
        flow_shift=case["flow_shift"], guidance_scale=1.0, num_inference_steps=case["steps"],
        base_resolution=case["base_resolution"], vision_num_semantic_tokens=4,
        vision_states_dim=VISION_DIM, glyph_byT5_v2=True, execution_device="cpu")
    pipe.target_dtype = torch.float32
    pipe.autocast_enabled = False
    pipe.encode_prompt = lambda *a, **k: (text["prompt_embeds"], None, text["prompt_mask"], None)
    pipe._prepare_byt5_embeddings = lambda *a, **k: {
        "byt5_text_states": text["byt5_states"], "byt5_text_mask": text["byt5_mask"]}
    return pipe


def reference_image(case: dict):
    """A random RGB image (width, height = case["image_size"]) from the case's seed."""
    from PIL import Image
    gen = torch.Generator().manual_seed(case["seed"] + 100)
    w, h = case["image_size"]
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen,
                                         dtype=torch.uint8).numpy())


def install_i2v(pipe, case: dict, record: dict, info: dict):
    """The image-to-video seams: the VAE's encode and the vision encoder (stand-ins) record
    what upstream feeds them (the transformed pixels; the cropped image's size and sha256 in
    info) and return seeded latents / vision tokens, which are recorded. -> the image."""
    image = reference_image(case)
    record["image"] = torch.from_numpy(np.array(image))                    # uint8 (h, w, 3)
    gen = torch.Generator().manual_seed(case["seed"] + 200)

    def encode(pixels):                         # (1, 3, 1, H, W) in [-1, 1]
        u8 = ((pixels + 1) * 127.5).round()
        assert torch.equal(u8 / 127.5 - 1, pixels), "pixels are uint8 values in [-1, 1]"
        record["image_pixels"] = u8.to(torch.uint8)
        b, _, f, h, w = pixels.shape
        lat = torch.randn(b, 32, f, h // 16, w // 16, generator=gen)
        record["image_latents"] = lat.clone()   # the stand-in's scaling_factor is 1
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: lat))

    def encode_images(array):                   # (H, W, 3) uint8, cropped to a 720p bucket
        info["vision_input_size"] = list(array.shape)
        info["vision_input_sha256"] = hashlib.sha256(np.ascontiguousarray(array)).hexdigest()
        states = torch.randn(1, case["vision_tokens"], VISION_DIM, generator=gen)
        record["vision_states"] = states.clone()
        return types.SimpleNamespace(last_hidden_state=states)

    pipe.vae.encode = encode
    pipe.vision_encoder = types.SimpleNamespace(encode_images=encode_images)
    return image


def run_case(nets: dict, case: dict, text: dict) -> tuple[dict, dict]:
    from hyvideo.pipelines import hunyuan_video_sr_pipeline as sr
    from hyvideo.utils.data_utils import generate_crop_size_list
    sr.SizeMap.update(SIZES)
    dit = nets[f"transformer/{case['version']}"][0]
    upsampler = nets[f"upsampler/{case['version']}"][0]
    pipe = make_pipeline(dit, upsampler, case, text)
    lr_w, lr_h = generate_crop_size_list(SIZES[case["base_resolution"]], 16)[case["lr_bucket"]]
    frames = (case["video_length"] - 1) // 4 + 1
    gen = torch.Generator().manual_seed(case["seed"])
    lq = torch.randn(1, 32, frames, lr_h // 16, lr_w // 16, generator=gen)
    record = {"lq_latents": lq.clone()}
    info = dict(case)
    image = install_i2v(pipe, case, record, info) if "image_size" in case else None
    orig_prepare, orig_up = type(pipe).prepare_latents, upsampler.forward

    def prepare_latents(self, *a, **k):
        record["latents"] = orig_prepare(self, *a, **k).clone()
        return record["latents"]

    def upsample(x):
        record["upsampler_input"] = x.clone()
        record["upsampled"] = orig_up(x).clone()
        return record["upsampled"]

    def randn_like(x, *a, **k):        # add_noise_to_lq's draw, seeded here and recorded
        record["lq_noise"] = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        return record["lq_noise"].clone()

    pipe.prepare_latents = types.MethodType(prepare_latents, pipe)
    upsampler.forward = upsample
    real_randn_like, torch.randn_like = torch.randn_like, randn_like
    try:
        with torch.no_grad():
            out = pipe(prompt="a cat", video_length=case["video_length"], seed=case["seed"],
                       lq_latents=lq, reference_image=image, output_type="latent").videos
    finally:
        torch.randn_like, upsampler.forward = real_randn_like, orig_up
    record["final_latents"] = out.clone()
    info.update(lr_size=[lr_h, lr_w], hr_size=[out.shape[-2] * 16, out.shape[-1] * 16],
                sizes={k: SIZES[k] for k in SIZES})
    return info, {k: v.contiguous() if v.dtype == torch.uint8 else v.float().contiguous()
                  for k, v in record.items()}


def run_upsamplers(nets: dict) -> dict:
    gen = torch.Generator().manual_seed(SEED + 20)
    x = torch.randn(1, 32, 3, 4, 6, generator=gen)
    out = {"upsampler.input": x}
    with torch.no_grad():
        for version in ("720p_sr_distilled", "1080p_sr_distilled"):
            out[f"upsampler.{version}"] = nets[f"upsampler/{version}"][0](x).contiguous()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("upstream", type=Path)
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/hunyuan_video15_sr"))
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--any-commit", action="store_true")
    args = ap.parse_args()
    commit = subprocess.check_output(["git", "-C", str(args.upstream), "rev-parse", "HEAD"],
                                     text=True).strip()
    if commit != UPSTREAM_COMMIT and not args.any_commit:
        sys.exit(f"upstream at {commit}, expected {UPSTREAM_COMMIT} (--any-commit to override)")
    sys.path.insert(0, str(args.upstream))
    patch_for_cpu()
    ckpt = args.ckpt_dir or Path(tempfile.mkdtemp(prefix="hv15-sr-tiny-"))
    nets = build_networks(ckpt)
    from safetensors.torch import save_file
    text = text_inputs()
    expected = {f"text.{k}": v.float().contiguous() for k, v in text.items()}
    expected.update(run_upsamplers(nets))
    cases = {}
    for name, case in CASES.items():
        info, tensors = run_case(nets, case, text)
        cases[name] = info
        expected.update({f"{name}.{k}": v for k, v in tensors.items()})
        print(name, {k: (tuple(v.shape), round(float(v.float().abs().mean()), 4))
                     for k, v in tensors.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(expected, str(args.out / "expected.safetensors"))
    checkpoints = {}
    for folder, (_, names) in nets.items():
        config = json.loads((ckpt / folder / "config.json").read_text())
        checkpoints[folder] = dict(config=config, tensors=names)
    seeds = {"transformer/720p_sr_distilled": SEED, "transformer/1080p_sr_distilled": SEED,
             "upsampler/720p_sr_distilled": SEED + 1, "upsampler/1080p_sr_distilled": SEED + 2}
    manifest = dict(upstream="Tencent-Hunyuan/HunyuanVideo-1.5", commit=commit, seeds=seeds,
                    checkpoints=checkpoints, cases=cases)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print("wrote", args.out, "checkpoints in", ckpt)


if __name__ == "__main__":
    main()
