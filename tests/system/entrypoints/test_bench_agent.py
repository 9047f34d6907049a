"""`omnistage bench agent --tiny` on the CPU: the voice agent graph (tiny Qwen3
LLM -> tiny Qwen3-TTS CustomVoice, built by qwen-tts in the reference environment) timed at
concurrency 1 and 2: a well-formed JSON whose figures are consistent, never a timing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from omnistage.benchmarks import agent
from omnistage.entrypoints.cli.main import main
from omnistage.testing.tiny_tts import reference_missing


def test_bench_agent_tiny(tmp_path: Path) -> None:
    missing = reference_missing()
    if missing:
        pytest.skip(missing)
    rc = main(["bench", "agent", "--tiny", "--device", "cpu", "--concurrency", "1,2",
               "--out-dir", str(tmp_path), "--name", "agent"])
    assert rc == 0
    doc = json.loads((tmp_path / "agent.json").read_text())       # strict JSON
    assert doc["benchmark"] == "agent" and doc["device"] == "cpu"
    ratios, by_c = doc["ratios"], doc["omnistage"]["by_concurrency"]
    assert set(ratios) == {"agent_first_audio_s_c1", "agent_rtf_c1", "agent_first_audio_s_c2",
                           "agent_rtf_c2"}
    for c, n in (("1", 1), ("2", 2)):
        row = by_c[c]
        assert row["requests"] == n and len(row["audio_s"]) == n
        assert all(a > 0.1 for a in row["audio_s"])               # every answer was spoken
        first, e2e = row["first_audio_s"]["median"], row["e2e_s"]["median"]
        assert 0 < first <= e2e and math.isfinite(row["rtf"]["median"])
        assert ratios[f"agent_first_audio_s_c{c}"] == first


def test_the_bench_llm_writes_whole_words(tmp_path: Path) -> None:
    """The random LLM's head keeps only whole ASCII words: its greedy text is speakable as it
    streams (a word ends at the next one's space)."""
    cfg = agent.AgentBenchConfig(tiny=True)
    path = agent.build_llm(tmp_path / "llm", cfg, torch.device("cpu"))
    model = Qwen3ForCausalLM.from_pretrained(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("Tell me a story.", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    text = tokenizer.decode(out)
    words = text.split()
    assert len(words) == 12 and text.startswith(" "), text
    assert all(w.isascii() and w.isalpha() for w in words), text


def test_the_regress_probes_of_duplex_and_agent_run_tiny() -> None:
    """`bench regress`'s duplex and agent probes (the H200 baseline holds their figures) run at
    the tiny size on the CPU and name their figures, lower being better."""
    missing = reference_missing()
    if missing:
        pytest.skip(missing)
    from omnistage.benchmarks import regress

    duplex = regress.probe_duplex("cpu", tiny=True)
    assert set(duplex) == {"duplex_tick_p99_ms_c1", "duplex_tick_p99_ms_c2"}
    talk = regress.probe_agent("cpu", tiny=True)
    assert set(talk) == {"agent_first_audio_s_c1", "agent_first_audio_s_c8"}
    for value, better in [*duplex.values(), *talk.values()]:
        assert better == regress.LOWER and math.isfinite(value) and value > 0
