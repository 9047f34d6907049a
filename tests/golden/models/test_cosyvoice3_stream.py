"""Golden: CosyVoice3's streamed decode (generation/cosyvoice3.py, the stage's default) against
upstream's own `CosyVoice3Model.tts(stream=True)` (scripts/cosyvoice3_fixtures.py, the commit
in tests/fixtures/cosyvoice3/manifest.json): the tiny flow + HiFT, the LM's tokens fed one per
step as the LM stage writes them, every chunk within 1e-4 of upstream's; two requests at
different chunks in one step; a request shorter than one hop; `stream: false` and the
difference between upstream's stream and its whole decode (measured, not zero); the LM's
chunks piled up on the edge (stages/cosyvoice3_edge.py) through the generation engine."""

from __future__ import annotations

import pytest
import torch

import omnistage.generation.cosyvoice3 as gen
from omnistage.generation.cosyvoice3 import CosyVoice3FlowOptions, CosyVoice3Generator
from omnistage.generation.engine import GenerationEngine
from omnistage.models.cosyvoice3.model import CosyVoice3
from omnistage.payloads import AudioChunk, Payload, TokenDelta, VoicePrompt
from omnistage.stages.adapters import EdgeData
from omnistage.stages.cosyvoice3_edge import tokens as edge_tokens
from tests.helpers.cosyvoice3 import FIXTURES, manifest, write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return CosyVoice3.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("cosyvoice3")))


@pytest.fixture(scope="module")
def ref():
    return torch.load(FIXTURES / "stream.pt", map_location="cpu", weights_only=True)


@pytest.fixture(autouse=True)
def one_thread():
    """The vocoder integrates f0 phase over the utterance: run as the stage processes do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _generator(model, **kw) -> CosyVoice3Generator:
    s = manifest()["stream"]
    opts = CosyVoice3FlowOptions(token_hop_len=s["token_hop_len"], noise_seed=s["noise_seed"],
                                 token_max_hop_len=s["token_max_hop_len"], **kw)
    return CosyVoice3Generator(model, torch.device("cpu"), opts)


def _feeds(ref: dict, case: str) -> list[dict]:
    """What the LM stage sends: one token a step, the voice on the first."""
    voice = VoicePrompt(ref[f"{case}.prompt_token"][0], ref[f"{case}.prompt_feat"][0],
                        ref[f"{case}.embedding"][0])
    return [Payload(tokens=TokenDelta([t]), voice_prompt=voice if i == 0 else None).pack()
            for i, t in enumerate(ref[f"{case}.token"][0].tolist())]


def _run(g: CosyVoice3Generator, streams: dict[str, list[dict]], starts: dict[str, int]
         ) -> dict[str, list[tuple[bool, torch.Tensor]]]:
    """Steps the requests together as the engine does (request r joins at step starts[r]);
    each request's chunks as (its input still open, samples)."""
    states = {r: {} for r in streams}
    out: dict[str, list] = {r: [] for r in streams}
    step = 0
    while states:
        names, inputs, last = [], [], []
        for r, state in states.items():
            i = step - starts[r]
            if i < 0:
                continue
            feeds = streams[r]
            names.append(r)
            inputs.append(feeds[i] if i < len(feeds) else {})
            last.append(i >= len(feeds) - 1)
        for r, x, closed in zip(names, g.generate(inputs, [states[r] for r in names], last),
                                last):
            if x:
                out[r].append((not closed, AudioChunk.unpack(x).samples))
            if closed and not g.has_backlog(states[r]):
                del states[r]
        step += 1
    return out


def _want(ref: dict, case: str) -> list[torch.Tensor]:
    n = sum(k.startswith(f"{case}.chunk") for k in ref)
    return [ref[f"{case}.chunk{i}"] for i in range(n)]


def _check(got: list[tuple[bool, torch.Tensor]], want: list[torch.Tensor]) -> None:
    chunks = [w for _, w in got if w.numel()]
    assert [c.shape for c in chunks] == [w.shape for w in want]
    for i, (c, w) in enumerate(zip(chunks, want)):
        assert w.pow(2).mean().sqrt() > 0.1 and (w.abs() < 0.98).float().mean() > 0.5, \
            f"upstream's chunk {i} is near zero or mostly clamped"
        torch.testing.assert_close(c, w, atol=1e-4, rtol=1e-4, msg=f"chunk {i}")


