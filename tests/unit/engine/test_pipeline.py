"""The stage-graph runtime end to end on a three-stage toy pipeline (tiny Qwen3 -> tiny Qwen3
fed its hidden states -> a generation stage turning tokens into vectors), over every backend,
connector and edge kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage import Omni
from omnistage.testing.toy_pipeline import toy_graph_yaml

PROMPTS = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": [7, 3, 99, 42]},
           {"prompt_token_ids": list(range(100, 160))}]
MAX_TOKENS = 12

COMBOS = [("inproc", "inproc", False), ("inproc", "inproc", True),
          ("inproc", "shm", False), ("inproc", "shm", True),
          ("inproc", "tcp", False), ("inproc", "tcp", True),
          ("process", "shm", False), ("process", "shm", True),
          ("process", "tcp", False), ("process", "tcp", True)]


def test_text_only_request_never_enters_downstream(tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, connector="inproc", backend="inproc")
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        (out,) = omni.generate(PROMPTS[0], output_modalities={"text"})
        assert set(out.stage_metrics) == {"first"}
        assert out.tensors == {} and len(out.token_ids) == 16
        with pytest.raises(ValueError, match="audio"):
            omni.generate(PROMPTS[0], output_modalities={"audio"})


def test_start_up_facts_are_reported_and_logged(tiny_qwen3: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Each AR stage reports at its handshake what it got (KV blocks, device, dtype, graph
    sizes); the orchestrator logs one line per stage."""
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, connector="inproc", backend="inproc")
    with caplog.at_level("INFO", logger="omnistage.engine"):   # its StageSet logs them
        with Omni(stage_config=yaml_text, device="cpu") as omni:
            info = omni.engine.orchestrator.stage_info
            stats = omni.engine.orchestrator.stage_stats()
    first = info["first"]
    assert first.device == "cpu" and first.dtype == "float32"
    assert first.cuda_graphs == () and first.num_kv_blocks == stats["first"].num_blocks
    assert first.kv_block_size == 16 and first.kv_cache_gib > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stage ")]
    assert any(line.startswith(f"stage first (ar) on cpu, float32: KV cache "
                               f"{first.num_kv_blocks} blocks of 16") for line in lines)
    assert "stage vectors (generation) ready" in lines


def test_unknown_ar_stage_options_are_refused(tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, backend="inproc").replace(
        "      max_num_batched_tokens: 32\n", "      max_num_batched_tokens: 32\n"
        "      options: {chunk_frames: 4}\n")
    with pytest.raises(RuntimeError, match=r"stage 'first': ar.options.chunk_frames: unknown "
                                           r"key \(it takes none\)"):
        Omni(stage_config=yaml_text, device="cpu")

