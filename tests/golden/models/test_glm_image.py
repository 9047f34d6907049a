"""Golden: our GLM-Image AR model (text decoder, visual head) vs transformers'
`GlmImageForConditionalGeneration` on tiny random weights, float32, with the multimodal
(t, h, w) positions it generates image tokens at: prefill and chunked decode through the
paged cache give the same logits; our AR engine's greedy tokens (batched, eager or from
emulated decode graphs) equal `generate`'s. (The image tokenizer an edit's prompt goes through
is checked against transformers in tests/golden/stages/test_glm_image.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import MultimodalInput
from omnistage.layers import graph_capture
from omnistage.layers.attention import forward_context
from omnistage.models.glm_image import GlmImageForConditionalGeneration, image_decode_positions
from omnistage.sampling_params import SamplingParams
from omnistage.testing.ar_ranks import engine_config
from omnistage.testing.graph_emulation import emulate_decode_graphs, rerun_capture
from omnistage.testing.tiny_models import PagedCache

transformers = pytest.importorskip("transformers")

VISION_VOCAB = 80


def build(path: Path) -> transformers.GlmImageForConditionalGeneration:
    torch.manual_seed(0)
    cfg = transformers.GlmImageConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vision_vocab_size=VISION_VOCAB, pad_token_id=0, eos_token_id=65,
                         max_position_embeddings=512,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=[2, 1, 1],
                                              partial_rotary_factor=0.5)),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                           patch_size=4, image_size=64),
        vq_config=dict(embed_dim=8, num_embeddings=64, latent_channels=16),
        image_token_id=299, image_start_token_id=64, image_end_token_id=65)
    ref = transformers.GlmImageForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # norms away from 1, weights larger than HF's 0.02: every
        for name, p in ref.named_parameters():   # path shows in the logits
            if "layernorm" in name or name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.2)
    ref.save_pretrained(path)
    return ref


def positions() -> Tensor:
    """(3, 14): 8 text tokens, then a 2x3 grid of image tokens at rows/columns offset from 8."""
    text = torch.arange(8).expand(3, -1)
    rows = 8 + torch.arange(2).repeat_interleave(3)
    cols = 8 + torch.arange(3).repeat(2)
    return torch.cat([text, torch.stack([torch.full((6,), 8), rows, cols])], dim=1)


def test_prefill_and_decode_match_transformers(tmp_path: Path) -> None:
    ref = build(tmp_path)
    ours = GlmImageForConditionalGeneration.from_pretrained(tmp_path, "cpu", torch.float32)
    ids = torch.randint(0, 300, (14,), generator=torch.Generator().manual_seed(1))
    pos = positions()
    with torch.no_grad():
        expected = ref(input_ids=ids[None], position_ids=pos[:, None]).logits[0]   # (14, V)
    assert expected.shape[-1] == VISION_VOCAB and expected.std() > 0.5
    cache = PagedCache(ours, block_size=4)
    got = []
    for start, n in ((0, 9), (9, 1), (10, 4)):          # prefill, then decode and a chunk
        md, _ = cache.step([(0, n)])
        with torch.no_grad(), forward_context(md):
            hidden, _ = ours(ids[start:start + n], pos[:, start:start + n])
        got.append(ours.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-4)
    with torch.no_grad():           # the image positions matter: plain 1-D ones differ
        plain = ref(input_ids=ids[None], position_ids=torch.arange(14)[None, None].expand(3, 1, -1)
                    ).logits[0]
    assert (plain[8:] - expected[8:]).abs().max() > 1e-3


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_engine_greedy_equals_transformers_generate(tmp_path: Path, graphs: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two text-to-image prompts batched in our AR engine (paged cache, chunked prefill;
    decodes eager, or replayed from emulated CUDA graphs) write the same image tokens as
    transformers' greedy `generate` for each alone, at the grid positions of a 2x3 target
    after a 3x2 preview."""
    ref = build(tmp_path)
    ref.generation_config.eos_token_id = None       # the whole grid, as ignore_eos
    grids = [(3, 2), (2, 3)]                        # written order: preview, target
    num_new = 6 + 6 + 1
    prompts = {"a": [5, 17, 42, 99, 7, 250, 3, 11, 64], "b": [8, 120, 33, 64]}
    expected = {}
    for rid, ids in prompts.items():
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), image_grid_thw=torch.tensor(
                [[1, 2, 3], [1, 3, 2]]), max_new_tokens=num_new, do_sample=False)
        expected[rid] = out[0, len(ids):].tolist()
    engine = ar_engine(tmp_path, graphs, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        mm = MultimodalInput(decode_positions=image_decode_positions(len(ids), grids))
        engine.add_request(rid, ids, params, mm=mm)
    for _ in range(100):
        if not engine.has_unfinished_requests:
            break
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got == expected
    assert len(set(expected["a"])) > 3, "greedy should not repeat one token"
    assert not graphs or engine.runner.graphs.num_replays > 5


def ar_engine(path: Path, graphs: bool, monkeypatch: pytest.MonkeyPatch) -> AREngine:
    def load(p: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
        model = GlmImageForConditionalGeneration.from_pretrained(p, device, dtype)
        return model, model.model_config, None

    engine = AREngine(engine_config(str(path), 1 << 20, max_num_batched_tokens=8), loader=load)
    if graphs:
        monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
        emulate_decode_graphs(engine)
    return engine


def test_decode_positions_layout_and_bad_input() -> None:
    """A 1x2 preview then a 2x2 target after 5 prompt tokens, as transformers lays them out;
    malformed decode positions are refused by name."""
    pos = image_decode_positions(5, [(1, 2), (2, 2)])
    assert pos.tolist() == [[5, 5, 7, 7, 7, 7, 9], [5, 5, 7, 7, 8, 8, 9], [5, 6, 7, 8, 7, 8, 9]]
    with pytest.raises(ValueError, match=r"decode_positions: expected integer \(3, G\)"):
        MultimodalInput(decode_positions=torch.zeros(2, 4, dtype=torch.long)).check(5)
    with pytest.raises(ValueError, match="decode_positions"):
        MultimodalInput(decode_positions=torch.zeros(3, 4)).check(5)
