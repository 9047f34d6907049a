"""Golden: the flow stage's speed options (generation/cosyvoice3.py, issue 43) against the float32
eager flow on the tiny CosyVoice3 of tests/fixtures/cosyvoice3 (itself within 1e-4 of upstream:
test_cosyvoice3.py). `flow_dtype: bfloat16`: the mel and waveform within a loose SNR of float32,
the Euler state still float32, and a coarser cast (weights through fp8) caught by the same bound.
Padding (what `cuda_graphs` replays): a batch padded in rows and frames gives each row its mel
alone, and without the DiT's length mask the padding leaks into it. `cuda_graphs` under an
emulated capture (a replay reruns the Euler steps on the graph's buffers): two streamed
requests at different chunks in the same flow calls get the eager chunks at the same padded
shapes bit for bit (and the unpadded ones within 1e-4, as upstream's), every call replayed."""

from __future__ import annotations

import copy

import pytest
import torch

import omnistage.generation.cosyvoice3 as gen
from omnistage.diffusion.pipelines.cosyvoice3 import CloneInput, fixed_noise, solve, token2mel
from omnistage.diffusion.solvers.cosine_euler import cosine_times
from omnistage.generation.cosyvoice3 import CosyVoice3FlowOptions, CosyVoice3Generator
from omnistage.layers import graph_capture
from omnistage.layers.graph_capture import PaddedShapes
from omnistage.models.cosyvoice3.hift import SourceNoise
from omnistage.models.cosyvoice3.model import CosyVoice3
from omnistage.payloads import AudioChunk, Payload, TokenDelta, VoicePrompt
from omnistage.testing.graph_emulation import rerun_capture
from tests.helpers.cosyvoice3 import FIXTURES, expected, manifest, write_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> CosyVoice3:
    return CosyVoice3.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("cosyvoice3")))


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _inputs() -> list[CloneInput]:
    """The fixtures' cases a (full attention) and b (the chunk mask), as one batch."""
    m, exp = manifest(), expected()
    return [CloneInput(exp[f"{c}.token"][0], exp[f"{c}.prompt_token"][0],
                       exp[f"{c}.prompt_feat"][0], exp[f"{c}.embedding"][0],
                       streaming=m["cases"][c]["streaming"]) for c in ("a", "b")]


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean()))


def _vocode(model: CosyVoice3, mel: torch.Tensor) -> torch.Tensor:
    h = model.cfg.hift
    noise = SourceNoise.seeded(0, mel.shape[0] * h.samples_per_frame, h.nb_harmonics + 1)
    return model.hift(mel.T[None], noise, True)[0].reshape(-1)


def test_bfloat16_flow_is_close_to_float32_and_a_coarser_cast_is_not(model):
    """bf16 DiT: mel about 48 dB from float32 here, waveform bounded likewise; the mel still
    float32 (the Euler state's dtype). The DiT's weights through float8 (a broken cast):
    about 29 dB, under the same bound."""
    inputs, noise = _inputs(), fixed_noise(model.cfg.flow.output_size)
    want = token2mel(model.flow, inputs, noise)
    half = copy.deepcopy(model)
    half.flow.compute_in(torch.bfloat16)
    assert half.flow.estimator.proj_out.weight.dtype == torch.bfloat16
    assert half.flow.estimator.rotary_embed.inv_freq.dtype == torch.float32
    got = token2mel(half.flow, inputs, noise)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and w.abs().max() > 1.0
        assert 35.0 < snr_db(g, w) < 80.0, snr_db(g, w)     # close, and not float32 itself
        wave_want = _vocode(model, w)
        assert wave_want.pow(2).mean().sqrt() > 0.05
        assert snr_db(_vocode(model, g), wave_want) > 15.0
    for p in half.flow.estimator.parameters():
        if p.dim() > 1:
            p.data = p.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    broken = token2mel(half.flow, inputs, noise)
    assert min(snr_db(g, w) for g, w in zip(broken, want)) < 35.0, "the bound sees a bad cast"


def test_a_padded_batch_gives_each_row_its_mel_alone(model):
    """Both cases padded to 4 rows of 64 frames (the padding rows: one frame each; the padded
    frames: noise) against each one alone, unpadded; the same Euler steps with every frame
    counted real (no length mask) move the real frames: the padding would leak."""
    inputs, noise = _inputs(), fixed_noise(model.cfg.flow.output_size)
    shapes = PaddedShapes((64,), 4 * 64, 4)
    seen = []

    def spy(x, mu, spks, cond, frames, streaming, times):
        seen.append((tuple(x.shape[:2]), frames.tolist(), streaming.tolist()))
        return solve(model.flow, x, mu, spks, cond, frames, streaming, times)

    padded = token2mel(model.flow, inputs, noise, shapes=shapes, solver=spy)
    (shape, frames, streaming), = seen
    assert shape == (2, 64) and frames[:2] == [24, 26] and streaming == [False, True]
    seen.clear()
    padded4 = token2mel(model.flow, inputs + inputs[:1], noise, shapes=shapes, solver=spy)
    assert seen[0][0] == (4, 64) and seen[0][1][3] == 1
    for i, inp in enumerate(inputs):
        (alone,) = token2mel(model.flow, [inp], noise)
        for got in (padded[i], padded4[i]):
            assert got.shape == alone.shape and alone.abs().max() > 1.0
            assert (got - alone).abs().max() <= 1e-5 * alone.abs().max()
    flow, dim = model.flow, model.cfg.flow.output_size
    x = noise[:64].repeat(1, 1, 1)
    mu = torch.zeros(1, 64, dim)
    mu[:, :24] = flow.encode_tokens(torch.cat([inputs[0].prompt_tokens, inputs[0].tokens])[None],
                                    torch.tensor([12]))
    args = (flow.speaker(inputs[0].xvector[None]), torch.zeros(1, 64, dim))
    times = cosine_times(10)
    with torch.no_grad():
        masked = solve(flow, x, mu, *args, torch.tensor([24]), torch.tensor([False]), times)
        leaky = solve(flow, x, mu, *args, torch.tensor([64]), torch.tensor([False]), times)
    assert (leaky[0, :24] - masked[0, :24]).abs().max() > 1e-3 * masked.abs().max()


