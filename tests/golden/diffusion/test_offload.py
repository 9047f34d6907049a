"""Layerwise offload of a transformer's blocks (diffusion/offload.py) on a tiny FLUX.1 of 2
double- and 3 single-stream blocks: the same latents as the resident pipeline (which is
golden against diffusers, test_flux_pipeline.py), bit for bit in float32, over several steps
and requests; the device holds prefetch + 1 blocks' weights; each block is fetched ahead but
the first; blocks run out of order are still right; the stage refuses what cannot offload.
On the CPU the copies are synchronous: the GPU's overlap is measured by a benchmark, not here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import StageConfig
from omnistage.configs.strict import from_dict
from omnistage.diffusion.offload import BlockOffload, block_lists, offload_of
from omnistage.diffusion.params import DiffusionParams
from omnistage.stages.diffusion import check_offload
from omnistage.testing.diffusion import run_alone
from tests.golden.diffusion.test_flux_pipeline import PROMPT, SEQ, SIZE, build_reference
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("flux_offload")
    build_reference(path, guidance_embeds=True, num_layers=2, num_single_layers=3)
    return path


def load(folder: Path, offload: int = 0):  # -> FluxPipeline
    from omnistage.diffusion.pipelines.flux import FluxPipeline

    pipe = FluxPipeline.from_pretrained(folder, "flux", CPU, torch.float32, offload=offload)
    pipe.prompt_encoder.max_sequence_length = SEQ
    return pipe


@pytest.mark.parametrize("prefetch", [1, 2])
def test_offloaded_blocks_give_the_resident_latents(folder: Path, prefetch: int) -> None:
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=3.5,
                             seed=4)
    want, _ = run_alone(load(folder), PROMPT, params)
    assert want.abs().mean() > golden.MIN_ABS_MEAN
    pipe = load(folder, offload=prefetch)
    off = offload_of(pipe.transformer)
    assert [type(m).__name__ for m in off.modules] == \
        ["FluxTransformerBlock"] * 2 + ["FluxSingleTransformerBlock"] * 3
    for seed in (4, 5):                 # two requests, three steps each
        got, _ = run_alone(pipe, PROMPT, DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=3.5, seed=seed))
        if seed == 4:
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert off.num_late_loads == 1     # only the very first block was not fetched ahead
    assert off.num_loads == 2 * 3 * 5 + prefetch        # each block once a step, + the ring
    block_bytes = [sum(f.numel() * f.element_size() for f in b.host.values())
                   for b in off.blocks]
    assert off.resident_bytes == (prefetch + 1) * max(block_bytes) < sum(block_bytes)


class Toy(torch.nn.Module):
    """Blocks of different sizes and dtypes (a buffer too), the way DiT blocks mix them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8 * (i + 1)), torch.nn.Linear(8 * (i + 1), 8))
            for i in range(4))
        for i, block in enumerate(self.blocks):
            block.register_buffer("shift", torch.full((8,), float(i), dtype=torch.float64))

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        block = self.blocks[i]
        return block(x) + block.shift.float()


def test_blocks_out_of_order_load_when_reached() -> None:
    """Blocks skipped (a step cache), repeated or run in another order than their lists':
    each still computes with its own weights and buffers, and the next ones still come
    ahead where the order holds."""
    torch.manual_seed(0)
    resident = Toy()
    offloaded = Toy()
    offloaded.load_state_dict(resident.state_dict())
    off = BlockOffload(offloaded, CPU, prefetch=1)
    x = torch.randn(3, 8)
    for order in ([0, 1, 2, 3], [3, 1], [2, 2, 0], [0, 1, 2, 3]):
        for i in order:
            torch.testing.assert_close(offloaded.run(i, x), resident.run(i, x), atol=0, rtol=0)
    # the first block, then 1 after 3 and 0 after 2, 2: a block still held loads nothing
    assert off.num_late_loads == 3
    slots = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size())
             for slot in off.slots for f in slot.flats.values()]
    assert not any(lo <= p.data_ptr() < hi for p in offloaded.blocks.parameters()
                   for lo, hi in slots)        # between forwards no block points at a slot
    assert offload_of(offloaded) is None       # made directly, not by offload_blocks


def test_block_lists_and_bad_settings(folder: Path) -> None:
    model = load(folder).transformer
    names = [name for _, name, _ in block_lists(model)]
    assert names == ["transformer_blocks", "single_transformer_blocks"]
    with pytest.raises(ValueError, match="prefetch=0"):
        BlockOffload(model, CPU, prefetch=0)
    with pytest.raises(ValueError, match="no lists of blocks"):
        block_lists(torch.nn.Sequential(torch.nn.Linear(4, 4)))

    def stage(diffusion: dict, component: str = "flux", parallel: dict | None = None
              ) -> StageConfig:
        data = {"name": "dit", "kind": "diffusion", "component": component, "final": "image",
                "diffusion": diffusion, **({"parallel": parallel} if parallel else {})}
        return from_dict(StageConfig, data, "stages[0]")

    from omnistage.registry import load_component

    flux = load_component("diffusion", "flux")
    check_offload(stage({"offload": True}), flux)          # fine
    with pytest.raises(ValueError, match="choose one"):
        check_offload(stage({"offload": 1, "quantization": "fp8"}), flux)
    with pytest.raises(ValueError, match="runs eagerly"):
        check_offload(stage({"offload": True, "cuda_graphs": True}), flux)
    with pytest.raises(ValueError, match="one GPU"):
        check_offload(stage({"offload": True}, parallel={"cfg": 2}), flux)
    with pytest.raises(ValueError, match="does not offload"):
        check_offload(stage({"offload": True}, "wan"), load_component("diffusion", "wan"))
    with pytest.raises(ValueError, match="offload"):
        stage({"offload": 0})
