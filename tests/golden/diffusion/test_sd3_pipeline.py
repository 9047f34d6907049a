"""Our StableDiffusion3Pipeline in our engine against diffusers' on a tiny random
SD3.5-medium-like folder (qk RMS-norm, a dual-attention block; CLIP-L and CLIP-G with
projection, T5, the 16-channel-style VAE with shift and scaling), float32: two prompts batched
with CFG and a negative prompt over several steps, skip-layer guidance, the images; a second
folder of odd sizes (TinySD3: the builder takes them) with an image larger than its VAE's
sample_size; bad requests refused at the boundary; served through `Omni` by its default
graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines import sd3
from omnistage.diffusion.pipelines.sd3 import SkipLayerGuidance
from omnistage.testing.diffusion import run_alone, run_recording_latents
from tests.helpers import diffusion_golden as golden
from tests.helpers.sd3 import (  # noqa: F401 (pair: a fixture; the GPU test reads the rest)
    GUIDANCE, HEIGHT, NEGATIVE, ODD, PROMPTS, SEEDS, SEQ, STEPS, WIDTH, Pair, TinySD3,
    build_reference, clip, pair, reference)

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def run_ours(ours: sd3.StableDiffusion3Pipeline) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Both prompts through our engine, the second joining one step after the first."""
    params = [DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                              guidance_scale=GUIDANCE, negative_prompt=NEGATIVE, seed=s)
              for s in SEEDS]

    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        engine.add_request("a", PROMPTS[0], params[0])
        engine.step()
        engine.add_request("b", PROMPTS[1], params[1])
        return {"a": params[0], "b": params[1]}

    seen, engine = run_recording_latents(ours, drive)
    assert engine.num_steps_run == STEPS + 1             # "b" shared every step but a's first
    return [seen["a"], seen["b"]]


def test_matches_diffusers(pair: Pair) -> None:
    ref, ours, _ = pair
    got = run_ours(ours)
    latents = torch.cat([g[0] for g in got])
    golden.assert_latents_match(latents, reference(ref, "latent"),
                                shape=(2, 4, HEIGHT // 2, WIDTH // 2))
    expected_images = reference(ref, "pt")                               # (2, 3, H, W) in [0, 1]
    with torch.no_grad():
        images = ours.decode_float(latents, DiffusionParams(height=HEIGHT, width=WIDTH))
    torch.testing.assert_close(images, expected_images, atol=1e-4, rtol=0)
    golden.assert_output_matches(torch.cat([g[1] for g in got]), expected_images)


def test_odd_sizes_match_diffusers(tmp_path: Path) -> None:
    """ODD's folder (nothing lines up; the image larger than the VAE's default sample_size,
    which diffusers' pipeline decodes whole, not in tiles), a wide image with CFG and a
    negative prompt: the latents, the float images and the uint8 output as diffusers'."""
    ref = build_reference(tmp_path, ODD)
    ours = sd3.StableDiffusion3Pipeline.from_pretrained(tmp_path, "sd3", torch.device("cpu"),
                                                       torch.float32)
    ours.prompt_encoder.max_sequence_length = SEQ
    params = DiffusionParams(height=48, width=80, num_inference_steps=3, guidance_scale=5.0,
                             negative_prompt=NEGATIVE, seed=5)
    run = golden.matches_diffusers(ref, ours, PROMPTS[1], params, shape=(1, 16, 24, 40),
                                   max_sequence_length=SEQ)
    assert run.output.shape == (1, 48, 80, 3)


def test_bfloat16_matches_diffusers(pair: Pair) -> None:
    """Both loaded in bfloat16 from the float32 folder: noise drawn in the model dtype,
    timesteps in float32, CFG in bfloat16, as diffusers (bit-equal when written)."""
    _, _, folder = pair
    # loaded in float32 and cast: diffusers' own bfloat16 load leaves the patch conv's bias
    # float32 here (no accelerate), and its forward then fails
    ref = diffusers.StableDiffusion3Pipeline.from_pretrained(folder).to(torch.bfloat16)
    ref.set_progress_bar_config(disable=True)
    ours = sd3.StableDiffusion3Pipeline.from_pretrained(folder, "sd3", torch.device("cpu"),
                                                       torch.bfloat16)
    ours.prompt_encoder.max_sequence_length = SEQ
    params = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=0,
                             guidance_scale=GUIDANCE, negative_prompt=NEGATIVE)
    got, _ = run_alone(ours, PROMPTS[0], params)
    expected = golden.reference(ref, PROMPTS[0], params, "latent", max_sequence_length=SEQ)
    assert got.dtype == expected.dtype == torch.bfloat16
    golden.assert_latents_match(got, expected, atol=1e-2)


def test_skip_layer_guidance_matches_diffusers(pair: Pair) -> None:
    """Active on steps 1 and 2 of 4 (start 0.1, stop 0.7); it changes the result."""
    ref, ours, _ = pair
    slg = SkipLayerGuidance(layers=(1,), scale=2.8, start=0.1, stop=0.7)
    expected = reference(ref, "latent", skip_guidance_layers=[1], skip_layer_guidance_scale=2.8,
                         skip_layer_guidance_start=0.1, skip_layer_guidance_stop=0.7)
    plain = reference(ref, "latent")
    assert (expected - plain).abs().max() > 1e-2
    ours.use_skip_layer_guidance(slg)
    try:
        got = torch.cat([g[0] for g in run_ours(ours)])
    finally:
        ours.use_skip_layer_guidance(None)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"layers \[3\]: the transformer has 3 blocks"):
        ours.use_skip_layer_guidance(SkipLayerGuidance(layers=(3,)))
    with pytest.raises(ValueError, match="start=0.5, stop=0.2"):
        SkipLayerGuidance(layers=(1,), start=0.5, stop=0.2)


