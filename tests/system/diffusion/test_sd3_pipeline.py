"""Our StableDiffusion3Pipeline in our engine against diffusers' on a tiny random
SD3.5-medium-like folder (qk RMS-norm, a dual-attention block; CLIP-L and CLIP-G with
projection, T5, the 16-channel-style VAE with shift and scaling), float32: two prompts batched
with CFG and a negative prompt over several steps, skip-layer guidance, the images; a second
folder of odd sizes (TinySD3: the builder takes them) with an image larger than its VAE's
sample_size; bad requests refused at the boundary; served through `Omni` by its default
graph."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.configs.schema import ParallelSizes
from omnistage.layers.groups import StageRanks
from omnistage.testing.diffusion_ranks import sd3_run
from omnistage.testing.ranks import run_ranks
from tests.helpers.sd3 import HEIGHT, NEGATIVE, PROMPTS, WIDTH, Pair, pair  # noqa: F401


def test_cfg_parallel_matches_one_rank(pair: Pair, tmp_path: Path) -> None:
    """Two CPU ranks (gloo): the prompt rows on CFG rank 0, the negative and skip-layer rows
    on rank 1; requests with CFG (two images), without, at other step counts: every rank's
    latents equal one rank's."""
    _, _, folder = pair
    size = dict(height=HEIGHT, width=WIDTH)
    cases = [dict(id="a", prompt=PROMPTS[0], params=dict(size, num_inference_steps=3, seed=1,
                                                         num_images=2, guidance_scale=5.0,
                                                         negative_prompt=NEGATIVE)),
             dict(id="b", prompt=PROMPTS[1], params=dict(size, num_inference_steps=2, seed=2,
                                                         guidance_scale=1.0)),
             dict(id="c", prompt=PROMPTS[1], params=dict(size, num_inference_steps=4, seed=3))]
    kwargs = {"folder": str(folder), "cases": cases, "skip_layers": [1]}
    reference = sd3_run(StageRanks.single(), **kwargs)["latents"]
    results = run_ranks("omnistage.testing.diffusion_ranks:sd3_run", ParallelSizes(cfg=2),
                        kwargs, tmp_path)
    for rank, result in enumerate(results):
        for rid, expected in reference.items():
            expected = torch.tensor(expected)
            assert expected.abs().max() > 1.0, (rid, "latents too small to compare")
            diff = (torch.tensor(result["latents"][rid]) - expected).abs().max()
            assert diff < 1e-5 * expected.abs().max(), (rank, rid, float(diff))

