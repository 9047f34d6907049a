"""HunyuanImage-3.0's experts and attention heads split over 2 CPU ranks (gloo): each rank keeps
one kv head (with its q heads) and half of every expert's and the shared MLP's width, and the
two ranks generate the one-rank image (and the upstream's, tests/fixtures/hunyuan_image3)."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.layers.groups import ParallelSizes
from omnistage.models.hunyuan_image3 import HunyuanImage3, generate_image
from omnistage.testing.ranks import run_ranks
from tests.helpers.hunyuan_image3 import build_checkpoint, case_request, expected, manifest


def test_two_ranks_equal_one_rank(tmp_path: Path) -> None:
    folder = build_checkpoint(tmp_path / "ckpt")
    model = HunyuanImage3.from_pretrained(folder)
    req = case_request(manifest()["cases"]["wide"], expected()["wide.noise"], model.cfg)
    latents, image = generate_image(model, req)
    results = run_ranks("tests.helpers.hunyuan_image3:rank_generate", ParallelSizes(tp=2),
                        {"folder": str(folder), "case": "wide"}, tmp_path / "ranks")
    for rank, res in enumerate(results):
        assert res["qkv_rows"] == model.model.layers[0].self_attn.qkv_proj.weight.shape[0] // 2
        assert res["expert_rows"] == model.cfg.moe_intermediate_size // 2
        got = torch.tensor(res["latents"]).reshape(latents.shape)
        torch.testing.assert_close(got, latents, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
        got_image = torch.tensor(res["image"]).reshape(image.shape)
        torch.testing.assert_close(got_image, image, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
