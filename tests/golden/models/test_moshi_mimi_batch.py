"""Golden: many Mimi streams stepped together (omnistage/models/moshi/mimi_batch.py: one pool of
per-slot streaming state, one batched encode and decode a step) against each stream alone
(mimi.py's `encode_step` / `decode_step` with its own state, itself golden against
transformers in test_moshi_mimi.py). Streams start at different steps, one leaves and its slot
is reused, and they run past the tiny codec's sliding window of 5 (2 latents a frame), so both
the filling and the full window are covered. Then the same with the steps and the depth
transformer replayed from CUDA graphs (emulated on CPU: `rerun_capture`)."""

from __future__ import annotations

import pytest
import torch

from omnistage.layers import graph_capture
from omnistage.models.moshi.mimi import MimiModel
from omnistage.models.moshi.mimi_batch import MimiStreams, StreamGraphs
from omnistage.models.moshi.model import MoshiForConditionalGeneration
from omnistage.testing.graph_emulation import rerun_capture
from omnistage.testing.tiny_moshi import TINY_MIMI, build_tiny_mimi, build_tiny_moshi

FRAME, K, STEPS = 96, 4, 12
# stream -> (slot, first step, last step + 1); "c" takes "b"'s slot after "b" leaves
PLAN = {"a": (0, 0, 12), "b": (1, 2, 5), "c": (1, 6, 12), "d": (2, 5, 12)}


@pytest.fixture(scope="module")
def mimi(tmp_path_factory) -> MimiModel:
    assert TINY_MIMI["sliding_window"] == 5 and STEPS * 2 > 5
    path, _ = build_tiny_mimi(tmp_path_factory.mktemp("mimi_batch") / "mimi")
    return MimiModel.from_pretrained(path)


def _audio(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(STEPS, 1, FRAME, generator=g)


def _alone(mimi: MimiModel) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each stream's codes (n, K) and decoded audio (n, FRAME), streamed alone frame by frame."""
    out = {}
    for i, (sid, (_, start, end)) in enumerate(PLAN.items()):
        wav, enc, dec = _audio(i), mimi.new_encode_state(), mimi.new_decode_state()
        codes = [mimi.encode_step(wav[j][None], K, enc)[0, :, 0] for j in range(end - start)]
        audio = [mimi.decode_step(c.view(1, K, 1), dec)[0, 0] for c in codes]
        out[sid] = torch.stack(codes), torch.stack(audio)
    return out


def _together(streams: MimiStreams, encode, decode) -> dict[str, tuple[torch.Tensor, ...]]:
    codes: dict[str, list[torch.Tensor]] = {sid: [] for sid in PLAN}
    audio: dict[str, list[torch.Tensor]] = {sid: [] for sid in PLAN}
    for step in range(STEPS):
        live = [(i, sid) for i, (sid, (_, a, b)) in enumerate(PLAN.items()) if a <= step < b]
        for _, sid in live:
            if PLAN[sid][1] == step:
                streams.reset(PLAN[sid][0])
        slots = torch.tensor([PLAN[sid][0] for _, sid in live])
        wav = torch.stack([_audio(i)[step - PLAN[sid][1]] for i, sid in live])   # (B, 1, F)
        got = encode(slots, wav)[:, :, 0].clone()                                # (B, K)
        sound = decode(slots, got[:, :, None])[:, 0].clone()                     # (B, F)
        for j, (_, sid) in enumerate(live):
            codes[sid].append(got[j])
            audio[sid].append(sound[j])
    return {sid: (torch.stack(codes[sid]), torch.stack(audio[sid])) for sid in PLAN}


def _assert_equal(got: dict, want: dict) -> None:
    for sid in PLAN:
        (codes, audio), (want_codes, want_audio) = got[sid], want[sid]
        assert torch.equal(codes, want_codes), sid
        peak = want_audio.abs().max()
        assert peak > 0.3, sid                                       # audible, not near zero
        assert (audio - want_audio).abs().max() <= 1e-5 * peak, sid


def test_streams_at_different_positions_equal_each_alone(mimi):
    want = _alone(mimi)
    assert len(torch.cat([c for c, _ in want.values()]).unique()) > 16
    streams = MimiStreams(mimi, max_rows=3, num_quantizers=K)
    _assert_equal(_together(streams, streams.encode, streams.decode), want)


def test_graphed_streams_equal_each_alone(mimi, monkeypatch):
    """Buckets 1, 2, 3 for 3 slots: a step of 1 or 2 streams pads to its bucket with the
    scratch slot, which must leave every stream's state alone."""
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    streams = MimiStreams(mimi, max_rows=3, num_quantizers=K)
    sizes = graph_capture.graph_batch_sizes(3)
    assert sizes == [1, 2, 3]
    encode = StreamGraphs(streams.encode, sizes, streams.scratch, torch.zeros(1, 1, FRAME))
    decode = StreamGraphs(streams.decode, sizes, streams.scratch,
                          torch.zeros(1, K, 1, dtype=torch.long))
    encode.capture_all()
    decode.capture_all()
    _assert_equal(_together(streams, encode, decode), _alone(mimi))
    assert encode.num_replays == decode.num_replays == STEPS


def test_depth_graphs_equal_eager(tmp_path, monkeypatch):
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    path, _ = build_tiny_moshi(tmp_path / "moshi")
    depth = MoshiForConditionalGeneration.from_pretrained(path).depth_decoder
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, depth.cfg.input_size, generator=g)
    text = torch.randint(0, depth.cfg.vocab_size, (3,), generator=g)
    want = depth.generate(hidden, text)
    assert len(want.unique()) > 2
    depth.graphs = graph_capture.RowGraphs(depth.run_codebooks, (hidden[:1], text[:1]), 4)
    depth.graphs.capture_all()
    for b in (1, 3):                                        # buckets 1 and 4 (padded)
        assert torch.equal(depth.generate(hidden[:b], text[:b]), want[:b])
    assert depth.graphs.num_replays == 2
