"""`omnistage bench realtime`'s turn-taking phase (omnistage/benchmarks/realtime_turns.py)
against the shared tiny random Qwen3-Omni server: speech then silence sent in real time under
server_vad and semantic_vad, timed from the end of speech to the commit and to the first
audio. The figures must mean what they say: server_vad cannot commit before its silence has
been heard, semantic_vad on a random model (an end-of-turn score of about 0) ends at its max
wait, and the server's own /metrics histogram agrees with the clients' clock."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from omnistage.benchmarks import realtime_turns
from omnistage.benchmarks.realtime_turns import TurnTakingConfig

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
SILENCE_S = 0.3          # server_vad's silence_duration_ms here
MAX_WAIT_S = 2.0         # semantic_vad's max wait at eagerness high
SLACK_S = 0.5            # a commit this late after it was due: not what the server waits for


@pytest.fixture(scope="module")
def server(omni_server: Server) -> Server:
    return omni_server


def test_turn_taking_is_timed_from_the_end_of_speech(server: Server) -> None:
    cfg = TurnTakingConfig(repeats=2, silence_duration_ms=int(SILENCE_S * 1000),
                           eagerness="high")
    turns = asyncio.run(realtime_turns.measure(server.url, MODEL, cfg, utterance_s=1.0,
                                               answer_tokens=3, seed=0))
    modes = turns["modes"]
    assert set(modes) == {"server_vad", "semantic_vad"}
    for mode, row in modes.items():
        assert len(row["repeats"]) == 2
        for r in row["repeats"]:      # the detector's events in order, after the speech
            assert 0 < r["stopped_s"] <= r["commit_s"] < r["first_audio_s"], (mode, r)
    # server_vad commits once it has heard its silence, and not long after
    vad = [r["commit_s"] for r in modes["server_vad"]["repeats"]]
    assert all(SILENCE_S <= s < SILENCE_S + SLACK_S for s in vad), vad
    # semantic_vad: each turn decided by the score (before the max wait) or the max wait
    server_side = turns["server"]["turn_taking_seconds"]
    # each turn scored as its pause doubles (high: from 64 ms, 5 in its 2 s; more where
    # Silero heard a pause inside the speech)
    assert 2 <= turns["server"]["end_of_turn_score"].get("all", {}).get("count", 0) <= 2 * 10
    semantic = [r["commit_s"] for r in modes["semantic_vad"]["repeats"]]
    waited = server_side.get("max_wait", {}).get("count", 0)
    assert server_side["silence"]["count"] == 2
    assert waited + server_side.get("score", {}).get("count", 0) == 2, server_side
    assert sum(MAX_WAIT_S - 0.1 <= s < MAX_WAIT_S + SLACK_S for s in semantic) == waited, \
        (semantic, server_side)
    # the server's clock (speech_stopped -> commit) agrees with the clients'
    bench = {"server_vad": ["silence"], "semantic_vad": ["score", "max_wait"]}
    for mode, labels in bench.items():
        count = sum(server_side[b]["count"] for b in labels if b in server_side)
        total = sum(server_side[b]["sum"] for b in labels if b in server_side)
        assert abs(total / count - modes[mode]["stopped_to_commit_s"]["mean"]) < 0.15, \
            (mode, server_side, modes[mode]["stopped_to_commit_s"])
    # the headline: the faster mode, its median to the commit and to the first audio
    head = realtime_turns.headline(turns)
    best = modes[turns["best_mode"]]
    assert head["turn_taking_s"] == best["commit_s"]["median"] == min(
        head["turn_taking_s_server_vad"], head["turn_taking_s_semantic_vad"])
    assert head["turn_taking_first_audio_s"] == best["first_audio_s"]["median"] > \
        head["turn_taking_s"]
