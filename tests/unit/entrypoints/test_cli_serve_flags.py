"""`omnistage serve` flags, parsed and turned into the stage graph without starting a server:
each engine flag reaches its stage key, flags that do not apply are refused, `--config FILE`
merges under the command line, unknown flags get a did-you-mean."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from omnistage.configs.schema import GraphConfig
from omnistage.entrypoints.cli import serve
from omnistage.entrypoints.cli.main import main, parse_args
from omnistage.entrypoints.cli.stage_flags import max_positions


def graph_of(argv: list[str]) -> tuple[argparse.Namespace, GraphConfig]:
    """What `omnistage serve ARGV` would run, checked as at start-up; nothing loads."""
    args = parse_args(["serve", *argv])
    args.model = serve.model_name(args)
    path = serve.startup.resolve_model(args.model) if args.model else None
    return args, serve.build_graph(args, path)


def test_each_engine_flag_sets_its_main_stage_key(tiny_qwen3: Path) -> None:
    args, graph = graph_of([
        str(tiny_qwen3), "--stage-config", "qwen3_omni", "--gpu-memory-utilization", "0.5",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "512",
        "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "float32", "--seed", "7",
        "--tokenizer", str(tiny_qwen3), "--trust-remote-code", "-tp", "1"])
    thinker, talker, code2wav = graph.stages
    ar = thinker.ar
    assert (thinker.placement.memory_fraction, ar.max_num_seqs, ar.max_num_batched_tokens,
            ar.max_model_len, ar.enforce_eager, ar.kv_cache.enable_prefix_caching,
            ar.seed, ar.tokenizer) == (0.5, 8, 256, 512, True, False, 7, str(tiny_qwen3))
    assert thinker.ar_config(str(tiny_qwen3), "cpu").tokenizer == str(tiny_qwen3)
    # only the main stage: the talker keeps its graph's values ...
    assert (talker.placement.memory_fraction, talker.ar.max_num_seqs, talker.ar.max_model_len,
            talker.ar.seed) == (0.12, 64, None, 0)
    # ... but dtype is the whole model's
    assert {s.dtype for s in graph.stages} == {"float32"}
    assert args.trust_remote_code is True and code2wav.kind == "generation"


def test_stage_override_wins_over_a_flag(tiny_qwen3: Path) -> None:
    _, graph = graph_of([str(tiny_qwen3), "--max-num-seqs", "8",
                         "--stage-override", "llm.ar.max_num_seqs=3"])
    assert graph.stage("llm").ar.max_num_seqs == 3


def test_worker_backend_and_ray_address_set_the_graph(tiny_qwen3: Path) -> None:
    _, graph = graph_of([str(tiny_qwen3), "--worker-backend", "ray",
                         "--ray-address", "10.0.0.1:6379"])
    assert (graph.backend, graph.ray_address, graph.connector_kind) == (
        "ray", "10.0.0.1:6379", "auto")
    assert graph_of([str(tiny_qwen3)])[1].connector_kind == "shm"


def test_server_flags_and_model_flag(tiny_qwen3: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = parse_args(["serve", "--model", str(tiny_qwen3), "--served-model-name", "m",
                       "--chat-template", str(template), "--uvicorn-log-level", "warning",
                       "--host", "0.0.0.0"])
    assert serve.model_name(args) == str(tiny_qwen3)
    assert (args.served_model_name, args.uvicorn_log_level, args.host) == ("m", "warning",
                                                                         "0.0.0.0")
    assert serve.startup.read_chat_template(args.chat_template) == template.read_text()
    assert parse_args(["serve"]).host == "127.0.0.1"
    with pytest.raises(ValueError, match="two models given"):
        serve.model_name(parse_args(["serve", "a", "--model", "b"]))


def test_server_config_flags_reach_the_server_config() -> None:
    from omnistage.entrypoints.openai.api_server import ServerConfig
    from omnistage.entrypoints.openai.video_params import VideoLimits

    config = ServerConfig.from_namespace(parse_args(
        ["serve", "--default-modalities", "text,audio", "--stats-log-interval", "2.5"]))
    assert (config.default_modalities, config.stats_log_interval_s) == (("text", "audio"), 2.5)
    defaults = ServerConfig.from_namespace(parse_args(["serve"]))
    assert (defaults.default_modalities, defaults.stats_log_interval_s) == ((), 10.0)
    assert defaults.enable_playground is True
    assert ServerConfig.from_namespace(parse_args(["serve", "--no-playground"])
                                       ).enable_playground is False
    videos = ServerConfig.from_namespace(parse_args(
        ["serve", "--videos-dir", "/tmp/v", "--max-video-jobs", "2", "--max-video-frames", "33",
         "--max-video-size", "512", "--max-videos-disk-bytes", "1000",
         "--max-running-videos", "2"]))
    assert videos.videos_dir == "/tmp/v"
    assert videos.video_limits == VideoLimits(2, 33, 512, 1000, 2)
    assert defaults.video_limits == VideoLimits() and defaults.videos_dir is None
    with pytest.raises(ValueError, match="max_video_jobs=0"):
        ServerConfig(max_video_jobs=0)


def test_the_api_key_comes_from_one_of_flag_file_and_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file or the environment keeps the key out of `ps`; two sources or an empty key are
    refused rather than one guessed."""
    from omnistage.entrypoints.cli.serve_args import API_KEY_ENV

    read = serve.startup.read_api_key
    key_file = tmp_path / "key"
    key_file.write_text("  from-file \nsecond line\n")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert read(None, None, API_KEY_ENV) is None
    assert read("flag", None, API_KEY_ENV) == "flag"
    assert read(None, str(key_file), API_KEY_ENV) == "from-file"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert read(None, None, API_KEY_ENV) == "from-env"
    with pytest.raises(ValueError, match="given twice"):
        read(None, str(key_file), API_KEY_ENV)
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(FileNotFoundError, match="--api-key-file"):
        read(None, str(tmp_path / "none"), API_KEY_ENV)
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read(None, str(key_file), API_KEY_ENV)


