"""What a new user meets first on the command line: help and argument errors before any heavy
import, one line per error, hints only where they help, vLLM's dtype names, and the same engine
flags on `generate` as on `serve`."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.entrypoints.cli import generate
from omnistage.entrypoints.cli.main import main, parse_args

HEAVY = ("torch", "transformers", "numpy", "fastapi")


def test_bare_omnistage_prints_help(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: omnistage" in out and "serve" in out and "generate" in out


def test_an_argument_error_is_one_line(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["serve", "--port", "eighty"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port" in err, err


@pytest.mark.parametrize("flag, words", [
    ("--reasoning-parser", "reasoning stays in the answer's content"),
    ("--kv-cache-dtype", "the KV cache takes the stage's dtype"),
    ("--pipeline-parallel-size", "a model runs as a graph of stages"),
    ("--limit-mm-per-prompt", "use --max-media-parts N"),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_vllm_flags_we_lack_get_their_own_sentence(command: str, flag: str, words: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args([command, "--prompt", "x", flag, "1"] if command == "generate"
                   else [command, flag, "1"])
    err = capsys.readouterr().err
    assert words in err and "did you mean" not in err, err


@pytest.mark.parametrize("flag, hint", [("--max-num-seq", "--max-num-seqs"),
                                        ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
                                        ("--prot", "--port"), ("--zzz-frobnicate", None),
                                        ("--mistral", None),
                                        ("--tensor-parallel", "--tensor-parallel-size")])
def test_did_you_mean_only_when_close(flag: str, hint: str | None,
                                      capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", flag, "1"])
    err = capsys.readouterr().err
    if hint is None:
        assert "did you mean" not in err, err
    else:
        assert f"did you mean {hint}?" in err, err


def test_vllm_omnis_omni_switch_is_accepted() -> None:
    assert parse_args(["serve", "--omni"]).omni is True
    assert parse_args(["generate", "--prompt", "x", "--omni"]).omni is True


@pytest.mark.parametrize("given, dtype", [("half", "float16"), ("fp16", "float16"),
                                          ("bf16", "bfloat16"), ("BFloat16", "bfloat16"),
                                          ("float", "float32"), ("float32", "float32")])
def test_vllm_dtype_names(given: str, dtype: str) -> None:
    assert parse_args(["serve", "--dtype", given]).dtype == dtype
    assert parse_args(["generate", "--prompt", "x", "--dtype", given]).dtype == dtype
    with pytest.raises(SystemExit):
        parse_args(["serve", "--dtype", "float8"])


def test_generate_takes_the_engine_flags_of_serve(tiny_qwen3: Path) -> None:
    args = parse_args(["generate", str(tiny_qwen3), "--prompt", "x", "-tp", "1",
                       "--gpu-memory-utilization", "0.4", "--max-num-seqs", "5",
                       "--max-model-len", "96", "--enforce-eager", "--dtype", "half",
                       "--no-enable-prefix-caching", "--seed", "3"])
    graph = generate._graph(args)
    llm = graph.stage("llm")
    assert (llm.placement.memory_fraction, llm.ar.max_num_seqs, llm.ar.max_model_len,
            llm.ar.enforce_eager, llm.dtype, llm.ar.kv_cache.enable_prefix_caching, llm.ar.seed,
            llm.parallel.tp) == (
        0.4, 5, 96, True, "float16", False, 3, 1)


def test_generate_seed_on_an_image_model_is_the_images_seed() -> None:
    """--seed sets an ar stage's sampling seed; on the demo (a diffusion stage) it seeds the
    images and is not refused as a flag that does not apply."""
    args = parse_args(["generate", "--prompt", "a 7", "--seed", "4"])
    graph = generate._graph(args)
    assert graph.stages[0].kind == "diffusion" and args.seed == 4


def test_generate_refuses_an_engine_flag_its_model_does_not_read() -> None:
    args = parse_args(["generate", "--prompt", "a 7", "--max-num-batched-tokens", "64"])
    with pytest.raises(ValueError, match="--max-num-batched-tokens does not apply"):
        generate._graph(args)


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """This interpreter as if `modules` were not installed (as find_spec sees it)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in modules else real(name, *a))


def test_missing_ray_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    _without(monkeypatch, "ray")
    rc = main(["generate", "--prompt", "a 7", "--worker-backend", "ray", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "backend ray needs omnistage's [ray] extra" in err and "pip install" in err, err

