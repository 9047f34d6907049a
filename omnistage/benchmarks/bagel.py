"""BAGEL text-to-image, ours against the upstream code (ByteDance-Seed/Bagel, in its own
environment) on the same random weights, in the same run: seconds per image (contexts, guided
flow steps, VAE decode) and per denoising step, and the memory each takes.

    1. bagel_reference.py (the reference's interpreter) builds the upstream model at the
       chosen shape, draws its weights from a seed, saves the checkpoint folder, and times
       1 + `images` InterleaveInferencer calls one at a time (the first a warm-up); a step is
       the interval between its `_forward_flow` calls;
    2. ours loads that folder (Bagel.from_pretrained, our loader) and runs the same requests
       through the diffusion engine (BagelPipeline), one at a time, timed the same way; a step
       is one engine step past the first (which also builds the contexts) and before the last
       (which decodes).

Shapes (`--shape`):
- `7b` (default): BAGEL-7B-MoT's: the Qwen2-7B MoT LLM (hidden 3584, 28 heads / 4 KV heads of
  128, MLP 18944, vocab 152064, every layer's understanding expert duplicated as the generation
  expert), `--layers` of its 28 layers (default all 28: 14.6B parameters with the ViT; with 4,
  3.4B); SigLIP so400m (1152 wide, 26 of its 27 layers used, patch 14, 70 x 70 positions); the
  FLUX VAE (128 channels x [1, 2, 4, 4], 16 latent channels); 1024 x 1024 (the upstream
  inferencer's and app's default size: 4,096 latent tokens); bfloat16 (the upstream app's
  dtype), on the GPU;
- `small`: the same structure at a small width (LLM 224 wide with 28 / 4 heads of 8, the real
  vocabulary; ViT 64 wide; VAE 32 channels), 256 x 256, bfloat16: the 7b run's code path on a
  CPU, to check a GPU run before it is made;
- `tiny` (`--tiny`): the test fixtures' model (scripts/bagel_fixtures.py: 2 layers, hidden 64,
  32 x 32, float32), the reference on the CPU.

The reference's interpreter: $OMNISTAGE_BAGEL_REF_PYTHON, else /work/ref-bagel/venv/bin/python,
else this one; with $OMNISTAGE_BAGEL_REF_PYTHONPATH put first on its PYTHONPATH (a
`pip install --target` folder holding transformers 4.49 and what it needs, shadowing this
interpreter's transformers for the reference alone: benchmarks/bagel_device.sh). Its checkout:
`--upstream` (the pinned commit's source tree; default /work/ref-bagel/Bagel).

    python -m omnistage.benchmarks.bagel [--shape 7b|small|tiny] [--layers N] [--size S]
        [--steps N] [--images N] [--device D] [--upstream DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from omnistage.benchmarks.common import environment, free_device_memory, median, now, ratio
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.bagel import BagelOptions, BagelPipeline
from omnistage.models.bagel.model import Bagel
from omnistage.utils.device import resolve_device

REFERENCE_SCRIPT = Path(__file__).with_name("bagel_reference.py")
FIXTURES_SCRIPT = Path(__file__).parents[2] / "scripts" / "bagel_fixtures.py"
REFERENCE_PYTHON = Path("/work/ref-bagel/venv/bin/python")
UPSTREAM = Path("/work/ref-bagel/Bagel")
REFERENCE_TIMEOUT_S = 3600
PROMPT = "a red cube on a blue table"
# the fixtures' special token ids (scripts/bagel_fixtures.py's byte tokenizer)
SPECIAL = {"<|im_start|>": 256, "<|im_end|>": 257, "<|vision_start|>": 258,
           "<|vision_end|>": 259}
_LLM = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=False, qk_norm=True,
            layer_module="Qwen2MoTDecoderLayer", architectures=["Qwen2ForCausalLM"],
            model_type="qwen2", vocab_size=152064, num_attention_heads=28,
            num_key_value_heads=4)
_VIT = dict(num_channels=3, image_size=980, patch_size=14, hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=1e-6, model_type="siglip_vision_model")
_BAGEL = dict(model_type="bagel", architectures=["BagelForConditionalGeneration"],
              visual_gen=True, visual_und=True, latent_patch_size=2, max_latent_size=64,
              vit_max_num_patch_per_side=70, connector_act="gelu_pytorch_tanh",
              interpolate_pos=False, timestep_shift=1.0)
_VAE = dict(resolution=256, in_channels=3, downsample=8, out_ch=3, ch_mult=[1, 2, 4, 4],
            z_channels=16, scale_factor=0.3611, shift_factor=0.1159)
# the released checkpoint's configs (llm_config.json, vit_config.json; the app's Bagel fields;
# modeling/autoencoder.py load_ae's VAE), and the same structure at a small width
SHAPES = {
    "7b": dict(size=1024, llm_config=dict(_LLM, hidden_size=3584, intermediate_size=18944,
                                          num_hidden_layers=28),
               vit_config=dict(_VIT, hidden_size=1152, intermediate_size=4304,
                               num_hidden_layers=27, num_attention_heads=16),
               bagel_config=_BAGEL, vae_params=dict(_VAE, ch=128, num_res_blocks=2)),
    "small": dict(size=256, llm_config=dict(_LLM, hidden_size=224, intermediate_size=512,
                                            num_hidden_layers=2),
                  vit_config=dict(_VIT, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, num_attention_heads=4),
                  bagel_config=_BAGEL, vae_params=dict(_VAE, ch=32, num_res_blocks=1)),
}


class ByteTokens:
    """The fixtures' tokenizer: byte b is id b, the four special tokens at 256.."""
    unk_token_id = None

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL[token]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


