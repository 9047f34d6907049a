"""The text-encoding engine (a split graph's text-encoder stage) with a fake encoder: a
batch whose encoding raises is encoded again per request, so one bad prompt fails alone."""

from __future__ import annotations

import torch

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.text_encoding import TextEncodingEngine


class FakeEncoder:
    """One embedding per prompt (its length), raising for any batch holding "poison"."""

    device = torch.device("cpu")

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        pass

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, torch.Tensor]]:
        if "poison" in prompts:
            raise RuntimeError("poisoned prompt")
        return [{"prompt_embeds": torch.full((1, 4), float(len(p)))} for p in prompts]


def test_a_poisoned_prompt_fails_alone() -> None:
    engine = TextEncodingEngine(FakeEncoder())
    for rid, prompt in (("a", "one"), ("bad", "poison"), ("b", "three")):
        engine.add_request(rid, prompt, DiffusionParams())
    results = {r.request_id: r for r in engine.step()}
    assert "poisoned prompt" in str(results["bad"].error) and not results["bad"].tensors
    assert results["a"].error is None and results["a"].tensors["prompt_embeds"][0, 0] == 3
    assert results["b"].error is None and results["b"].tensors["prompt_embeds"][0, 0] == 5
    assert not engine.has_unfinished_requests
