"""Moshi's duplex sessions sampling (stages/moshi_duplex.DuplexSampling; the depth
transformer's `draw`): the race draws from the tempered top-k softmax, temperature 0 is the
argmax; a seeded session's text and codes depend only on its seed (two sessions of one seed
in one batch agree, and agree with the session alone), differ from greedy, and the sampled
depth graphs (captures emulated on the CPU) equal the eager draw."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.moshi.depth import draw
from omnistage.stages.moshi_duplex import DuplexSampling, MoshiDuplex
from omnistage.testing.moshi_duplex import build_duplex_moshi

FRAME, TICKS = 1920, 6
SAMPLED = DuplexSampling(temperature=1.0, top_k=20, audio_temperature=1.0, audio_top_k=50,
                         seed=11)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = build_duplex_moshi(tmp_path_factory.mktemp("moshi_sampling") / "moshi")
    return path


def test_draw_follows_the_tempered_top_k_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(40000, -1)
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(40000, 5).exponential_(generator=gen)
    temp, top_k = torch.full((40000,), 0.7), torch.full((40000,), 3)
    counts = torch.bincount(draw(logits, temp, top_k, noise), minlength=5).float() / 40000
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 0.7, 0)
    assert counts[3:].sum() == 0                                   # outside the top 3: never
    assert torch.allclose(counts[:3], want, atol=0.01), (counts, want)
    greedy = draw(logits[:4], torch.zeros(4), torch.zeros(4, dtype=torch.long), noise[:4])
    assert greedy.tolist() == [0] * 4                              # temperature 0: argmax
    one = draw(logits[:4], torch.ones(4), torch.ones(4, dtype=torch.long), noise[:4])
    assert one.tolist() == [0] * 4                                 # top-k 1: argmax


def _run(duplex: MoshiDuplex, sessions: dict[str, DuplexSampling | None]) -> dict[str, list]:
    """Every session opened at tick 0 hearing the same script; per session per tick (text
    id, codes)."""
    for sid, sampling in sessions.items():
        duplex.open(sid, sampling)
    g = torch.Generator().manual_seed(3)
    script = [0.3 * torch.randn(FRAME, generator=g) for _ in range(TICKS)]
    got: dict[str, list] = {sid: [] for sid in sessions}
    for t in range(TICKS + 1):
        frames = {sid: script[t - 1] for sid in sessions} if t else {}
        for sid, out in duplex.tick(frames).items():
            got[sid].append((out.text_id, None if out.codes is None else out.codes.tolist()))
    for sid in sessions:
        duplex.close(sid)
    return got


def test_seeded_sessions_sample_by_their_seed_alone(checkpoint) -> None:
    duplex = MoshiDuplex(checkpoint, max_sessions=3, block_size=4, use_graphs=False)
    together = _run(duplex, {"greedy": None, "a": SAMPLED, "b": SAMPLED})
    assert together["a"] == together["b"]                          # one seed, one answer
    assert together["a"] != together["greedy"]
    alone = _run(MoshiDuplex(checkpoint, max_sessions=3, block_size=4, use_graphs=False),
                 {"a": SAMPLED})
    assert alone["a"] == together["a"]                             # the batch changes nothing
    other = _run(duplex, {"a": DuplexSampling(temperature=1.0, audio_temperature=1.0,
                                              audio_top_k=50, seed=12)})
    assert other["a"] != together["a"]
    flat = MoshiDuplex(checkpoint, max_sessions=3, block_size=4, use_graphs=False)
    with torch.no_grad():              # the tiny model's code logits are one-hot sharp:
        flat.model.depth_decoder.lm_heads.weight.mul_(0.02)       # flatten them to see draws
    audio_only = _run(flat, {"greedy": None, "a": DuplexSampling(audio_temperature=1.0,
                                                                 seed=11)})
    texts = [[t for t, _ in audio_only[sid]] for sid in ("greedy", "a")]
    codes = [[c for _, c in audio_only[sid]] for sid in ("greedy", "a")]
    assert codes[0] != codes[1]                                   # the codes are drawn
    assert texts[0][0] == texts[1][0]                             # the text is still argmax


def test_sampled_depth_graphs_equal_eager(checkpoint, monkeypatch) -> None:
    from omnistage.layers import graph_capture
    from omnistage.testing.graph_emulation import rerun_capture

    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    graphed = MoshiDuplex(checkpoint, max_sessions=3, block_size=4, use_graphs=True)
    sampled = graphed.model.depth_decoder.sampled_graphs
    assert sampled is not None and sorted(sampled.graphs) == [1, 2, 3]
    eager = MoshiDuplex(checkpoint, max_sessions=3, block_size=4, use_graphs=False)
    with torch.no_grad():                     # flat code logits: the draws show (see above)
        for d in (graphed, eager):
            d.model.depth_decoder.lm_heads.weight.mul_(0.02)
    got = _run(graphed, {"greedy": None, "a": SAMPLED})
    assert sampled.num_replays >= TICKS
    want = _run(eager, {"greedy": None, "a": SAMPLED})
    assert got == want
    assert [c for _, c in got["a"]] != [c for _, c in got["greedy"]]


def test_bad_sampling_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="audio_temperature"):
        DuplexSampling(audio_temperature=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        DuplexSampling(top_k=-2)
