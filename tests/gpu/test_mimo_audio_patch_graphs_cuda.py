"""MiMo-Audio's patch decoder from CUDA graphs (`stages/mimo_audio.patch_graphs`, the stage's
default on CUDA) against the same tensor decode run eagerly, and that eager decode against the
per-row draws of `decode_patches` (seeded rows: the same ids), on the tiny fixture checkpoint:
ids identical at the buckets' own sizes; at sizes padded to a bucket (3, 5) equal to the eager decode of the
rows padded to that bucket (a padded batch may take other matmul kernels; rows never mix)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM, _drawer
from omnistage.models.mimo_audio.patch_graphs import RowSampling, decode_rows, row_sampling
from omnistage.sampling_params import SamplingParams
from omnistage.stages.mimo_audio import patch_graphs

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("no_tf32")]
TINY = Path(__file__).resolve().parents[1] / "fixtures" / "mimo_audio" / "tiny"


class _Seq:
    def __init__(self, i: int) -> None:
        temperature = (0.0, 0.9, 1.3)[i % 3]
        self.sampling_params = SamplingParams(temperature=temperature, top_k=8 * (i % 2),
                                              top_p=0.9, seed=10 + i)
        self.generator = torch.Generator(device="cuda").manual_seed(10 + i)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, torch.zeros_like(t[:1]).expand(rows - t.shape[0], *t.shape[1:])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_graphs_equal_eager(dtype: torch.dtype) -> None:
    model = MiMoAudioForCausalLM.from_pretrained(TINY, 7, "cuda", dtype)
    graphs = patch_graphs(model, 8, torch.device("cuda"), dtype)
    assert graphs is not None and sorted(graphs.sampled.graphs) == [1, 2, 4, 8]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for b in (1, 2, 3, 4, 5, 8):
        x = torch.randn(b, model.hidden_states_downcast.weight.shape[0], device="cuda",
                        generator=gen).to(dtype)
        with torch.inference_mode():
            for sampled in (False, True):
                s = row_sampling(model, [_Seq(i) for i in range(b)], x.device) \
                    if sampled else None
                eager, replayed = decode_rows(model, x, s), graphs(x, s)
                bs = next(n for n in graphs.sampled.sizes if n >= b)
                padded = decode_rows(model, _pad(x, bs), None if s is None else
                                     RowSampling(*(_pad(t, bs) for t in s)))[:b]
                assert torch.equal(padded, replayed), (b, sampled)
                if b == bs:
                    assert torch.equal(eager, replayed), (b, sampled)
            ref = model.decode_patches(x, [_drawer(_Seq(i)) for i in range(b)])
            assert torch.equal(eager, ref), b
