"""LTX-2's spatio-temporal guidance (STG) against diffusers' `LTX2Pipeline`: a tiny random
folder (tests/helpers/ltx2.py) whose transformer has `perturbed_attn`, STG on one of its two
blocks (the self-attentions skipped, their values standing in), with and beside CFG,
modality guidance and rescale; float32, the final video and audio latents within 1e-4. A
transformer without perturbed_attn runs no STG pass (diffusers' equals the conditional one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.ltx2 import LTX2Options
from omnistage.registry import load_component
from tests.helpers.ltx2 import build_tiny_ltx2, tiny_transformer
from tests.helpers.ltx2_run import conditioning, final_latents, run_ours

pytest.importorskip("diffusers")

H, W, FRAMES = 32, 64, 5
NO_EXTRAS = LTX2Options(audio_guidance_scale=1.0, modality_scale=1.0, audio_modality_scale=1.0,
                        guidance_rescale=0.0, audio_guidance_rescale=0.0, stg_blocks=(1,))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("ltx2_stg")
    ref = build_tiny_ltx2(path)
    ref.transformer = tiny_transformer(perturbed_attn=True)
    ref.transformer.save_pretrained(path / "transformer")
    ours = load_component("diffusion", "ltx2").from_pretrained(
        path, "ltx2", torch.device("cpu"), torch.float32, text_encoders=False)
    return ref, ours


CASES = {"stg-only": (1.0, dataclasses.replace(NO_EXTRAS, stg_scale=2.0, audio_stg_scale=1.5)),
         "stg-cfg-modality": (3.0, dataclasses.replace(LTX2Options(), stg_blocks=(1,),
                                                       stg_scale=1.0, audio_stg_scale=0.5))}


@pytest.mark.parametrize("case", list(CASES))
def test_stg_latents_match_diffusers(pair, case: str) -> None:
    ref, ours = pair
    guidance, opt = CASES[case]
    ours.configure(opt)
    assert ours.stg
    p = DiffusionParams(height=H, width=W, num_frames=FRAMES, fps=24.0, num_inference_steps=3,
                        guidance_scale=guidance, seed=4)
    text, cond = conditioning(ref, seed=5)
    video, audio = ref(**text, height=H, width=W, num_frames=FRAMES, frame_rate=24.0,
                       num_inference_steps=3, guidance_scale=guidance,
                       audio_guidance_scale=opt.audio_guidance_scale,
                       modality_scale=opt.modality_scale,
                       audio_modality_scale=opt.audio_modality_scale,
                       guidance_rescale=opt.guidance_rescale,
                       audio_guidance_rescale=opt.audio_guidance_rescale,
                       stg_scale=opt.stg_scale, audio_stg_scale=opt.audio_stg_scale,
                       spatio_temporal_guidance_blocks=list(opt.stg_blocks),
                       generator=torch.Generator().manual_seed(4), output_type="latent",
                       return_dict=False)
    got = run_ours(ours, {"a": (p, cond)})["a"][0]
    got_video, got_audio = final_latents(ours, p, got)
    for g, e in ((got_video, video), (got_audio, audio)):
        assert g.shape == e.shape
        assert e.abs().mean() > 0.3, float(e.abs().mean())
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    # the STG term is not negligible: without it the result moves
    ours.configure(dataclasses.replace(opt, stg_scale=0.0, audio_stg_scale=0.0))
    plain = final_latents(ours, p, run_ours(ours, {"a": (p, cond)})["a"][0])[0]
    assert (plain - video).abs().max() > 1e-2


def test_no_stg_pass_without_perturbed_attn(tmp_path) -> None:
    build_tiny_ltx2(tmp_path)
    ours = load_component("diffusion", "ltx2").from_pretrained(
        tmp_path, "ltx2", torch.device("cpu"), torch.float32, text_encoders=False)
    ours.configure(dataclasses.replace(NO_EXTRAS, stg_scale=2.0))
    assert not ours.stg
