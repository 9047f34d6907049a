"""The streamed token2wav at planned shapes (what its CUDA graphs replay), on the tiny
checkpoint: a DiT step of windows padded in rows and frames equals each window's step alone,
whatever the padding holds (a padded frame no real frame sees); vocoder windows padded or
widened to planned lengths return the whole decode's samples; and the generator with its
graphs (captured at start-up, emulated on the CPU: a replay reruns the step on the graph's
buffers) equals the eager one, capturing nothing after start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions
from omnistage.generation.token2wav_stream import dit_step
from omnistage.layers import graph_capture
from omnistage.layers.graph_capture import PaddedShapes
from omnistage.models.qwen2_5_omni.bigvgan_stream import MelStream, vocode_streams
from omnistage.testing.graph_emulation import rerun_capture

from .test_token2wav_stream import codes_of, run

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core runner, two threads of these tiny convolutions
    and matmuls wait on each other (measured: 20 to 50 times slower, from 1 s to a minute)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eager(omni25_path: Path) -> Token2WavGenerator:
    """Streamed, first chunks of 6 blocks (the tiny vocoder's context is 5.5), a DiT batch of
    at most 192 frames (6 windows of 32)."""
    return Token2WavGenerator.from_pretrained(
        omni25_path, "", CPU, None, Token2WavOptions(first_chunk_blocks=6, max_batch_frames=192))


def test_padded_shapes_of_the_shipped_stream() -> None:
    """The released model's DiT windows (first 4 blocks, then 8, of 24 frames) under 4096
    frames a step: rows by powers of two up to the most that fit; anything longer as is."""
    shapes = PaddedShapes((96, 192), 4096)
    assert shapes.row_sizes(192) == [1, 2, 4, 8, 16, 21]
    assert shapes.row_sizes(96) == [1, 2, 4, 8, 16, 32, 42]
    assert shapes.length(50) == 96 and shapes.length(97) == 192 and shapes.length(200) == 200
    assert shapes.rows(3, 192) == 4 and shapes.rows(17, 192) == 21 and shapes.rows(30, 192) == 30
    assert len(shapes.all()) == 13
    assert PaddedShapes((48, 164), 8 * 164, 8).row_sizes(48) == [1, 2, 4, 8]


def test_padded_dit_step_equals_each_window_alone(eager: Token2WavGenerator) -> None:
    """Four windows of odd lengths (whole codes, not whole blocks), each at its own RK4 step,
    padded to 8 rows of 40 frames whose padding holds large noise and random codes: every
    window's step equals its step alone, unpadded; without the lengths, the padding leaks."""
    dit, times, scale = eager.model.dit, eager.times, eager.guidance_scale
    cfg, rows = dit.cfg, eager.speakers
    gen = torch.Generator().manual_seed(11)
    lengths, steps, who = [30, 14, 22, 6], [0, 3, 8, 5], [0, 1, 1, 0]
    x = torch.randn(8, 40, cfg.mel_dim, generator=gen)
    pad = torch.arange(40)[None] >= torch.tensor(lengths + [0] * 4)[:, None]
    x[pad] = x[pad] * 50 + 20                                           # the padding: junk
    codes = torch.randint(0, 64, (8, 20), generator=gen)
    batch_steps = torch.tensor(steps + [0] * 4)
    speakers = [rows[i] for i in who] + [rows[0]] * 4
    cond, speaker, null = (torch.cat([getattr(r, f) for r in speakers])
                           for f in ("cond", "speaker", "null_speaker"))
    args = (times[batch_steps], times[batch_steps + 1], cond, speaker, null, codes)
    with torch.inference_mode():
        padded = dit_step(dit, scale, x, *args, torch.tensor(lengths + [0] * 4))
        leaky = dit_step(dit, scale, x, *args, None)
        for b, n in enumerate(lengths):
            alone = dit_step(dit, scale, x[b:b + 1, :n], *(a[b:b + 1] for a in args[:-1]),
                             codes[b:b + 1, :n // cfg.repeats], None)[0]
            assert (alone - x[b, :n]).abs().max() > 0.01, "the step moves x"
            assert (padded[b, :n] - alone).abs().max() <= 1e-5 * alone.abs().max()
            assert (leaky[b, :n] - alone).abs().max() > 1e-3 * alone.abs().max(), \
                "without the lengths, the padding leaks (the check can fail)"


def test_vocoder_windows_at_planned_shapes_equal_the_whole(eager: Token2WavGenerator
                                                           ) -> None:
    """Three streams' mel in odd pieces, vocoded at planned shapes (windows of 24 or 60
    frames, 1, 2 or 4 rows): each equals its whole decode; every forward runs at a planned
    shape but the only window of a stream shorter than the longest planned length."""
    model = eager.model
    vocoder = model.code2wav_bigvgan_model
    shapes = PaddedShapes((24, 2 * vocoder.context_frames + 16), 4 * 60, 4)
    gen = torch.Generator().manual_seed(1)
    mels = [torch.randn(n, 16, generator=gen) - 4 for n in (100, 50, 13)]
    expected = [model.vocode(m[None])[0] for m in mels]
    streams = [MelStream(vocoder, 16, CPU, shapes) for _ in mels]
    pieces: list[list[torch.Tensor]] = [[] for _ in mels]
    seen: list[tuple[int, int]] = []

    def vocode(mel: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(mel.shape[:2]))
        return model.vocode(mel)

    for fed in range(0, 1000, 37):       # 37 frames a call: more than a window returns
        if all(s.is_finished and not s.num_ready for s in streams):
            break
        for s, m in zip(streams, mels):
            if fed < m.shape[0]:
                s.append(m[fed:fed + 37])
            elif not s.is_finished:
                s.finish()
        for p, out in zip(pieces, vocode_streams(streams, shapes, vocode)):
            p.append(out)
    for p, e in zip(pieces, expected):
        audio = torch.cat(p)
        assert audio.shape == e.shape and e.abs().max() > 0.1
        assert (audio - e).abs().max() <= 1e-5
    planned = set(shapes.all())
    assert {s for s in seen if s not in planned} == {(1, 13), (1, 50)}, seen  # whole ones
    assert max(n for _, n in seen) == 60 and any(b > 1 for b, _ in seen)


def test_graphs_equal_eager_through_the_generator(eager: Token2WavGenerator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Three requests (two speakers, 66 to 90 frames, one joining later) through the
    generator with its graphs (emulated; vocoder batches of at most 2 windows, so that a
    forward of 3 runs as 2 + 1) and without: the same audio; every DiT step and every
    vocoder forward replays a graph captured at start-up."""
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    graphed = Token2WavGenerator(eager.model, [],
                                 Token2WavOptions(first_chunk_blocks=6, max_batch_frames=192))
    graphed.speakers = eager.speakers
    graphed.use_graphs(max_vocoder_rows=2)
    graphs = graphed.graphs
    assert graphed.dit_shapes is not None and graphed.mel_shapes is not None
    assert graphed.dit_shapes.all() == [(b, 32) for b in (1, 2, 4, 6)]
    assert graphed.mel_shapes.all() == [(1, 24), (2, 24), (1, 60), (2, 60)]
    captured, replays = graphs.num_graphs, (graphs.dit.num_replays, graphs.vocode.num_replays)
    assert captured == 8
    requests = [(codes_of(40, 2), 0), (codes_of(33, 3), 1), (codes_of(45, 4), 1)]
    expected = run(eager, requests, per_call=5, delays=[0, 0, 2])
    got = run(graphed, requests, per_call=5, delays=[0, 0, 2])
    for a, b in zip(got, expected):
        a, b = torch.cat(a), torch.cat(b)
        assert a.shape == b.shape and b.abs().max() > 0.1
        assert (a - b).abs().max() <= 1e-5
    assert graphs.num_graphs == captured, "nothing captured after start-up"
    assert len(graphs.dit.seen) == 4 and len(graphs.vocode.seen) == 4, "no other shape ran"
    assert graphs.dit.num_replays > replays[0] + 20 and graphs.vocode.num_replays > replays[1]
