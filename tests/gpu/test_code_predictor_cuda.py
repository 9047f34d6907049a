"""GPU-only: Qwen3-Omni's code predictor replayed as CUDA graphs equals its eager run (greedy
and sampled with the same seeded generators, batches that fill and that pad a bucket)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.qwen3_omni.code_predictor import CodePredictorGraphs
from omnistage.models.qwen3_omni.talker import Qwen3OmniTalkerForCausalLM
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def no_tf32():
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul


def test_code_predictor_graphs_equal_eager(tmp_path: Path) -> None:
    """float32: a padded bucket runs other GEMM shapes than the eager batch, which in bf16
    could round a near-tie the other way; in float32 the codes agree."""
    dtype = torch.float32
    ckpt = build_tiny_qwen3_omni(tmp_path / "omni", with_processor=False)
    talker = Qwen3OmniTalkerForCausalLM.from_pretrained(ckpt, "cuda", dtype).eval()
    predictor = talker.code_predictor
    hidden = talker.config.model.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    graphs = CodePredictorGraphs(predictor, 8, torch.device("cuda"), dtype)
    for b in (1, 3, 8, 3):                   # 3 pads bucket 4; the second 3 replays it
        past = torch.randn(b, hidden, device="cuda", generator=g).to(dtype)
        code0 = torch.randint(0, 64, (b,), device="cuda", generator=g)
        for greedy in (True, False):
            def run() -> tuple[torch.Tensor, torch.Tensor]:
                gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(b)]
                return talker.predict_codes(past, code0, greedy=greedy, temperature=1.3,
                                            generators=gens)
            predictor.graphs = None
            codes, embeds = run()
            predictor.graphs = graphs
            graph_codes, graph_embeds = run()
            assert torch.equal(graph_codes, codes), (b, greedy)
            torch.testing.assert_close(graph_embeds, embeds, atol=1e-5, rtol=1e-5)
    assert graphs.num_replays == 8 and set(graphs.graphs) == {
        (1, True), (1, False), (4, True), (4, False), (8, True), (8, False)}
