"""The tiny HunyuanImage-3.0 checkpoint of tests/fixtures/hunyuan_image3/, rebuilt from its seed
(the weights are ~11 MB, so the fixture keeps the seed, names and shapes instead):
scripts/hunyuan_image3_fixtures.py drew every tensor with the same `seeded_value` rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hunyuan_image3"


def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


def expected() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "expected.safetensors"))


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
    return x / int(np.prod(shape[1:])) ** 0.5


def build_checkpoint(folder: Path) -> Path:
    """config.json, model.safetensors and the tokenizer files of the fixture's tiny model."""
    m = manifest()
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(m["seed"])
    state = {n: seeded_value(n, tuple(s), gen) for n, s in sorted(m["tensors"])}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(m["config"], indent=1))
    (folder / "generation_config.json").write_text(json.dumps(m["generation_config"], indent=1))
    for f in m["tokenizer_files"]:
        shutil.copy(FIXTURES / f, folder / f)
    return folder


def case_request(case: dict, noise: torch.Tensor, cfg, **over):
    """The GenerationRequest of a fixture case (the upstream template's tokens and layout)."""
    from omnistage.models.hunyuan_image3 import GenerationRequest
    (start, _), = case["image_slices"][0]
    f = cfg.vae_downsample_factor
    fields = dict(tokens=torch.tensor(case["tokens"]), timestep_index=case["timestep_index"][0][0],
                  image_start=start, token_h=case["image_size"][0] // f[0],
                  token_w=case["image_size"][1] // f[1], noise=noise, steps=case["steps"],
                  guidance_scale=case["guidance_scale"], flow_shift=case["flow_shift"])
    return GenerationRequest(**(fields | over))


def rank_generate(ranks, folder: str, case: str) -> dict:
    """One rank's body for omnistage.testing.ranks.run_ranks (its TP group is current): load the
    tiny checkpoint split over the ranks and generate a fixture case."""
    from omnistage.models.hunyuan_image3 import HunyuanImage3, generate_image
    model = HunyuanImage3.from_pretrained(folder)
    req = case_request(manifest()["cases"][case], expected()[f"{case}.noise"], model.cfg)
    latents, image = generate_image(model, req)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    return {"latents": latents.flatten().tolist(), "image": image.flatten().tolist(),
            "qkv_rows": qkv, "expert_rows": model.model.layers[0].mlp.experts.local_size}


def stage_run(ranks, folder: str, cases: list[dict]) -> dict:
    """The cases ({"id", "prompt", "params": DiffusionParams fields}) through a DiffusionStage
    over these ranks' sizes, batched in one engine: rank 0 adds and steps them, then stops the
    others, which `follow()`. -> rank 0: per case its final latents and uint8 image (flat) and
    the image's shape; the others {}. Seeds must differ (they key the decoded images)."""
    import time

    from omnistage.configs.schema import StageConfig
    from omnistage.diffusion.params import DiffusionParams
    from omnistage.stages.diffusion import DiffusionStage
    from omnistage.stages.interface import StageRequest

    stage = DiffusionStage(StageConfig(
        name="dit", kind="diffusion", component="hunyuan_image3", model=folder, dtype="float32",
        final="image", parallel=ranks.sizes), None, "cpu")
    if not ranks.is_leader:
        stage.follow()
        return {}
    pipe, seen = stage.engine.pipeline, {}
    decode = pipe.decode

    def keep(x: torch.Tensor, params) -> torch.Tensor:
        image = decode(x, params)
        seen[params.seed] = {"latents": x.flatten().tolist(), "image": image.flatten().tolist(),
                             "shape": list(image.shape)}
        return image

    pipe.decode = keep
    for case in cases:
        stage.add(StageRequest(case["id"], time.time(), prompt=case["prompt"],
                               diffusion=DiffusionParams(**case["params"])))
    while stage.has_unfinished_requests:
        assert all(r.error is None for r in stage.step())
    stage.stop_followers()
    return {c["id"]: seen[c["params"]["seed"]] for c in cases}
