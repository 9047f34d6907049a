"""Golden: BAGEL's think mode (the upstream `interleave_inference(think=True)`, an image answer
planned in text first) on our model (omnistage/models/bagel/generate.py) against the upstream
code's own outputs (tests/fixtures/bagel/, case `think`, scripts/bagel_fixtures.py) on the same
tiny seeded checkpoint: the planning tokens identical, the latents within float32 tolerance,
the image within 1/255. The planning answer re-enters as text, decoded and encoded again, as
the upstream does: with the fixtures' byte tokenizer its ids >= 128 become two bytes each, so
feeding the ids as they are fails (checked)."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.bagel.generate import (GEN_THINK_SYSTEM_PROMPT, FlowOptions,
                                             SpecialTokens, add_thought, build_contexts,
                                             decode_image, denoise, greedy_text, initial_noise,
                                             latent_grid, thought_text)
from omnistage.models.bagel.model import Bagel
from tests.helpers.bagel import ByteTokenizer, expected, manifest, write_checkpoint


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return Bagel.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("bagel") / "tiny"))


def _think(model, vae, reencode: bool = True):
    m, exp = manifest(), expected()
    c, s = m["cases"]["think"], m["special_tokens"]
    tok = SpecialTokens(s["bos_token_id"], s["eos_token_id"], s["start_of_image"],
                        s["end_of_image"])
    bt = ByteTokenizer(s)
    opts = FlowOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()
                          if k in FlowOptions.__dataclass_fields__})
    gen = torch.Generator().manual_seed(c["seed"])
    ctxs = build_contexts(model, vae, [bt.encode(GEN_THINK_SYSTEM_PROMPT), bt.encode(c["prompt"])],
                          tok, with_vae=True, generator=gen)
    answer = greedy_text(model, ctxs.main, tok, c["max_think_token_n"] - 1)
    thought = bt.encode(thought_text(bt, answer, tok)) if reencode else answer
    add_thought(model, ctxs.main, thought, tok)
    hw = latent_grid(model, *c["image_hw"])
    noise = initial_noise(model, hw, gen)
    latents = denoise(model, ctxs, hw, noise, opts, tok)
    return exp, tok, answer, noise, latents, decode_image(model, vae, latents, hw)


def test_think_tokens_and_latents_match_upstream(loaded):
    exp, tok, answer, noise, latents, image = _think(*loaded)
    want = exp["think.tokens"].tolist()
    assert want[0] == tok.bos and max(want) >= 128      # a round trip that changes the ids
    assert answer == want[1:], (answer, want)
    assert torch.equal(noise, exp["think.noise"])
    ref = exp["think.latents"]
    assert ref.abs().mean() > 0.5 and (ref - noise).abs().mean() > 0.3
    torch.testing.assert_close(latents, ref, rtol=1e-4, atol=1e-4)
    assert (image.int() - exp["think.image"].int()).abs().max() <= 1


def test_thought_fed_as_ids_fails(loaded):
    """A plausible bug: the answer's ids fed back as they are, not as the upstream's text."""
    exp, *_, latents, _ = _think(*loaded, reencode=False)
    assert not torch.allclose(latents, exp["think.latents"], rtol=1e-4, atol=1e-4)