def test_slow_client_and_metrics_flags_reach_the_server_config() -> None:
    from omnistage.entrypoints.openai.api_server import ServerConfig
    from omnistage.entrypoints.openai.slow_clients import ConnectionLimits

    config = ServerConfig.from_namespace(parse_args(
        ["serve", "--header-timeout", "2", "--body-timeout", "3",
         "--max-connections-per-client", "0", "--open-metrics"]))
    assert config.connection_limits == ConnectionLimits(2.0, 3.0, 0) and config.open_metrics
    defaults = ServerConfig.from_namespace(parse_args(["serve"]))
    assert defaults.connection_limits == ConnectionLimits() and not defaults.open_metrics
    with pytest.raises(ValueError, match="max_connections_per_client"):
        ServerConfig(max_connections_per_client=-1)


def test_flags_that_do_not_apply_are_refused(tiny_qwen3: Path) -> None:
    # the demo model: one diffusion stage; the AR-only flags are refused, batch size is not
    _, graph = graph_of(["--max-num-seqs", "4", "--gpu-memory-utilization", "0.3"])
    dit = graph.stage("dit")
    assert (dit.diffusion.max_num_seqs, dit.placement.memory_fraction) == (4, 0.3)
    for flag in (["--max-model-len", "64"], ["--max-num-batched-tokens", "64"],
                 ["--enforce-eager"], ["--seed", "1"], ["--chat-template", "{{ x }}"],
                 ["--enable-prefix-caching"]):
        with pytest.raises(ValueError, match=f"{flag[0]} does not apply to this model.*"
                                             "main stage 'dit' is a diffusion stage"):
            graph_of(flag)


def test_max_model_len_above_the_model_limit_is_refused(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len 513 .* above this model's limit of 512"):
        graph_of([str(tiny_qwen3), "--max-model-len", "513"])
    with pytest.raises(ValueError, match="limit of 512"):   # however it was set
        graph_of([str(tiny_qwen3), "--stage-override", "llm.ar.max_model_len=4096"])
    nested = {"thinker_config": {"text_config": {"max_position_embeddings": 4096}},
              "talker_config": {"max_position_embeddings": 64}}
    assert max_positions(nested, "qwen3_omni_thinker") == 4096
    assert max_positions(nested, "qwen3_omni_talker") == 64
    assert max_positions({"text_config": {"max_position_embeddings": 9}}, None) == 9


def test_parallel_flags_set_the_main_stage_and_its_devices(tiny_qwen3: Path) -> None:
    _, graph = graph_of([str(tiny_qwen3), "-tp", "2"])
    llm = graph.stage("llm")
    assert (llm.parallel.tp, llm.placement.devices, llm.parallel.world_size) == (2, (0, 1), 2)
    # an explicit device list wins (the override comes after the flags' items)
    _, graph = graph_of([str(tiny_qwen3), "-tp", "2",
                         "--stage-override", "llm.placement.devices=[2,3]"])
    assert graph.stage("llm").placement.devices == (2, 3)
    _, graph = graph_of([str(tiny_qwen3), "--stage-config", "qwen3_omni", "-tp", "2"])
    assert graph.stage("thinker").parallel.tp == 2
    assert graph.stage("talker").parallel.tp == 1


def test_diffusion_axes_are_refused_on_an_llm(capsys: pytest.CaptureFixture,
                                               tiny_qwen3: Path) -> None:
    assert main(["serve", str(tiny_qwen3), "--cfg-parallel-size", "2"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cfg-parallel-size does not apply to this model" in line and "diffusion" in line


def test_config_file_merges_under_the_command_line(tiny_qwen3: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_qwen3}\nmax-num-seqs: 4\nmax_num_batched_tokens: 64\n"
                   f"enable-prefix-caching: false\nallowed-media-dirs: [{tmp_path}]\n"
                   "port: 9001\n")
    args, graph = graph_of(["--config", str(cfg), "--max-num-seqs", "8", "--port", "9002"])
    llm = graph.stage("llm")
    assert (llm.ar.max_num_seqs, llm.ar.max_num_batched_tokens,
            llm.ar.kv_cache.enable_prefix_caching) == \
        (8, 64, False)
    assert (args.port, args.allowed_media_dirs, args.model) == (9002, [str(tmp_path)],
                                                                str(tiny_qwen3))
    assert serve.model_name(parse_args(["serve", "other", "--config", str(cfg)])) == "other"


def test_config_file_mistakes_name_the_file(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-num-seq: 4\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert f"{cfg}: max-num-seq: not a flag of this command (did you mean max-num-seqs?)" \
        in capsys.readouterr().err
    cfg.write_text("port: 1\nhost: [a\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert f"{cfg}: line 3" in capsys.readouterr().err
    cfg.write_text("enforce-eager: yes please\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "enforce-eager: expected true or false" in capsys.readouterr().err


def test_unknown_flag_gets_a_did_you_mean(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--max-num-seq", "8"])
    assert exc.value.code == 2
    assert "unrecognized argument --max-num-seq (did you mean --max-num-seqs?)" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--gpu-memory-utilisation=0.5"])
    assert "did you mean --gpu-memory-utilization?" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"omnistage {version('omnistage')}"


def test_config_file_cannot_nest(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"config: {cfg}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "config: not a flag a --config file can set" in capsys.readouterr().err
