"""Golden: Moshi's batched duplex step (omnistage/stages/moshi_duplex.py: every session a
request of the paged AR engine, its user audio Mimi-encoded frame by frame into the stream
rows, Moshi's frames Mimi-decoded frame by frame) against the step-by-step reference on our
golden-checked model.py (omnistage/testing/moshi_duplex.py), with transformers' Mimi encoding
the user's audio and decoding the reference's frames: two sessions joining at different ticks,
one with a missed input (silence), each equal to its own reference; and each equal to the
same session run alone (batching changes nothing: the same codes, the audio within 1e-5 of
its peak, the batched codec's float reordering)."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.moshi.model import MoshiForConditionalGeneration
from omnistage.stages.moshi_duplex import MoshiDuplex, TickOutput
from omnistage.testing.moshi_duplex import (DUPLEX_MIMI, aligned_frames, build_duplex_moshi,
                                            duplex_reference)
from omnistage.testing.tiny_moshi import build_tiny_moshi

K, FRAME = 3, 1920


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_duplex_moshi(tmp_path_factory.mktemp("moshi_duplex") / "moshi")


def _script(num: int, seed: int, missing: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [None if i in missing else 0.3 * torch.randn(FRAME, generator=g) for i in range(num)]


def _run(duplex: MoshiDuplex, scripts: dict[str, list[torch.Tensor | None]],
         joins: dict[str, int]) -> dict[str, list[TickOutput]]:
    """Tick until every script is heard; session sid opens before tick joins[sid]."""
    outs: dict[str, list[TickOutput]] = {sid: [] for sid in scripts}
    tick = 0
    while any(len(outs[sid]) < len(s) + 1 for sid, s in scripts.items()):
        for sid, at in joins.items():
            if at == tick:
                duplex.open(sid)
        frames = {sid: scripts[sid][len(outs[sid]) - 1] for sid in duplex.sessions
                  if outs[sid] and len(outs[sid]) <= len(scripts[sid])}
        for sid, out in duplex.tick(frames).items():
            if len(outs[sid]) < len(scripts[sid]) + 1:
                outs[sid].append(out)
        tick += 1
    for sid in scripts:
        duplex.close(sid)
    return outs


def _check(ref, ours: MoshiForConditionalGeneration, script: list[torch.Tensor | None],
           outs: list[TickOutput]) -> None:
    heard = torch.cat([torch.zeros(FRAME) if f is None else f for f in script])
    with torch.no_grad():
        user = ref.audio_encoder.encode(heard.view(1, 1, -1), num_quantizers=K).audio_codes[0]
    text, steps = duplex_reference(ours, user)
    assert [o.text_id for o in outs] == text.tolist()
    assert [o.heard for o in outs] == [False] + [True] * len(script)
    assert outs[0].codes is None and outs[0].audio is None
    frames = torch.stack([o.codes for o in outs[1:]])                 # (N, K)
    assert torch.equal(frames, aligned_frames(steps))
    assert len(frames.unique()) > 3                                    # not one code repeated
    with torch.no_grad():
        want = ref.audio_encoder.decode(frames.T[None]).audio_values[0, 0]
    got = torch.cat([o.audio for o in outs[1:]])
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _assert_same_audio(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal up to float reordering: the batched codec's rows (one Mimi call for every
    session) against each session's stream alone, within 1e-5 of the audio's peak."""
    got_all, want_all = torch.cat(got), torch.cat(want)
    peak = want_all.abs().max()
    assert peak > 0.1
    assert (got_all - want_all).abs().max() <= 1e-5 * peak


def test_two_sessions_batched_equal_reference_and_alone(checkpoint):
    path, ref = checkpoint
    ours = MoshiForConditionalGeneration.from_pretrained(path)
    duplex = MoshiDuplex(path, max_sessions=2, block_size=4)
    scripts = {"a": _script(7, 1), "b": _script(5, 2, missing=(2,))}
    together = _run(duplex, scripts, {"a": 0, "b": 2})
    for sid, script in scripts.items():
        _check(ref, ours, script, together[sid])
        alone = _run(duplex, {sid: script}, {sid: 0})[sid]
        assert [o.text_id for o in alone] == [o.text_id for o in together[sid]]
        assert all(torch.equal(x.codes, y.codes) for x, y in zip(alone[1:], together[sid][1:]))
        _assert_same_audio([o.audio for o in alone[1:]], [o.audio for o in together[sid][1:]])
    silent = _run(duplex, {"a": [None] * 7}, {"a": 0})["a"]      # what it hears matters
    assert [o.text_id for o in silent] != [o.text_id for o in together["a"]]
    assert not duplex.sessions and not duplex.engine.has_unfinished_requests


def test_sessions_beyond_the_maximum_are_refused(checkpoint):
    path, _ = checkpoint
    duplex = MoshiDuplex(path, max_sessions=1, block_size=4)
    duplex.open("a")
    with pytest.raises(ValueError, match="1 sessions are open"):
        duplex.open("b")
    duplex.close("a")
    duplex.open("b")                                 # the slot came back
    assert duplex.tick({})["b"].heard is False


