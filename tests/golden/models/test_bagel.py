"""Golden: our BAGEL (omnistage/models/bagel/) against the upstream code's own outputs
(ByteDance-Seed/Bagel at the commit in tests/fixtures/bagel/manifest.json, run in float32 by
scripts/bagel_fixtures.py) on the same tiny seeded checkpoint, loaded by our loader from the
checkpoint folder's layout: greedy tokens identical, latents within float32 tolerance."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.bagel.generate import (FlowOptions, SpecialTokens, build_contexts,
                                             decode_image, denoise, greedy_text, initial_noise,
                                             latent_grid, to_pixels)
from omnistage.models.bagel.model import Bagel
from tests.helpers.bagel import expected, manifest, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")


@pytest.fixture(scope="module")
def loaded(ckpt):
    return Bagel.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def ref():
    return manifest(), expected()


def _tokens(m: dict) -> SpecialTokens:
    s = m["special_tokens"]
    return SpecialTokens(s["bos_token_id"], s["eos_token_id"], s["start_of_image"],
                         s["end_of_image"])


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))    # the fixtures' byte-level tokenizer


@pytest.mark.parametrize("case", ["text", "vlm"])
def test_greedy_tokens_equal_upstream(loaded, ref, case):
    model, vae = loaded
    m, exp = ref
    c, tok = m["cases"][case], _tokens(m)
    segments = [_ids(c["prompt"])]
    if case == "vlm":
        segments.insert(0, to_pixels(exp["vlm.image"]))
    ctxs = build_contexts(model, vae, segments, tok, with_vae=False)
    ours = greedy_text(model, ctxs.main, tok, c["max_think_token_n"] - 1)
    want = exp[f"{case}.tokens"].tolist()
    assert want[0] == tok.bos    # the upstream returns the start token first
    assert ours == want[1:], (ours, want)


def _flow(model, vae, m, exp, case):
    c, tok = m["cases"][case], _tokens(m)
    opts = FlowOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()
                          if k in FlowOptions.__dataclass_fields__})
    gen = torch.Generator().manual_seed(c["seed"])
    segments = [_ids(c["prompt"])]
    if case == "edit":
        segments.insert(0, to_pixels(exp["edit.input_image"]))
    ctxs = build_contexts(model, vae, segments, tok, with_vae=True, generator=gen)
    hw = latent_grid(model, *c["image_hw"])
    noise = initial_noise(model, hw, gen)
    latents = denoise(model, ctxs, hw, noise, opts, tok)
    return noise, latents, decode_image(model, vae, latents, hw)


@pytest.mark.parametrize("case", ["t2i", "edit"])
def test_flow_latents_match_upstream(loaded, ref, case):
    model, vae = loaded
    m, exp = ref
    noise, latents, image = _flow(model, vae, m, exp, case)
    assert torch.equal(noise, exp[f"{case}.noise"])
    want = exp[f"{case}.latents"]
    assert want.abs().mean() > 0.5 and (want - noise).abs().mean() > 0.3   # not a no-op
    torch.testing.assert_close(latents, want, rtol=1e-4, atol=1e-4)
    diff = (image.int() - exp[f"{case}.image"].int()).abs()
    assert diff.max() <= 1, diff.max()


def test_edit_vae_posterior_matches_upstream(loaded, ref):
    _, vae = loaded
    m, exp = ref
    gen = torch.Generator().manual_seed(m["cases"]["edit"]["seed"])
    z = vae.normalize(vae.sample_latents(to_pixels(exp["edit.input_image"])[None], gen))
    torch.testing.assert_close(z, exp["edit.vae_latent"], rtol=1e-4, atol=1e-5)


def test_a_model_without_its_generation_expert_fails(ckpt, ref):
    """The comparison catches a plausible bug: gen rows run through the und expert."""
    model, vae = Bagel.from_pretrained(ckpt)
    state = model.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_moe_gen" in name:
                p.copy_(state[name.replace("_moe_gen", "")])
    m, exp = ref
    _, latents, _ = _flow(model, vae, m, exp, "t2i")
    assert not torch.allclose(latents, exp["t2i.latents"], rtol=1e-4, atol=1e-4)
