"""Voxtral-TTS's flow head from CUDA graphs (`stages/voxtral_tts.head_graphs`, the stage's
default on CUDA) against the same head run eagerly, on the tiny release-layout checkpoint:
frames identical at the buckets' own sizes, and at sizes padded to a bucket (3, 5) the
semantic codes identical and the acoustic levels at most one level apart (a padded batch may
take other matmul kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.voxtral_tts.head import VoxtralFlowHead
from omnistage.stages.voxtral_tts import head_graphs

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]
TINY = Path(__file__).resolve().parents[1] / "fixtures" / "voxtral_tts" / "tiny"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_graphs_equal_eager(dtype: torch.dtype) -> None:
    head = VoxtralFlowHead.from_pretrained(TINY, "cuda").to(dtype)
    graphs = head_graphs(head, 8, torch.device("cuda"), dtype)
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    before = graphs.num_replays                 # head_graphs' own check replayed once
    gen = torch.Generator(device="cuda").manual_seed(3)
    for b in (1, 2, 3, 4, 5, 8):
        h = torch.randn(b, head.cfg.input_dim, device="cuda", generator=gen).to(dtype)
        alpha = torch.linspace(1.0, 2.0, b, device="cuda").to(dtype)
        noise = torch.randn(b, head.cfg.n_acoustic_codebook, device="cuda",
                            generator=gen).to(dtype)
        with torch.inference_mode():
            eager, replayed = head(h, alpha, noise), graphs(h, alpha, noise)
        if b in graphs.graphs:
            assert torch.equal(eager, replayed), b
        else:
            assert torch.equal(eager[:, 0], replayed[:, 0]), b
            assert (eager - replayed).abs().max() <= 1, b
    assert graphs.num_replays - before == 6
