"""The upstream side of omnistage/benchmarks/bagel.py, run by the reference's own interpreter
(transformers 4.49 as the upstream pins it; see bagel.py for how that interpreter is chosen) on
a checkout of ByteDance-Seed/Bagel. Standalone: it imports nothing from omnistage, only
scripts/bagel_fixtures.py (the fixtures' import patches, byte tokenizer and tiny build).

    <reference python> bagel_reference.py ROOT   # reads ROOT/job.json; writes ROOT/ckpt,
                                                 # ROOT/reference.json, ROOT/reference.safetensors

Two shapes of job:
- "tiny": the fixtures' model exactly as scripts/bagel_fixtures.py builds it (float32 on the
  CPU: the upstream's bfloat16 casts mapped to float32, flash-attn replaced by its SDPA
  equivalent), saved as the fixtures save it;
- otherwise the configs in the job (llm_config, vit_config, bagel_config, vae_params: the
  released BAGEL-7B-MoT's, with fewer LLM layers if asked), built as the upstream app builds
  them (vit rope off, its last layer dropped, the patch conv as a linear), directly on
  `device`: the model in `dtype` (bfloat16, as the app loads it; float32 with the fixtures'
  mapping of the upstream's casts, to check agreement), the VAE in float32 (the app's
  load_ae); every weight drawn on the device from `seed` (the VAE's from seed + 1) by the
  fixtures' rule (1-D weights near 1, biases small, matrices N(0, 1/fan_in)), in sorted-name
  order; saved as the released folder lays it out (ema.safetensors in bfloat16,
  ae.safetensors in float32). The upstream's own bfloat16 casts stay; flash-attn's varlen
  call, which the machine lacks, becomes one SDPA call per packed sequence (flash kernel,
  grouped KV heads, causal aligned bottom-right as flash-attn aligns it). The model and the
  VAE sit on `device`; the index tensors the upstream's `prepare_*` methods build on the CPU
  are moved there, as the upstream's eval scripts do (eval/gen/gen_images_mp.py), while the
  flow loop's latents stay on the CPU, where the app keeps them (its accelerate hooks move
  them into the model at every step: here hooks on the two modules they enter). The app
  leaves the VAE on the CPU; here it decodes on `device`, so a CPU decode is not counted
  against the reference.

Then 1 + `images` text-to-image calls of InterleaveInferencer one at a time (the first a
warm-up), each timed whole (contexts, guided flow steps, VAE decode) with the device
synchronized; a step is the interval between `_forward_flow` calls. Kept: the warm-up's final
latent tokens and image.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _fixtures(script: str):
    spec = importlib.util.spec_from_file_location("bagel_fixtures", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                causal=False, **_):
    """flash_attn_varlen_func on SDPA: q (Tq, H, D), k/v (Tk, Hkv, D) packed by cu_seqlens;
    `causal` aligned bottom-right (query j sees keys up to lk - lq + j), as flash-attn's."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)[None]                # (1, H, lq, D)
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1)[None]                # (1, Hkv, lk, D)
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        lq, lk = qs.shape[2], ks.shape[2]
        mask = None
        if causal and lq != lk:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                           is_causal=causal and lq == lk,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out.append(o[0].transpose(0, 1))
    return out[0] if len(out) == 1 else torch.cat(out, 0)


def patch_upstream(dtype: torch.dtype) -> None:
    """The SDPA varlen call above in flash-attn's place; in bfloat16 the fixtures' float32
    mapping undone (the upstream's own bfloat16 casts stay), in float32 (a check of the two
    sides' agreement, not a measurement) kept."""
    for name in ("modeling.bagel.qwen2_navit", "modeling.bagel.siglip_navit"):
        mod = sys.modules[name]
        if dtype == torch.bfloat16:
            mod.torch = torch
        mod.flash_attn_varlen_func = varlen_sdpa