def test_same_latents_alone_or_batched(pair: Pair) -> None:
    """A request without CFG and one with CFG, two images and skip-layer guidance, at other
    steps in one batch: each one's latents as when it runs alone."""
    _, ours, _ = pair
    plain = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=4,
                            guidance_scale=1.0, seed=4)
    guided = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=3,
                             num_images=2, negative_prompt=NEGATIVE)   # guidance 7.0

    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        engine.add_request("plain", PROMPTS[1], plain)
        engine.step()
        engine.add_request("guided", PROMPTS[0], guided)
        return {"plain": plain, "guided": guided}

    ours.use_skip_layer_guidance(SkipLayerGuidance(layers=(1,), start=0.0, stop=0.7))
    try:
        seen, engine = run_recording_latents(ours, drive)
        alone = {"plain": run_alone(ours, PROMPTS[1], plain)[0],
                 "guided": run_alone(ours, PROMPTS[0], guided)[0]}
    finally:
        ours.use_skip_layer_guidance(None)
    assert engine.num_steps_run == 4
    for rid, latents in alone.items():
        torch.testing.assert_close(seen[rid][0], latents, atol=1e-5, rtol=0)
    assert seen["guided"][0].shape == (2, 4, HEIGHT // 2, WIDTH // 2)


@pytest.mark.parametrize("params, prompt, match", [
    (DiffusionParams(height=22, width=36), PROMPTS[0], "height=22: must be a multiple of 4 "
                                                       r"\(VAE factor 2 x 2x2 patches\)"),
    (DiffusionParams(height=20, width=52), PROMPTS[0], "width=52: the maximum is 48"),
    (DiffusionParams(height=20, width=36, true_cfg_scale=4.0), PROMPTS[0], "true_cfg_scale"),
    (DiffusionParams(height=20, width=36, guidance_scale=1.0, negative_prompt="x"), PROMPTS[0],
     "negative_prompt: has no effect"),
    (DiffusionParams(height=20, width=36, cache_threshold=0.1), PROMPTS[0], "no step caching"),
    (DiffusionParams(height=20, width=36), "  ", "non-empty"),
])
def test_refuses_bad_requests(pair: Pair, params: DiffusionParams, prompt: str, match: str
                              ) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_and_split_graphs(pair: Pair) -> None:
    """sd3.yaml (one stage) and sd3_split.yaml (the text encoders in a stage of their own):
    the same images; a bad size fails its request, naming the rule."""
    from omnistage import Omni

    _, _, folder = pair
    params = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=1,
                             negative_prompt=NEGATIVE)
    images = {}
    for graph in (None, "sd3_split"):
        with Omni(str(folder), stage_config=graph, device="cpu", backend="inproc",
                  connector="inproc") as omni:
            outs = omni.generate(list(PROMPTS), params)
            assert [o.error for o in outs] == [None, None]
            assert all(o.images[0].size == (WIDTH, HEIGHT) for o in outs)
            images[graph] = torch.cat([o.tensors["images"] for o in outs])
            (bad,) = omni.generate("a red cube", DiffusionParams(height=21, width=36))
            assert bad.finish_reason == "error" and "multiple of 4" in str(bad.error)
    assert list(outs[0].stage_metrics) == ["text_encoder", "dit"]
    assert (images["sd3_split"].int() - images[None].int()).abs().max() <= 1


def test_skip_layer_guidance_as_a_stage_option(pair: Pair, tmp_path: Path) -> None:
    """The default graph with `diffusion: {options: {skip_layer_guidance: ...}}`: diffusers'
    images with the same skip-layer guidance (and T5's default 256 tokens); a bad option fails the start,
    naming it."""
    from omnistage import Omni

    ref, _, folder = pair
    graph = (Path(__file__).parents[3] / "omnistage" / "configs" / "sd3.yaml").read_text()
    option = "      options: {skip_layer_guidance: {layers: %s, start: 0.1, stop: 0.7}}\n"
    (tmp_path / "slg.yaml").write_text(graph + option % "[1]")
    expected = reference(ref, "pt", skip_guidance_layers=[1], skip_layer_guidance_start=0.1,
                         skip_layer_guidance_stop=0.7, max_sequence_length=256)  # the default
    expected = (expected * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    params = [DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                              guidance_scale=GUIDANCE, negative_prompt=NEGATIVE, seed=s)
              for s in SEEDS]
    with Omni(str(folder), stage_config=str(tmp_path / "slg.yaml"), device="cpu",
              backend="inproc", connector="inproc") as omni:
        outs = [omni.generate(p, q)[0] for p, q in zip(PROMPTS, params)]
    assert [o.error for o in outs] == [None, None]
    got = torch.cat([o.tensors["images"] for o in outs])
    assert (got.int() - expected.int()).abs().max() <= 1

    (tmp_path / "bad.yaml").write_text(graph + option % "[7]")
    with pytest.raises(Exception, match=r"layers \[7\]: the transformer has 3 blocks"):
        Omni(str(folder), stage_config=str(tmp_path / "bad.yaml"), device="cpu",
             backend="inproc", connector="inproc")
