"""The upstream side of `python -m omnistage.benchmarks.hunyuan_image3`, run in the reference's
own environment (transformers 4.56.2, diffusers 0.35.2; see hunyuan_image3.py for how that
interpreter is chosen) on a checkout of Tencent-Hunyuan/HunyuanImage-3.0. Standalone: it
imports nothing from omnistage, only scripts/hunyuan_image3_fixtures.py (the fixtures' CPU
patches, word-level tokenizer and upstream generation settings).

    python hunyuan_image3_reference.py DIR

DIR/job.json: {"upstream", "device", "config" (overrides of the fixtures' tiny CONFIG), "seed",
"prompt", "size", "steps", "guidance_scale", "flow_shift", "images", "image_seed"}. The script builds the upstream
HunyuanImage3ForCausalMM from `config` on `device` (bfloat16 on CUDA, float32 on the CPU),
draws every weight from `seed` (matrices scaled by 1/sqrt(fan in), 1-D weights near 1), saves
it as the checkpoint folder DIR/ckpt (our side loads that folder), then generates 1 + `images`
images one at a time (the first a warm-up), each timed whole (template, prefix, steps, VAE) with
the device synchronized, and the steps by the intervals between the scheduler's `step` calls
(each interval one forward with CFG and one Euler step). The warm-up's final latents and image
are kept for the comparison. Written: DIR/reference.json, DIR/reference.safetensors.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import hunyuan_image3_fixtures as fx  # noqa: E402


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def seeded_init(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            if not t.is_floating_point():
                continue
            x = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
            if t.dim() == 1:
                x = 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
            else:
                x = x / (t[0].numel() ** 0.5)
            t.copy_(x)


def build(job: dict, ckpt: Path, device: torch.device, dtype: torch.dtype):
    sys.path.insert(0, job["upstream"])
    from hunyuan_image_3 import image_processor as ip
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    from transformers import GenerationConfig

    def init_processor(self, config):     # no SigLIP2 fast processor (needs torchvision)
        self.config = config
        self.reso_group = ip.ResolutionGroup(base_size=config.image_base_size)
    ip.HunyuanImage3ImageProcessor.__init__ = init_processor

    tok = fx.build_tokenizer(ckpt)
    arch = dict(fx.CONFIG, **job["config"])
    size_token = f"<img_size_{arch['image_base_size']}>"
    if size_token not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [size_token]},
                               replace_additional_special_tokens=False)
        tok.save_pretrained(ckpt)
    cfg = dict(arch, vocab_size=max(len(tok), job["config"].get("vocab_size", 0)),
               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    config = HunyuanImage3Config(**cfg)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = HunyuanImage3ForCausalMM(config).eval()
    torch.set_default_dtype(previous)
    seeded_init(model, job["seed"], device)
    model.generation_config = GenerationConfig(**dict(
        fx.GENERATION, diff_infer_steps=job["steps"], diff_guidance_scale=job["guidance_scale"],
        flow_shift=job["flow_shift"]))
    model.save_pretrained(ckpt, safe_serialization=True)
    model.load_tokenizer(tok)
    return model


def generate(model, job: dict, seed: int, device: torch.device, record: dict) -> float:
    pipe = model.pipeline
    pipe.scheduler.register_to_config(shift=job["flow_shift"])
    t0 = sync(device)
    inputs = model.prepare_model_inputs(prompt=[job["prompt"]], mode="gen_image",
                                        image_size=tuple(job["size"]), seed=[seed],
                                        bot_task="image", system_prompt=None)
    with torch.no_grad():
        model._generate(**inputs, diff_infer_steps=job["steps"],
                        diff_guidance_scale=job["guidance_scale"])
    return sync(device) - t0


def run(root: Path) -> None:
    job = json.loads((root / "job.json").read_text())
    fx.patch_for_cpu()
    device = torch.device(job["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(job, root / "ckpt", device, dtype)
    pipe, record, stamps = model.pipeline, {}, []
    step, decode, latents = type(pipe.scheduler).step, model.vae.decode, type(pipe).prepare_latents

    def timed_step(self, *a, **k):
        stamps.append(sync(device))
        return step(self, *a, **k)

    def float_latents(self, *a, **k):     # drawn in bfloat16 as upstream; CUDA autocast's cast
        return latents(self, *a, **k).to(dtype)

    def keep_decode(z, *a, **k):
        out = decode(z, *a, **k)
        record.setdefault("latents", z.float().cpu())
        record.setdefault("image", out[0].float().cpu())
        return out

    pipe.scheduler.step = types.MethodType(timed_step, pipe.scheduler)
    pipe.prepare_latents = types.MethodType(float_latents, pipe)
    model.vae.decode = keep_decode
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, steps = [], []
    for i in range(1 + job["images"]):
        stamps.clear()
        seconds.append(generate(model, job, job["image_seed"] + i, device, record))
        steps.append([b - a for a, b in zip(stamps, stamps[1:])])
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in record.items()}, str(root / "reference.safetensors"))
    import transformers
    (root / "reference.json").write_text(json.dumps({
        "image_s": seconds, "step_s": steps, "dtype": str(dtype).removeprefix("torch."),
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    run(Path(sys.argv[1]))