def test_streamed_chunks_equal_upstream_and_start_before_the_lm_ends(model, ref):
    got = _run(_generator(model), {"long": _feeds(ref, "long")}, {"long": 0})["long"]
    _check(got, _want(ref, "long"))
    assert len(_want(ref, "long")) == 4
    assert sum(open_ for open_, _ in got) >= 2, "no chunk came while the LM still wrote"


def test_requests_at_different_chunks_share_a_step(model, ref, monkeypatch):
    """Two long requests 8 steps apart and a short one, in the same calls: every one equals
    upstream's alone, and a flow call held all three at different chunks (step 17: a's
    second chunk, b's first, c's whole decode)."""
    calls = []
    real = gen.token2mel

    def spy(flow, inputs, *args):
        calls.append([(len(i.tokens), i.finalize) for i in inputs])
        return real(flow, inputs, *args)

    monkeypatch.setattr(gen, "token2mel", spy)
    long = _feeds(ref, "long")
    got = _run(_generator(model), {"a": long, "b": long, "c": _feeds(ref, "short")},
               {"a": 0, "b": 8, "c": 15})
    _check(got["a"], _want(ref, "long"))
    _check(got["b"], _want(ref, "long"))
    _check(got["c"], _want(ref, "short"))
    assert [(18, False), (10, False), (3, True)] in calls, calls


def test_a_request_shorter_than_a_hop_is_its_whole_decode(model, ref):
    got = _run(_generator(model), {"s": _feeds(ref, "short")}, {"s": 0})["s"]
    assert [o for o, _ in got] == [False]
    _check(got, _want(ref, "short"))
    torch.testing.assert_close(got[0][1], ref["short.whole"], atol=1e-4, rtol=1e-4)


def test_stream_false_is_upstreams_whole_decode_which_the_stream_is_not(model, ref):
    """`stream: false`: one chunk, upstream's stream=False. Upstream's own stream differs
    from it (earlier mel made with the DiT's chunk mask and less look-ahead): on this tiny
    random model by an RMS of about 0.37 (waveform RMS about 0.53); ours by the same."""
    got = _run(_generator(model, stream=False), {"w": _feeds(ref, "long")}, {"w": 0})["w"]
    assert len(got) == 1 and not got[0][0]
    whole = ref["long.whole"]
    torch.testing.assert_close(got[0][1], whole, atol=1e-4, rtol=1e-4)
    stream = torch.cat(_want(ref, "long"))
    upstream_gap = (stream - whole).pow(2).mean().sqrt()
    assert upstream_gap > 1e-2, "the stream's chunks would not tell stream from whole"
    ours = _run(_generator(model), {"s": _feeds(ref, "long")}, {"s": 0})["s"]
    ours_gap = (torch.cat([w for _, w in ours]) - got[0][1]).pow(2).mean().sqrt()
    torch.testing.assert_close(ours_gap, upstream_gap, atol=1e-4, rtol=1e-3)


def test_a_wrong_hop_schedule_fails_the_comparison(model, ref):
    """A plausible bug (no growing hop) gives other chunks: the test sees it."""
    got = _run(_generator(model, stream_scale_factor=1), {"l": _feeds(ref, "long")},
               {"l": 0})["l"]
    with pytest.raises(AssertionError):
        _check(got, _want(ref, "long"))


def test_chunks_piled_up_on_the_edge_stream_the_same(model, ref):
    """Through the edge adapter (stages/cosyvoice3_edge.py) and the generation engine, five
    LM chunks at a time (the first with the voice, later ones without): the same chunks."""
    engine = GenerationEngine(_generator(model))
    engine.add_request("r")
    edge: dict = {}
    got = []
    for i, x in enumerate(_feeds(ref, "long")):
        feed = edge_tokens(EdgeData("r", "llm", i, False, payload=Payload.unpack(x)), edge)
        engine.feed("r", feed.payload.pack(), close=False)
        if i % 5 == 4:
            got += [res.tensors for res in engine.step()]
    engine.feed("r", None, close=True)
    while engine.has_unfinished_requests:
        got += [res.tensors for res in engine.step()]
    _check([(True, AudioChunk.unpack(t).samples) for t in got if t], _want(ref, "long"))
