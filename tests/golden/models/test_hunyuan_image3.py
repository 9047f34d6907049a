"""HunyuanImage-3.0 text-to-image on our layers against the upstream code
(Tencent-Hunyuan/HunyuanImage-3.0 at the commit tests/fixtures/hunyuan_image3/manifest.json
names; scripts/hunyuan_image3_fixtures.py made the fixtures): the same tiny random checkpoint,
the upstream template's token ids and initial noise -> the final latents and the decoded image
in float32."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.hunyuan_image3 import HunyuanImage3, generate_image
from tests.helpers.hunyuan_image3 import build_checkpoint, expected, manifest
from tests.helpers.hunyuan_image3 import case_request as request


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return HunyuanImage3.from_pretrained(build_checkpoint(tmp_path_factory.mktemp("hi3")))


def final_latents(exp: dict, name: str, vae) -> torch.Tensor:
    return (exp[f"{name}.vae_input"][:, :, 0] - vae.shift_factor) * vae.scaling_factor


@pytest.mark.parametrize("name", ["wide", "square"])
def test_latents_and_image_match_upstream(model, name: str) -> None:
    case, exp = manifest()["cases"][name], expected()
    latents, image = generate_image(model, request(case, exp[f"{name}.noise"], model.cfg))
    want = final_latents(exp, name, model.cfg.vae)
    assert want.abs().mean() > 0.5 and (want - exp[f"{name}.noise"]).abs().mean() > 0.3
    torch.testing.assert_close(latents, want, atol=2e-4, rtol=1e-4)
    want_image = exp[f"{name}.image"][:, :, 0]
    assert want_image.abs().mean() > 0.1
    torch.testing.assert_close(image, want_image, atol=2e-4, rtol=1e-4)


def test_guidance_and_prompt_matter(model) -> None:
    """A plausible bug must fail: another guidance or the unconditional prompt everywhere
    moves the latents far outside the tolerance above."""
    case, exp = manifest()["cases"]["wide"], expected()
    want = final_latents(exp, "wide", model.cfg.vae)
    for over in (dict(guidance_scale=1.0),
                 dict(tokens=torch.tensor([case["tokens"][1]] * 2))):
        latents, _ = generate_image(model, request(case, exp["wide.noise"], model.cfg, **over))
        assert (latents - want).abs().max() > 1e-2, over


def test_greedy_text_matches_upstream(model) -> None:
    """The text the model writes before an image (bot_task think): the upstream's greedy tokens
    through transformers' generate, token for token."""
    from omnistage.models.hunyuan_image3.text import greedy_text

    case = manifest()["cases"]["text"]
    got = greedy_text(model, torch.tensor(case["tokens"]), case["max_new_tokens"],
                      tuple(case["stop_ids"]))
    assert got == case["generated"][0] and len(set(got)) > 2


def test_ratio_answer_matches_upstream(model) -> None:
    """image_size "auto": our ratio prompt is the upstream's, and its greedy token too."""
    from transformers import AutoTokenizer

    from omnistage.models.hunyuan_image3.template import build_ratio_prompt
    from omnistage.models.hunyuan_image3.text import greedy_text
    from tests.helpers.hunyuan_image3 import FIXTURES

    tok = AutoTokenizer.from_pretrained(str(FIXTURES))
    for row in manifest()["cases"]["ratio"]["rows"]:
        ids = build_ratio_prompt(lambda s: tok.encode(s, add_special_tokens=False),
                                 tok.convert_tokens_to_ids, tok.bos_token_id, row["prompt"],
                                 model.cfg.image_base_size)
        assert ids[0].tolist() == row["tokens"]
        assert greedy_text(model, ids, 1) == [row["token"]]
