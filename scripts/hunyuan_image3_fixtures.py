"""Regenerate tests/fixtures/hunyuan_image3/ from the upstream HunyuanImage-3.0 code.

    python scripts/hunyuan_image3_fixtures.py /path/to/HunyuanImage-3.0-checkout
                                              [--out tests/fixtures/hunyuan_image3] [--ckpt-dir DIR]

Upstream: github.com/Tencent-Hunyuan/HunyuanImage-3.0 at UPSTREAM_COMMIT (the script refuses
another commit unless --any-commit). Runs in the reference's own environment, not .venv:
python3 -m venv; pip install torch==2.13.0 "transformers[accelerate,tiktoken]==4.56.2"
diffusers==0.35.2 einops numpy==1.26.4 pillow==11.3.0 safetensors==0.4.5 (the versions its
requirements.txt pins or allows; torchvision is not installed, see below).

What it does:
1. builds a TINY random HunyuanImage3ForCausalMM with the upstream classes (2 layers, 4 experts
   top-2 plus a shared expert, hidden 64, a 3-level Conv3D VAE with spatial factor 4, a one-layer
   SigLIP2 the text-to-image path does not use), every tensor drawn from one seed in sorted-name
   order by `seeded_value` (tests/helpers/hunyuan_image3.py draws the same), and saves it in the
   checkpoint's layout (config.json with architectures, model.safetensors with the real names,
   generation_config.json, tokenizer.json) to --ckpt-dir (a temp folder by default; never
   committed: the weights are ~2 MB, the tests rebuild them from the seed);
2. runs the upstream text-to-image generation (`prepare_model_inputs(mode="gen_image")` then
   `_generate`, i.e. HunyuanImage3Text2ImagePipeline: flow-matching Euler with CFG over the
   image tokens inside the transformer, then the VAE decode) for two cases: one prompt at 28x36
   (7x9 image tokens) with 3 steps, and another prompt at 32x32 with 2 steps, another guidance
   and shift (one prompt per call: the upstream's batched prompts under CFG build their rope for
   half the rows and stop at an assertion); and the greedy text the model writes before an image
   (bot_task "think", 8 tokens, transformers' generate as the upstream drives it);
3. writes manifest.json (config, seed, tensor names and shapes, case settings, the token ids and
   masks the upstream template produced) and expected.safetensors (initial noise, final latents,
   decoded image) to --out.

Patches made at import time, because the reference needs a GPU as written (none change the math):
- torch.cuda.set_device (HunyuanMoE.forward calls it) and torch.cuda.nvtx.range are no-ops;
- attention is the upstream's own SDPA class (config._attn_implementation = "sdpa");
- the pipeline draws its initial noise in bfloat16 and relies on CUDA autocast to feed it to the
  float32 patch embedding; here the same bfloat16 draw is cast to float32 (the fixture stores it);
- torchvision (only its transforms, used for conditioning images) is a stand-in module, and the
  SigLIP2 fast image processor (needs torchvision) is not built: text-to-image uses neither.
The KV cache takes the dtype of the keys (transformers' lazy StaticCache), so all runs in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

UPSTREAM_COMMIT = "1d011c84a579a0292bd739a0cee2092243d73986"
SEED = 4321

WORDS = ("a the of and with on in red blue green cat dog cube sky tree house small large photo "
         "painting sunset over river mountain User Assistant : . , !").split()
SPECIAL = (["<pad>", "<|startoftext|>", "<|endoftext|>", "<boi>", "<eoi>", "<img>", "<cfg>",
            "<timestep>", "<guidance>", "<joint_img_sep>", "<answer>", "</answer>", "<recaption>",
            "</recaption>", "<think>", "</think>", "<img_size_32>"]
           + [f"<img_ratio_{i}>" for i in range(33)])

VAE = dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=[32, 32, 64],
           layers_per_block=1, ffactor_spatial=4, ffactor_temporal=2, sample_size=64,
           sample_tsize=4, scaling_factor=0.75, shift_factor=0.1,
           downsample_match_channel=True, upsample_match_channel=True)
VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
           num_channels=3, patch_size=4, num_patches=16, layer_norm_eps=1e-6,
           hidden_act="gelu_pytorch_tanh", attention_dropout=0.0, vision_use_head=False,
           _attn_implementation="sdpa")
CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16,
              hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-5,
              rope_theta=10000.0, rope_scaling={"type": "custom", "factor": 1.0},
              attention_bias=False, mlp_bias=False, use_qk_norm=True, use_rotary_pos_emb=True,
              norm_type="rms", num_experts=4, moe_topk=2, use_mixed_mlp_moe=True,
              num_shared_expert=1, moe_layer_num_skipped=0, norm_topk_prob=True,
              routed_scaling_factor=1.0, vae_downsample_factor=[4, 4], img_proj_type="unet",
              patch_size=1, patch_embed_hidden_dim=32, image_base_size=32, tie_word_embeddings=False,
              vae=VAE, vit=VIT, vit_processor={"patch_size": 4, "max_num_patches": 16},
              vit_aligner={"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2},
              architectures=["HunyuanImage3ForCausalMM"], model_type="hunyuan_image_3_moe")
GENERATION = dict(diff_infer_steps=3, diff_guidance_scale=4.0, flow_shift=3.0,
                  sequence_template="instruct", use_system_prompt="None", bot_task="image",
                  drop_think=False, max_length=512)
CASES = {
    "wide": dict(prompts=["a red cat on a small house"], image_size=[28, 36], seeds=[11],
                 steps=3, guidance_scale=4.0, flow_shift=3.0),
    "square": dict(prompts=["a painting of a green tree over the river"], image_size=[32, 32],
                   seeds=[5], steps=2, guidance_scale=2.5, flow_shift=1.0),
}
# the model's text answer before an image (bot_task "think": "Assistant: <think>" then greedy)
TEXT_CASE = dict(prompt="a red cat on a small house", bot_task="think", max_new_tokens=8)
# image_size "auto": the model picks the ratio (one greedy token after "<boi><img_size_B>")
RATIO_PROMPTS = ["a red cat on a small house", "blue sky", "a large photo of the mountain"]


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor of the tiny checkpoint (tests/helpers/hunyuan_image3.py has the same rule):
    1-D weights near 1, biases small, matrices scaled by 1/sqrt(fan_in)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
    fan_in = int(np.prod(shape[1:]))
    return x / fan_in ** 0.5


def seeded_state(names_shapes, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: seeded_value(n, tuple(s), gen) for n, s in sorted(names_shapes)}


def patch_for_cpu() -> None:
    import transformers  # noqa: F401  (its torchvision check runs before the stand-in exists)
    import transformers.image_processing_utils_fast  # noqa: F401
    import diffusers.utils  # noqa: F401  (the same for diffusers)
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    tv = types.ModuleType("torchvision")
    tv.transforms = types.ModuleType("torchvision.transforms")
    for name in ("Compose", "ToTensor", "Normalize", "Resize", "CenterCrop"):
        setattr(tv.transforms, name, lambda *a, **k: None)
    sys.modules.setdefault("torchvision", tv)
    sys.modules.setdefault("torchvision.transforms", tv.transforms)


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<|startoftext|>", eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[3:]})
    fast.save_pretrained(out_dir)
    return fast


def build_model(upstream: Path, ckpt: Path):
    sys.path.insert(0, str(upstream))
    from hunyuan_image_3 import image_processor as ip
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    from transformers import GenerationConfig

    def init_processor(self, config):     # no SigLIP2 fast processor (needs torchvision)
        self.config = config
        self.reso_group = ip.ResolutionGroup(base_size=config.image_base_size)
    ip.HunyuanImage3ImageProcessor.__init__ = init_processor

    tok = build_tokenizer(ckpt)
    cfg = dict(CONFIG, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = HunyuanImage3Config(**cfg)
    config._attn_implementation = "sdpa"
    model = HunyuanImage3ForCausalMM(config).eval()
    names_shapes = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    model.load_state_dict(seeded_state(names_shapes, SEED), strict=True)
    model.generation_config = GenerationConfig(**GENERATION)
    model.save_pretrained(ckpt, safe_serialization=True)
    model.load_tokenizer(tok)
    return model, tok, config, names_shapes


def run_case(model, case: dict) -> tuple[dict, dict]:
    """One upstream text-to-image call; returns (token info, expected tensors)."""
    pipe = model.pipeline
    record = {}
    orig_latents = type(pipe).prepare_latents
    orig_decode = model.vae.decode

    def prepare_latents(self, *a, **k):
        lat = orig_latents(self, *a, **k).float()   # drawn in bfloat16 as upstream; fp32 on CPU
        record["noise"] = lat.clone()
        return lat

    def decode(z, *a, **k):
        record["vae_input"] = z.clone()
        out = orig_decode(z, *a, **k)
        record["image"] = out[0].clone()
        return out

    pipe.prepare_latents = types.MethodType(prepare_latents, pipe)
    model.vae.decode = decode
    pipe.scheduler.register_to_config(shift=case["flow_shift"])
    inputs = model.prepare_model_inputs(prompt=case["prompts"], mode="gen_image",
                                        image_size=tuple(case["image_size"]), seed=case["seeds"],
                                        bot_task="image", system_prompt=None)
    out = inputs["tokenizer_output"]
    info = dict(tokens=out.tokens.tolist(), image_mask=out.gen_image_mask.int().tolist(),
                timestep_index=out.gen_timestep_scatter_index.tolist(),
                image_slices=[[[s.start, s.stop] for s in row] for row in out.gen_image_slices])
    with torch.no_grad():
        model._generate(**inputs, diff_infer_steps=case["steps"],
                        diff_guidance_scale=case["guidance_scale"])
    model.vae.decode = orig_decode
    return info, {k: v.float().contiguous() for k, v in record.items()}


def run_text_case(model) -> dict:
    """Greedy tokens of the upstream gen_text path (HF generate with the upstream's cache)."""
    c = TEXT_CASE
    inputs = model.prepare_model_inputs(prompt=c["prompt"], mode="gen_text", bot_task=c["bot_task"],
                                        system_prompt=None, max_new_tokens=c["max_new_tokens"])
    prompt = inputs["tokenizer_output"].tokens
    with torch.no_grad():
        out = model._generate(**inputs, do_sample=False)
    return dict(c, tokens=prompt.tolist(), stop_ids=list(inputs["eos_token_id"]),
                generated=out[:, prompt.shape[1]:].tolist())


def run_ratio_case(model) -> dict:
    """The upstream generate_image's image_size="auto" step, per prompt: its prompt tokens, the
    greedy token and the ratio index it maps to (16, 1:1, when the token is no ratio)."""
    rows = []
    for prompt in RATIO_PROMPTS:
        inputs = model.prepare_model_inputs(prompt=prompt, cot_text=None, bot_task="img_ratio",
                                            system_prompt=None, seed=0)
        with torch.no_grad():
            out = model._generate(**inputs, do_sample=False)
        token = int(out[0, -1])
        index = token - model._tkwrapper.ratio_token_offset
        index = index if 0 <= index < len(model.image_processor.reso_group) else 16
        rows.append(dict(prompt=prompt, tokens=inputs["tokenizer_output"].tokens[0].tolist(),
                         token=token, ratio_index=index,
                         size=list(model.image_processor.reso_group[index])))
    return dict(rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("upstream", type=Path)
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/hunyuan_image3"))
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--any-commit", action="store_true")
    args = ap.parse_args()
    commit = subprocess.check_output(["git", "-C", str(args.upstream), "rev-parse", "HEAD"],
                                     text=True).strip()
    if commit != UPSTREAM_COMMIT and not args.any_commit:
        sys.exit(f"upstream at {commit}, expected {UPSTREAM_COMMIT} (--any-commit to override)")
    patch_for_cpu()
    torch.manual_seed(0)
    ckpt = args.ckpt_dir or Path(tempfile.mkdtemp(prefix="hi3-tiny-"))
    model, tok, config, names_shapes = build_model(args.upstream, ckpt)
    from safetensors.torch import save_file
    expected, cases = {}, {}
    for name, case in CASES.items():
        info, tensors = run_case(model, case)
        cases[name] = dict(case, **info)
        expected.update({f"{name}.{k}": v for k, v in tensors.items()})
        print(name, {k: (tuple(v.shape), round(float(v.abs().mean()), 4)) for k, v in tensors.items()})
    cases["text"] = run_text_case(model)
    cases["ratio"] = run_ratio_case(model)
    print("ratio", [(r["token"], r["ratio_index"]) for r in cases["ratio"]["rows"]])
    print("text", cases["text"]["generated"])
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(expected, str(args.out / "expected.safetensors"))
    manifest = dict(upstream="Tencent-Hunyuan/HunyuanImage-3.0", commit=commit, seed=SEED,
                    config=json.loads((ckpt / "config.json").read_text()),
                    generation_config=GENERATION, tensors=[[n, list(s)] for n, s in names_shapes],
                    cases=cases, tokenizer_files=["tokenizer.json", "tokenizer_config.json",
                                                  "special_tokens_map.json"])
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for f in manifest["tokenizer_files"]:
        (args.out / f).write_bytes((ckpt / f).read_bytes())
    print("wrote", args.out, "checkpoint in", ckpt)


if __name__ == "__main__":
    main()
