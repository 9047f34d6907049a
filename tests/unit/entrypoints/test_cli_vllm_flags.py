"""The vLLM / vLLM-Omni flags a user types next to `omnistage serve MODEL --omni`: each parsed
with vLLM's meaning (`--stage-configs-path` a vLLM-Omni stage config, translated), nothing
started."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.entrypoints.cli import serve
from omnistage.entrypoints.cli.main import parse_args

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm_omni"


def test_stage_configs_path_with_the_engine_flags() -> None:
    args = parse_args(["serve", "--omni", "--stage-configs-path",
                       str(FIXTURES / "qwen3_omni_moe.yaml"), "--enforce-eager",
                       "--gpu-memory-utilization", "0.6", "--max-num-seqs", "4",
                       "--trust-remote-code", "--served-model-name", "omni"])
    graph = serve.build_graph(args, None)
    assert [s.name for s in graph.stages] == ["thinker", "talker", "code2wav"]
    thinker, talker, _ = graph.stages
    # the flags set the main stage over the file's value (0.75), as on vLLM
    assert (thinker.placement.memory_fraction, thinker.ar.max_num_seqs,
            thinker.ar.enforce_eager) == (0.6, 4, True)
    assert talker.ar.sampling["temperature"] == 0.9
    assert args.served_model_name == "omni"


def test_stage_configs_path_and_stage_config_conflict() -> None:
    args = parse_args(["serve", "--stage-configs-path", str(FIXTURES / "wan.yaml"),
                       "--stage-config", "wan"])
    with pytest.raises(ValueError, match="both given"):
        serve.build_graph(args, None)


def test_stage_configs_path_error_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((FIXTURES / "wan.yaml").read_text().replace("max_num_seqs: 4",
                                                              "kv_transfer_config: {}"))
    args = parse_args(["serve", "--stage-configs-path", str(bad)])
    with pytest.raises(ValueError, match=r"stage_args\[0\]\.engine_args\.kv_transfer_config"):
        serve.build_graph(args, None)


def test_allowed_local_media_path_is_allowed_media_dirs(tmp_path: Path) -> None:
    args = parse_args(["serve", "--allowed-local-media-path", str(tmp_path)])
    assert args.allowed_media_dirs == [str(tmp_path)]


def test_the_keyword_conflict_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="both given"):
        AsyncOmni(None, stage_config="wan", stage_configs_path=FIXTURES / "wan.yaml")


def test_allowed_local_media_path_in_a_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "serve.yaml"
    conf.write_text(f"allowed_local_media_path: {tmp_path}\n")
    args = parse_args(["serve", "--config", str(conf)])
    assert args.allowed_media_dirs == [str(tmp_path)]
