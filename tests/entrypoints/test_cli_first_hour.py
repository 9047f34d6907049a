"""What a new user meets first on the command line: help and argument errors before any heavy
import, one line per error, hints only where they help, vLLM's dtype names, and the same engine
flags on `generate` as on `serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.entrypoints.cli import generate
from omnistage.entrypoints.cli.main import main, parse_args

HEAVY = ("torch", "transformers", "numpy", "fastapi")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["serve", "--max-num-seq", "3"], ["serve", "--port", "x"],
                                  []])
def test_help_and_argument_errors_import_nothing_heavy(argv: list[str]) -> None:
    """In a fresh interpreter: the answer comes before torch or transformers are imported (the
    10-15 s they cost was the wait for `omnistage --help`)."""
    code = ("import sys\nfrom omnistage.entrypoints.cli.main import main\n"
            f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print('RC', rc, 'HEAVY', heavy, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "HEAVY []" in done.stderr, done.stderr[-2000:]
    assert done.stdout or done.stderr


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
    ("--stage-configs-path", "use --stage-config"),
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


def test_missing_diffusers_is_found_before_any_stage_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A diffusers pipeline with no native port runs on the generic adapter, which needs the
    diffusers extra: refused in the constructor, before a stage process spawns."""
    from omnistage.engine import async_omni

    (tmp_path / "model_index.json").write_text('{"_class_name": "KandinskyPipeline"}')
    _without(monkeypatch, "diffusers")
    monkeypatch.setattr(async_omni, "Orchestrator",
                        lambda *a, **k: pytest.fail("a stage started"))
    with pytest.raises(RuntimeError, match=r"this model needs omnistage's \[diffusers\] extra"):
        async_omni.AsyncOmni(str(tmp_path), device="cpu")


def test_async_with_async_omni_stops_its_stages(tiny_qwen3: Path) -> None:
    import asyncio

    from omnistage import AsyncOmni, SamplingParams

    async def go() -> tuple[str, AsyncOmni]:
        async with AsyncOmni(str(tiny_qwen3), device="cpu", max_model_len=64) as engine:
            text = ""
            async for out in engine.generate("Hi", SamplingParams(max_tokens=3)):
                text = out.text
            return text, engine

    text, engine = asyncio.run(go())
    assert text and engine.orchestrator._closed   # shut down on leaving the block


def test_progress_in_a_pipe_is_plain_lines(tmp_path: Path) -> None:
    """One prompt (a bar for one request too), stderr a pipe: plain lines, no tqdm frames."""
    done = subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli.main", "generate",
                           "--prompt", "a 3", "--steps", "30", "--num-images", "2",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr, done.stderr[-3000:]
    lines = [l for l in done.stderr.splitlines() if l.startswith("Processed prompts: ")]
    assert lines and lines[-1].startswith("Processed prompts: 1 in "), done.stderr[-3000:]
    assert len(list(tmp_path.glob("*.png"))) == 2
