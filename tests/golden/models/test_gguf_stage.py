"""A GGUF transformer loaded through a stage's `quantization` record (stages/quantize.py):
a tiny FLUX.1 pipeline folder, its transformer written to a Q8_0 GGUF file, our pipeline with
`quantization: {transformer: gguf:FILE}` against diffusers' FluxPipeline whose transformer has
diffusers' reading of the same file (load_gguf_checkpoint): the same latents and images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import DiffusionSettings, StageConfig
from omnistage.diffusion.params import DiffusionParams
from omnistage.layers.gguf import GGUFLinear
from omnistage.stages.diffusion import quantize_pipeline
from tests.golden.diffusion.test_flux_pipeline import PROMPT, SEQ, SIZE, build_reference
from tests.golden.models.test_gguf_loader import diffusers_gguf_model
from tests.helpers import diffusion_golden as golden
from tests.helpers.gguf_files import write_gguf

pytest.importorskip("diffusers")
pytest.importorskip("gguf")
Q8_0 = 8


def test_flux_gguf_transformer_through_the_stage_config(tmp_path: Path) -> None:
    ref = build_reference(tmp_path, guidance_embeds=True)
    file = tmp_path / "flux-Q8_0.gguf"
    write_gguf(ref.transformer, file, Q8_0)
    before = {k: v.clone() for k, v in ref.transformer.state_dict().items()}
    diffusers_gguf_model(ref.transformer, file)           # diffusers' weights: the file's
    assert any(not torch.equal(before[k], v) for k, v in ref.transformer.state_dict().items())
    ours = golden.load_ours(tmp_path, "flux")
    ours.prompt_encoder.max_sequence_length = SEQ
    stage = StageConfig(name="dit", kind="diffusion", component="flux",
                        diffusion=DiffusionSettings(quantization=f"gguf:{file}"))
    quantize_pipeline(stage, ours, torch.device("cpu"))
    assert sum(isinstance(m, GGUFLinear) for m in ours.transformer.modules()) >= 8
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3,
                             guidance_scale=3.5, seed=0, num_images=2)
    golden.matches_diffusers(ref, ours, PROMPT, params, shape=(2, (SIZE // 4) ** 2, 16),
                             max_sequence_length=SEQ)