def _feeds(ref: dict, case: str) -> list[dict]:
    voice = VoicePrompt(ref[f"{case}.prompt_token"][0], ref[f"{case}.prompt_feat"][0],
                        ref[f"{case}.embedding"][0])
    return [Payload(tokens=TokenDelta([t]), voice_prompt=voice if i == 0 else None).pack()
            for i, t in enumerate(ref[f"{case}.token"][0].tolist())]


def _stream(g: CosyVoice3Generator, feeds: list[list[dict]], starts: list[int]
            ) -> list[list[torch.Tensor]]:
    """The requests fed one token a step together (request r from step starts[r]); each
    one's chunks."""
    states: list[dict] = [{} for _ in feeds]
    out: list[list[torch.Tensor]] = [[] for _ in feeds]
    live = set(range(len(feeds)))
    for step in range(1000):
        rows = [r for r in sorted(live) if step >= starts[r]]
        if not live:
            return out
        xs = [feeds[r][step - starts[r]] if step - starts[r] < len(feeds[r]) else {}
              for r in rows]
        last = [step - starts[r] >= len(feeds[r]) - 1 for r in rows]
        for r, x, closed in zip(rows, g.generate(xs, [states[r] for r in rows], last), last):
            if x:
                out[r].append(AudioChunk.unpack(x).samples)
            if closed and not g.has_backlog(states[r]):
                live.discard(r)
    raise AssertionError("the streams did not end")


def test_graphs_equal_eager_for_two_requests_at_different_chunks(model, monkeypatch):
    """The fixtures' long request twice, 8 steps apart (a flow call holds one at its second
    chunk, the other at its first), streamed with cuda_graphs (emulated; frames padded to
    multiples of 16) and eagerly: the same chunks (bit for bit at the same padded shapes;
    unpadded, the vocoder's clamp and f0 phase turn a mel's last-bit differences into
    about 5e-5); every flow call a replay, at a planned shape; a call of two rows among them."""
    ref = torch.load(FIXTURES / "stream.pt", map_location="cpu", weights_only=True)
    s = manifest()["stream"]
    opts = dict(token_hop_len=s["token_hop_len"], token_max_hop_len=s["token_max_hop_len"],
                noise_seed=s["noise_seed"])
    eager = CosyVoice3Generator(model, CPU, CosyVoice3FlowOptions(**opts))
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    graphed = CosyVoice3Generator(model, CPU, CosyVoice3FlowOptions(
        **opts, cuda_graphs=True, graph_frames=16, graph_max_frames=256))
    assert graphed.graphs is None, "CUDA only: eager on the CPU unless asked"
    graphed.use_graphs()
    padded = CosyVoice3Generator(model, CPU, graphed.options)
    padded.use_graphs(capture_after=10 ** 9)                   # eager, at the same shapes
    shapes, calls = [], []
    real = gen.token2mel

    def spy(flow, inputs, *args):
        calls.append(len(inputs))
        return real(flow, inputs, *args)

    def shape_of(x, *rest):
        shapes.append(tuple(x.shape[:2]))
        return solve_graphed(x, *rest)

    solve_graphed = graphed.graphs.graphs.fn
    monkeypatch.setattr(graphed.graphs.graphs, "fn", shape_of)
    feeds = [_feeds(ref, "long")] * 2
    want, want_padded = _stream(eager, feeds, [0, 8]), _stream(padded, feeds, [0, 8])
    monkeypatch.setattr(gen, "token2mel", spy)
    got = _stream(graphed, feeds, [0, 8])
    assert graphed.graphs.num_replays == len(calls) >= 4 and padded.graphs is not None
    assert padded.graphs.num_replays == 0 and not padded.graphs.graphs.graphs
    assert 2 in calls and all(n % 16 == 0 and b in (1, 2) for b, n in shapes), shapes
    for g, w, p in zip(got, want, want_padded):
        assert [c.shape for c in g] == [c.shape for c in w] and len(w) == 4
        for a, b, c in zip(g, w, p):
            assert b.abs().max() > 0.1
            assert torch.equal(a, c), "a replay is the eager run at its shape, bit for bit"
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)   # test_cosyvoice3's bound