@torch.no_grad()
def seeded_init(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    """The fixtures' `seeded_value` rule, drawn on the device, in sorted-name order."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in sorted(module.state_dict().items()):
        if not t.is_floating_point():
            continue
        x = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
        if t.dim() == 1:
            x = 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
        else:
            x = x / int(np.prod(t.shape[1:])) ** 0.5
        t.copy_(x)


def build(up, job: dict, device: torch.device, dtype: torch.dtype):
    """(model, vae) at the job's configs on `device` (module docstring)."""
    llm_config = up.Qwen2Config(**job["llm_config"])
    vit_config = up.SiglipVisionConfig(**job["vit_config"])
    vit_config.rope = False                      # as the upstream app.py / inference notebook
    vit_config.num_hidden_layers -= 1
    extra = {k: v for k, v in job["bagel_config"].items()
             if k not in ("model_type", "architectures")}
    previous = torch.get_default_dtype()
    try:
        with torch.device(device):
            vae = up.AutoEncoder(up.AutoEncoderParams(**job["vae_params"]))
            torch.set_default_dtype(dtype)
            config = up.BagelConfig(llm_config=llm_config, vit_config=vit_config,
                                    vae_config=up.AutoEncoderParams(**job["vae_params"]),
                                    **extra)
            model = up.Bagel(up.Qwen2ForCausalLM(llm_config),
                             up.SiglipVisionModel(vit_config), config)
            model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    finally:
        torch.set_default_dtype(previous)
    seeded_init(model, job["seed"], device)
    seeded_init(vae, job["seed"] + 1, device)
    return model.eval(), vae.eval()


def save_folder(folder: Path, job: dict, model, vae) -> None:
    """The released checkpoint's layout: configs, ema.safetensors, ae.safetensors."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    for name, key in (("llm_config.json", "llm_config"), ("vit_config.json", "vit_config"),
                      ("config.json", "bagel_config")):
        (folder / name).write_text(json.dumps(job[key], indent=1))
    for file, module in (("ema.safetensors", model), ("ae.safetensors", vae)):
        state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(folder / file))
        del state


PREPARES = ("prepare_prompts", "prepare_vae_latent", "prepare_vae_latent_cfg",
            "prepare_start_tokens", "prepare_vit_images", "prepare_vae_images")


def on_device(model, vae, device: torch.device):
    """Model and VAE on `device` (module docstring). The `prepare_*` outputs (a dict of
    tensors, alone or first of a tuple) are moved there, but for the initial noise: the flow
    loop keeps its latents where the noise is, and the app's latents stay on the CPU (its
    hooks move them into the model each step; here hooks on the two modules they enter, and
    the VAE's input)."""
    def moved(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            first = {k: v.to(device) if torch.is_tensor(v) and k != "packed_init_noises"
                     else v for k, v in first.items()}
            return (first, *out[1:]) if isinstance(out, tuple) else first
        return wrapper

    def args_to_device(module, args):
        return tuple(a.to(device) if torch.is_tensor(a) else a for a in args)

    for name in PREPARES:
        setattr(model, name, moved(getattr(model, name)))
    model.time_embedder.register_forward_pre_hook(args_to_device)
    model.vae2llm.register_forward_pre_hook(args_to_device)
    decode = vae.decode
    vae.decode = lambda z: decode(z.to(device))
    return model.to(device).eval(), vae.to(device).eval()


def prepare(job: dict, root: Path, fx):
    """(model, vae, device, dtype, setup seconds): built, saved to root/ckpt, placed."""
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    up = fx.import_upstream(Path(job["upstream"]).resolve())
    if job["shape"] == "tiny":
        model, vae, ema, ae = fx.build(up)
        fx.save_checkpoint(root / "ckpt", ema, ae)
        return model, vae, torch.device("cpu"), torch.float32, time.perf_counter() - t0
    device, dtype = torch.device(job["device"]), getattr(torch, job["dtype"])
    patch_upstream(dtype)
    model, vae = build(up, job, device, dtype)
    sync(device)
    t1 = time.perf_counter()
    save_folder(root / "ckpt", job, model, vae)
    print(f"reference: built in {t1 - t0:.1f} s, saved in {time.perf_counter() - t1:.1f} s",
          file=sys.stderr, flush=True)
    model, vae = on_device(model, vae, device)
    return model, vae, device, dtype, time.perf_counter() - t0


def generate(inf, model, job: dict, device: torch.device, kept: dict) -> tuple[list, list]:
    """1 + images timed calls: seconds per image, step intervals per image."""
    stamps: list[float] = []
    flow, gen_image = model._forward_flow, model.generate_image

    def timed_flow(*args, **kwargs):
        stamps.append(sync(device))
        return flow(*args, **kwargs)

    def keep_latents(**kwargs):
        out = gen_image(**kwargs)
        kept.setdefault("latents", out[0].float().cpu())
        return out

    model._forward_flow, model.generate_image = timed_flow, keep_latents
    # the inferencer runs under CUDA's bfloat16 autocast; on a CPU (a check of the code path,
    # not a measurement) the CPU's autocast stands in for it; float32 needs none
    cpu_autocast = device.type == "cpu" and job["dtype"] == "bfloat16"
    image_s, step_s = [], []
    for i in range(1 + job["images"]):
        stamps.clear()
        torch.manual_seed(job["seed"] + i)
        t0 = sync(device)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_autocast):
            out = inf.interleave_inference(
                [job["prompt"]], image_shapes=tuple(job["size"]),
                num_timesteps=job["steps"] + 1, timestep_shift=job["timestep_shift"],
                cfg_text_scale=job["guidance_scale"], cfg_img_scale=1.0,
                cfg_interval=job["cfg_interval"], cfg_renorm_min=0.0,
                cfg_renorm_type="global")
        image_s.append(sync(device) - t0)
        step_s.append([b - a for a, b in zip(stamps, stamps[1:])])
        kept.setdefault("image", torch.from_numpy(np.asarray(out[-1]).copy()))
    return image_s, step_s


def main(root: Path) -> None:
    job = json.loads((root / "job.json").read_text())
    fx = _fixtures(job["fixtures_script"])
    model, vae, device, dtype, setup_s = prepare(job, root, fx)
    inf = sys.modules["inferencer"].InterleaveInferencer(
        model, vae, fx.ByteTokenizer(), fx.ImageTransform(model.latent_downsample),
        fx.ImageTransform(model.vit_patch_size), dict(fx.SPECIAL))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    kept: dict[str, torch.Tensor] = {}
    image_s, step_s = generate(inf, model, job, device, kept)
    from safetensors.torch import save_file
    save_file(kept, str(root / "reference.safetensors"))
    import transformers
    commit = Path(job["upstream"], "COMMIT")
    (root / "reference.json").write_text(json.dumps({
        "image_s": image_s, "step_s": step_s, "setup_s": setup_s,
        "dtype": str(dtype).removeprefix("torch."), "device": str(device),
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "transformers_path": transformers.__file__},
        "upstream_commit": commit.read_text().strip() if commit.is_file() else None}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
