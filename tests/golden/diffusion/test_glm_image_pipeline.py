"""GlmImagePipeline (the DiT decode stage) in our engine against diffusers' GlmImagePipeline
given the same AR output (`prior_token_ids`) on a tiny random folder, float32: the same
latents and images with and without CFG; the same latents alone or batched with a request at
another step, another glyph length and no CFG; two edits batched as each alone; bad
conditioning (an edit's too) and params refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.glm_image import GlmImagePipeline
from omnistage.models.glm_image import target_grids
from omnistage.testing.diffusion import png, run_recording_latents
from omnistage.testing.tiny_glm_image import CODEBOOK, build_tiny_glm_image_dit
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")

H, W = 64, 96                   # a 2x3 AR token grid, a 13x19 preview before it
PROMPT = 'a sign that reads "OPEN" and \'24/7\''
OTHER = "a quiet lake at dawn"  # no quoted text: the "" glyph


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.GlmImagePipeline, GlmImagePipeline]:
    path = tmp_path_factory.mktemp("glm_image")
    ref = build_tiny_glm_image_dit(path)
    ref.set_progress_bar_config(disable=True)
    ours = GlmImagePipeline.from_pretrained(path, "glm_image", torch.device("cpu"),
                                            torch.float32)
    return ref, ours


def ar_tokens(seed: int) -> Tensor:
    """What the AR stage writes for an H x W image: the preview grid, the target grid, the
    end token."""
    (th, tw), (ph, pw) = target_grids(H, W)
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, CODEBOOK, (ph * pw + th * tw,), generator=g),
                      torch.tensor([16385])])


def reference(ref: diffusers.GlmImagePipeline, prompt: str, tokens: Tensor, guidance: float,
              output_type: str) -> Tensor:
    (th, tw), (ph, pw) = target_grids(H, W)
    large = ref._extract_large_image_tokens(tokens[None], 0, ph * pw, th * tw)
    prior = ref._upsample_token_ids(large, th, tw)
    return golden.reference(ref, prompt, params(guidance), output_type, prior_token_ids=prior)


def params(guidance: float | None, seed: int = 7) -> DiffusionParams:
    return DiffusionParams(height=H, width=W, num_inference_steps=3, seed=seed,
                           guidance_scale=guidance)


def add(engine: DiffusionEngine, rid: str, prompt: str, p: DiffusionParams, tokens: Tensor
        ) -> None:
    """As the stage does: the prompt encoded here, parked until the AR's tokens come."""
    engine.add_request(rid, prompt, p, parked=True)
    assert engine.is_parked(rid)
    engine.set_conditioning(rid, {"token_ids": tokens})