@dataclass(frozen=True)
class BagelBenchConfig:
    shape: str = "7b"
    layers: int | None = None       # LLM layers (None: the shape's own)
    size: int | None = None         # square image side (None: the shape's)
    steps: int = 10
    images: int = 2
    guidance_scale: float = 4.0
    timestep_shift: float = 3.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    seed: int = 0
    device: str = "auto"
    upstream: str = str(UPSTREAM)
    float32: bool = False           # 7b / small in float32: the two sides' agreement

    @property
    def tiny(self) -> bool:
        return self.shape == "tiny"

    def side(self) -> int:
        return self.size or (32 if self.tiny else SHAPES[self.shape]["size"])

    def configs(self) -> dict:
        """The job's llm / vit / bagel / vae configs ({} for tiny: the fixtures' own)."""
        if self.tiny:
            return {}
        shape = SHAPES[self.shape]
        llm = dict(shape["llm_config"])
        llm["num_hidden_layers"] = self.layers or llm["num_hidden_layers"]
        return {"llm_config": llm, "vit_config": shape["vit_config"],
                "bagel_config": shape["bagel_config"], "vae_params": shape["vae_params"]}

    def dtype(self) -> torch.dtype:
        return torch.float32 if self.tiny or self.float32 else torch.bfloat16


def reference_interpreter() -> tuple[str, dict[str, str]]:
    """The reference's python and environment (module docstring)."""
    env = dict(os.environ)
    site = env.get("OMNISTAGE_BAGEL_REF_PYTHONPATH")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    return reference_python(), env


def reference_python() -> str:
    return os.environ.get("OMNISTAGE_BAGEL_REF_PYTHON") or (
        str(REFERENCE_PYTHON) if REFERENCE_PYTHON.is_file() else sys.executable)


def run_reference(root: Path, cfg: BagelBenchConfig, device: torch.device) -> dict:
    """The upstream side (module docstring, 1.): its raw timings; the folder is root/ckpt,
    the warm-up's latent tokens and image root/reference.safetensors."""
    side = cfg.side()
    (root / "job.json").write_text(json.dumps({
        "shape": cfg.shape, "device": str(device), "upstream": cfg.upstream,
        "dtype": str(cfg.dtype()).removeprefix("torch."),
        "fixtures_script": str(FIXTURES_SCRIPT), "prompt": PROMPT, "size": [side, side],
        "steps": cfg.steps, "images": cfg.images, "seed": cfg.seed,
        "guidance_scale": cfg.guidance_scale, "timestep_shift": cfg.timestep_shift,
        "cfg_interval": list(cfg.cfg_interval), **cfg.configs()}))
    python, env = reference_interpreter()
    done = subprocess.run([python, str(REFERENCE_SCRIPT), str(root)], capture_output=True,
                          text=True, timeout=REFERENCE_TIMEOUT_S, check=False, env=env)
    sys.stderr.write("".join(line + "\n" for line in done.stderr.splitlines()
                             if line.startswith("reference:")))
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"the BAGEL reference ({python}) failed (exit {done.returncode}): "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    return json.loads((root / "reference.json").read_text())