def test_a_session_ends_when_the_context_is_used_up(tmp_path):
    path, _ = build_tiny_moshi(tmp_path / "short", mimi=DUPLEX_MIMI, max_position_embeddings=12)
    duplex = MoshiDuplex(path, max_sessions=1, block_size=4)
    duplex.open("a")
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(duplex.tick({})["a"])
    assert len(outs) == duplex.max_frames == 11                 # a context of 12 frames
    assert not duplex.sessions and not duplex.engine.has_unfinished_requests
    duplex.open("b")                                             # its slot is free again


def test_the_inner_monologue_is_text_where_the_checkpoint_has_a_tokenizer(tmp_path):
    """A checkpoint folder with a tokenizer (the released ones ship theirs): each tick's text
    is its token's text, as the engine's detokenizer writes it; without one it is empty."""
    from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

    path, _ = build_duplex_moshi(tmp_path / "moshi")
    tokenizer = build_tiny_tokenizer(path)
    duplex = MoshiDuplex(path, max_sessions=1)
    duplex.open("a")
    outs = [duplex.tick({"a": frame})["a"] for frame in _script(6, seed=3)]
    assert "".join(o.text for o in outs) == tokenizer.decode([o.text_id for o in outs])
    assert any(o.text for o in outs)


# session -> (the tick it opens before, the tick it closes before or None); "c" gets the
# codec slot "b" left; the tiny codec's sliding window (5 latents, 2 a frame) fills by tick 3
PLAN = {"a": (0, None), "b": (2, 4), "c": (5, None)}
TICKS = 9


def _run_plan(duplex: MoshiDuplex, scripts: dict[str, list[torch.Tensor | None]],
              plan: dict[str, tuple[int, int | None]], ticks: int
              ) -> dict[str, list[TickOutput]]:
    outs: dict[str, list[TickOutput]] = {sid: [] for sid in plan}
    for tick in range(ticks):
        for sid, (join, leave) in plan.items():
            if leave == tick:
                duplex.close(sid)
            if join == tick:
                duplex.open(sid)
        frames = {sid: scripts[sid][len(outs[sid]) - 1] for sid in duplex.sessions
                  if outs[sid]}
        for sid, out in duplex.tick(frames).items():
            outs[sid].append(out)
    for sid in plan:
        duplex.close(sid)
    return outs


def _assert_alone_equal(duplex: MoshiDuplex, scripts, together, alone_duplex=None) -> None:
    """Each session of `together` against the same session run alone from tick 0."""
    alone_duplex = alone_duplex or duplex
    assert [len(together[s]) for s in PLAN] == [9, 2, 4]
    for sid, outs in together.items():
        alone = _run_plan(alone_duplex, scripts, {sid: (0, None)}, len(outs))[sid]
        assert [o.text_id for o in alone] == [o.text_id for o in outs], sid
        assert [o.heard for o in outs] == [False] + [True] * (len(outs) - 1)
        assert all(torch.equal(x.codes, y.codes) for x, y in zip(alone[1:], outs[1:])), sid
        _assert_same_audio([o.audio for o in outs[1:]], [o.audio for o in alone[1:]])


def test_sessions_joining_and_leaving_at_different_ticks_equal_each_alone(checkpoint):
    path, _ = checkpoint
    duplex = MoshiDuplex(path, max_sessions=3, block_size=4)
    assert not duplex.use_graphs                                  # CPU: eager by default
    scripts = {"a": _script(TICKS, 4), "b": _script(TICKS, 5), "c": _script(TICKS, 6, (1,))}
    together = _run_plan(duplex, scripts, PLAN, TICKS)
    _assert_alone_equal(duplex, scripts, together)
    assert len({o.codes[0].item() for o in together["a"][1:]}) > 1
    assert not duplex.sessions and not duplex.engine.has_unfinished_requests


def test_graphed_codec_and_depth_equal_eager_alone(checkpoint, monkeypatch):
    """use_graphs on CPU (captures emulated: `rerun_capture`): the codec's steps and the depth
    transformer replay their graphs every tick, and each session equals itself run alone
    eagerly."""
    from omnistage.layers import graph_capture
    from omnistage.testing.graph_emulation import rerun_capture

    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    path, _ = checkpoint
    graphed = MoshiDuplex(path, max_sessions=3, block_size=4, use_graphs=True)
    depth = graphed.model.depth_decoder.graphs
    assert depth is not None and sorted(depth.graphs) == [1, 2, 3]
    scripts = {"a": _script(TICKS, 7), "b": _script(TICKS, 8), "c": _script(TICKS, 9)}
    together = _run_plan(graphed, scripts, PLAN, TICKS)
    assert depth.num_replays >= TICKS
    assert graphed.encode_graphs is not None and graphed.decode_graphs is not None
    assert graphed.encode_graphs.num_replays == graphed.decode_graphs.num_replays == TICKS - 1
    _assert_alone_equal(graphed, scripts, together,
                        MoshiDuplex(path, max_sessions=3, block_size=4, use_graphs=False))