@pytest.mark.parametrize("guidance", [1.5, 1.0], ids=["cfg", "no-cfg"])
def test_matches_diffusers(pair: tuple[diffusers.GlmImagePipeline, GlmImagePipeline],
                           guidance: float) -> None:
    ref, ours = pair
    tokens = ar_tokens(0)
    p = params(guidance)
    got, _ = run_recording_latents(ours, lambda e: (add(e, "a", PROMPT, p, tokens),
                                                    {"a": p})[1])[0]["a"]
    expected = reference(ref, PROMPT, tokens, guidance, "latent")
    golden.assert_latents_match(got, expected, shape=(1, 4, H // 8, W // 8), rtol=1e-4)
    images = ours.decode_float(got, p)                                   # (1, 3, H, W)
    ref_images = reference(ref, PROMPT, tokens, guidance, "pt")
    assert ref_images.std() > 0.05
    assert (images - ref_images).abs().max() <= 2 / 255


def test_batched_at_other_steps(pair: tuple[diffusers.GlmImagePipeline, GlmImagePipeline]
                                ) -> None:
    """A CFG request and a no-CFG request of another glyph length, the second joining a step
    later: each ends where it ends alone (and where diffusers ends)."""
    ref, ours = pair
    jobs = {"a": (PROMPT, params(1.5), ar_tokens(1)), "b": (OTHER, params(None, 3), ar_tokens(2))}

    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        add(engine, "a", *jobs["a"])
        engine.step()
        add(engine, "b", *jobs["b"])
        return {rid: job[1] for rid, job in jobs.items()}

    together = run_recording_latents(ours, drive)[0]
    expected = reference(ref, PROMPT, jobs["a"][2], 1.5, "latent")
    torch.testing.assert_close(together["a"][0], expected, atol=1e-4, rtol=1e-4)
    alone = run_recording_latents(ours, lambda e: (add(e, "b", *jobs["b"]),
                                                   {"b": jobs["b"][1]})[1])[0]["b"]
    torch.testing.assert_close(together["b"][0], alone[0], atol=1e-5, rtol=1e-5)
    assert (together["b"][0] - together["a"][0]).abs().max() > 0.1


def test_edits_batched_as_alone(pair: tuple[diffusers.GlmImagePipeline, GlmImagePipeline]
                                ) -> None:
    """Two edits whose condition images differ in size (24 and 16 patches, so the shorter
    one's keys are padded and masked), one with CFG and two images to draw, end in one
    batch where each ends alone."""
    _, ours = pair
    g = torch.Generator().manual_seed(4)
    jobs = {"a": (PROMPT, DiffusionParams(height=64, width=64, num_inference_steps=3, seed=1,
                                          guidance_scale=1.5, num_images=2,
                                          image=png(96, 64, 1)), [(2, 3)]),
            "b": (OTHER, DiffusionParams(height=64, width=64, num_inference_steps=3, seed=2,
                                         image=png(64, 64, 2)), [(2, 2)])}

    def conditioning(grids: list[tuple[int, int]]) -> dict[str, Tensor]:
        return {"token_ids": torch.randint(0, CODEBOOK, (5,), generator=g),
                "condition_token_ids": torch.randint(0, CODEBOOK, (sum(h * w for h, w in grids),),
                                                     generator=g),
                "condition_grids": torch.tensor(grids)}

    conds = {rid: conditioning(job[2]) for rid, job in jobs.items()}

    def drive(engine: DiffusionEngine, rids: list[str]) -> dict[str, DiffusionParams]:
        for rid in rids:
            engine.add_request(rid, jobs[rid][0], jobs[rid][1], parked=True)
            engine.set_conditioning(rid, conds[rid])
        return {rid: jobs[rid][1] for rid in rids}

    together, engine = run_recording_latents(ours, lambda e: drive(e, ["a", "b"]))
    assert engine.num_steps_run == 3                     # every step a batch of both
    for rid in jobs:
        alone = run_recording_latents(ours, lambda e: drive(e, [rid]))[0][rid]
        torch.testing.assert_close(together[rid][0], alone[0], atol=1e-5, rtol=1e-5)
    assert (together["a"][0][0] - together["b"][0][0]).abs().max() > 0.1


def test_bad_input(pair: tuple[diffusers.GlmImagePipeline, GlmImagePipeline]) -> None:
    _, ours = pair
    p = params(1.5)
    tokens = ar_tokens(0)
    with pytest.raises(ValueError, match=r"at least 253 integer tokens.*2x3 image"):
        ours.check_conditioning({"token_ids": tokens[:200]}, p)
    with pytest.raises(ValueError, match="outside the codebook"):
        ours.check_conditioning({"token_ids": tokens * 0 + CODEBOOK}, p)
    with pytest.raises(ValueError, match=r"expected tensors \['token_ids'\]"):
        ours.check_conditioning({"prompt_embeds": torch.zeros(2, 16)}, p)
    engine = DiffusionEngine(ours)
    with pytest.raises(ValueError, match="negative_prompt"):
        engine.add_request("n", PROMPT, DiffusionParams(height=H, width=W, negative_prompt="x",
                                                        true_cfg_scale=2.0), parked=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        engine.add_request("s", PROMPT, DiffusionParams(height=H + 16, width=W), parked=True)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("e", " ", params(1.5), parked=True)
    with pytest.raises(ValueError, match="strength"):
        engine.add_request("t", PROMPT, replace(params(1.5), image=png(64, 64, 1),
                                                strength=0.5), parked=True)


def test_bad_edit_conditioning(pair: tuple[diffusers.GlmImagePipeline, GlmImagePipeline]
                               ) -> None:
    """An edit's conditioning needs its condition images' tokens, one grid per image, each
    grid half the image's DiT patches."""
    _, ours = pair
    edit = DiffusionParams(height=64, width=64, image=png(96, 64, 1))
    tokens = torch.arange(5)                  # a 2x2 target grid, then the end token
    grid = {"condition_token_ids": torch.arange(6), "condition_grids": torch.tensor([[2, 3]])}
    with pytest.raises(ValueError, match=r"expected tensors \['condition_grids'"):
        ours.check_conditioning({"token_ids": tokens}, edit)
    with pytest.raises(ValueError, match=r"expected \(1, 2\) for 1 condition images"):
        ours.check_conditioning({"token_ids": tokens, **grid,
                                 "condition_grids": torch.tensor([[2, 3], [1, 1]])}, edit)
    with pytest.raises(ValueError, match="at least 6 integer tokens"):
        ours.check_conditioning({"token_ids": tokens, **grid,
                                 "condition_token_ids": torch.arange(4)}, edit)
    with pytest.raises(ValueError, match="do not cover the 64x96 px"):
        ours.check_conditioning({"token_ids": tokens, "condition_token_ids": torch.arange(4),
                                 "condition_grids": torch.tensor([[2, 2]])}, edit)
    cond = ours.check_conditioning({"token_ids": tokens, **grid}, edit)
    assert cond["prior_token_ids"].shape == (1, 16)
    assert cond["image_kv"].shape == (2, 2, 24, 2, 8)        # (L, 2, 4x6 patches, H, hd)