def run_ours(folder: Path, cfg: BagelBenchConfig, device: torch.device
             ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Ours (module docstring, 2.): timings, and the warm-up's latent tokens and image. The
    modules are built on the device (their init runs there; the folder's weights replace it)."""
    with torch.device(device):
        model, vae = Bagel.from_pretrained(folder, device, cfg.dtype())
    pipe = BagelPipeline(model, vae, ByteTokens(), device)
    pipe.configure(BagelOptions(cfg_img_scale=1.0, cfg_interval=cfg.cfg_interval,
                                timestep_shift=cfg.timestep_shift))
    engine, kept, decode = DiffusionEngine(pipe), {}, pipe.decode

    def keep(x: torch.Tensor, params: DiffusionParams) -> torch.Tensor:
        kept.setdefault("latents", x[0].float().cpu())
        return decode(x, params)

    pipe.decode = keep
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    image_s, step_s, side = [], [], cfg.side()
    for i in range(1 + cfg.images):
        params = DiffusionParams(height=side, width=side, seed=cfg.seed + i,
                                 num_inference_steps=cfg.steps,
                                 guidance_scale=cfg.guidance_scale)
        t0, stamps = now(device), []
        engine.add_request(f"image-{i}", PROMPT, params)
        while engine.has_unfinished_requests:
            (result,) = engine.step()
            assert result.error is None, result.error
            stamps.append(now(device))
        image_s.append(stamps[-1] - t0)
        step_s.append([b - a for a, b in zip(stamps[:-2], stamps[1:-1])])
        kept.setdefault("image", result.images[0].cpu())
    out = {"image_s": image_s, "step_s": step_s,
           "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                                 if device.type == "cuda" else None),
           "num_parameters": sum(p.numel() for p in model.parameters())}
    del pipe, engine, model, vae
    free_device_memory(device)
    return out, kept


def summarize(raw: dict) -> dict:
    """Per image and per step: the timed runs' medians (the warm-up's kept apart)."""
    steps = [s for run in raw["step_s"][1:] for s in run]
    return {**raw, "warmup_image_s": raw["image_s"][0], "per_image_s": median(raw["image_s"][1:]),
            "per_step_s": median(steps)}


def run(cfg: BagelBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory(prefix="bagel-bench-") as tmp:
        root = Path(tmp)
        ref = summarize(run_reference(root, cfg, device))
        ref_kept = load_file(str(root / "reference.safetensors"))
        ours, kept = run_ours(root / "ckpt", cfg, device)
        ours = summarize(ours)
    shape = {"model": cfg.shape, "size": [cfg.side()] * 2, "steps": cfg.steps}
    if not cfg.tiny:
        shape["layers"] = cfg.configs()["llm_config"]["num_hidden_layers"]
    return {
        "benchmark": "bagel", **environment(device),
        "dtype": str(cfg.dtype()).removeprefix("torch."), "config": asdict(cfg),
        "shape": shape, "reference": ref, "ours": ours,
        "ratios": {
            "bagel_speedup_vs_reference": ratio(ref["per_image_s"], ours["per_image_s"]),
            "bagel_step_speedup_vs_reference": ratio(ref["per_step_s"], ours["per_step_s"])},
        "max_abs_diff": {
            "latents": float((kept["latents"] - ref_kept["latents"]).abs().max()),
            "image": float((kept["image"].int() - ref_kept["image"].int()).abs().max())},
        "peak_memory_bytes": {"reference": ref["peak_memory_bytes"],
                              "ours": ours["peak_memory_bytes"]},
        "notes": "one image at a time, both sides, on the same random weights (the reference "
                 "draws them and saves the folder, ours loads it), the same seed (the noise "
                 "drawn on the CPU by both). Speed-ups: the reference's seconds over ours "
                 "(above 1: ours faster), medians of the timed images and of their steps (a "
                 "step with guidance runs the LLM twice). Tiny: the reference on the CPU in "
                 "float32. max_abs_diff: the warm-up image's final latent tokens and uint8 "
                 "pixels; in bfloat16 the two differ by rounding, which random weights can "
                 "amplify over the steps.",
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["7b", "small", "tiny"], default="7b")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny: the fixtures' model")
    parser.add_argument("--layers", type=int, default=None, help="LLM layers (7b: of 28)")
    parser.add_argument("--size", type=int, default=None, help="image side (7b: 1024)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--images", type=int, default=2, help="timed images after a warm-up")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--upstream", default=str(UPSTREAM), help="the upstream checkout")
    parser.add_argument("--float32", action="store_true", help="7b / small in float32 (the "
                        "upstream's bfloat16 casts mapped as the fixtures map them): agreement")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = "tiny" if args.tiny else args.shape
    if shape == "tiny" and (args.layers or args.size):
        parser.error("--layers / --size: the tiny shape is the fixtures' own")
    result = run(BagelBenchConfig(shape=shape, layers=args.layers, size=args.size,
                                  steps=args.steps, images=args.images, device=args.device,
                                  upstream=args.upstream, float32=args.float32))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
