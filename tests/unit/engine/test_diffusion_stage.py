"""A diffusion stage behind the orchestrator: the digits pipeline served in-process and in a
stage process, with images out and clear errors for bad requests."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from omnistage import AsyncOmni, Omni
from omnistage.diffusion.params import DiffusionParams


def graph(model: Path, backend: str) -> str:
    connector = "inproc" if backend == "inproc" else "shm"
    return (f"model: {model}\nbackend: {backend}\nconnector: {connector}\nstages:\n"
            "  - {name: dit, kind: diffusion, component: digits_dit, final: image}\n")


def test_progress_streams_to_the_caller_that_asks(random_digits: Path) -> None:
    """One update per denoising step for a caller that asks (`want_progress`); one that does
    not gets only the end (the orchestrator routes it no progress-only event)."""
    engine = AsyncOmni(stage_config=graph(random_digits, "inproc"), device="cpu")
    try:
        async def collect(want_progress: bool) -> list:
            return [out async for out in engine.generate(
                "four", DiffusionParams(num_inference_steps=4, seed=1),
                want_progress=want_progress)]

        outs = asyncio.run(collect(True))
        quiet = asyncio.run(collect(False))
    finally:
        engine.shutdown()
    progress = [o.progress for o in outs]
    assert progress == [0.25, 0.5, 0.75, 1.0]
    assert outs[-1].finished and outs[-1].images and not outs[0].delta_tensors
    assert len(quiet) == 1 and quiet[0].finished and quiet[0].images


def test_image_to_image_and_bad_images(random_digits: Path) -> None:
    """An input image (a PIL image or encoded bytes) shortens the schedule by its strength; an
    undecodable image is refused before anything is scheduled (ValueError); a request a stage
    refuses comes back marked as bad input; the engine keeps serving throughout."""
    import io

    from PIL import Image

    start = Image.new("RGB", (24, 24))
    start.paste((255, 255, 255), (8, 2, 16, 22))              # a light bar on black: a "1"
    with Omni(stage_config=graph(random_digits, "inproc"), device="cpu") as omni:
        (out,) = omni.generate("one", DiffusionParams(num_inference_steps=10, seed=2,
                                                      image=start, strength=0.5))
        assert out.error is None and out.images[0].size == (64, 64)
        assert out.stage_metrics["dit"].num_steps == 5
        buf = io.BytesIO()
        start.save(buf, format="JPEG")
        (same,) = omni.generate("one", DiffusionParams(num_inference_steps=10, seed=2,
                                                       image=buf.getvalue(), strength=1.0))
        assert same.stage_metrics["dit"].num_steps == 10

        for bad in (b"\x89PNG\r\n\x1a\n truncated", b"GIF89a", b"hello"):
            with pytest.raises(ValueError, match="image: cannot be decoded"):
                omni.generate("one", DiffusionParams(image=bad))
        (refused,) = omni.generate("one", DiffusionParams(height=12, width=64))
        assert refused.finish_reason == "error" and refused.invalid_input
        assert "multiple of 8" in str(refused.error)
        info = refused.error                   # typed: the stage, the kind, the message
        assert info.stage == "dit" and info.kind == "invalid_input"
        assert "multiple of 8" in info.message and not info.message.startswith("stage")
        (again,) = omni.generate("seven", DiffusionParams(num_inference_steps=2, seed=0))
        assert again.error is None and not again.invalid_input and again.images


def test_compiled_blocks_draw_the_same_images(random_digits: Path) -> None:
    """`diffusion: {compile: ...}` compiles the transformer's blocks (the eager backend here,
    so the test needs no C++ toolchain): the same image as without. `options` the pipeline's
    record lacks are refused with their path, `compile` there with where it moved."""
    def images(diffusion: str) -> torch.Tensor:
        text = (f"model: {random_digits}\nbackend: inproc\nconnector: inproc\nstages:\n"
                "  - {name: dit, kind: diffusion, component: digits_dit, final: image, "
                f"diffusion: {diffusion}}}\n")
        with Omni(stage_config=text, device="cpu") as omni:
            (out,) = omni.generate("three", DiffusionParams(num_inference_steps=3, seed=4))
        return out.tensors["images"]

    assert torch.equal(images("{compile: eager}"), images("{}"))
    with pytest.raises(RuntimeError, match=r"diffusion.options.fast: unknown key"):
        images("{options: {fast: true}}")
    with pytest.raises(RuntimeError, match=r"options.compile: moved to diffusion.compile"):
        images("{options: {compile: eager}}")


def test_compile_and_graphs_defaults_on_cuda(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """On a CUDA device a pipeline whose `compile_default` says so compiles its blocks (both
    of Wan 2.2's experts, where there are two) on one rank, with inductor's cache in the
    persistent folder; one whose transformer captures replays CUDA graphs. A stage of several
    ranks, `compile: false` or a CPU device compile nothing; `compile: true` compiles any;
    a user's TORCHINDUCTOR_CACHE_DIR is kept."""
    from types import SimpleNamespace

    from omnistage.configs.schema import StageConfig
    from omnistage.configs.strict import from_dict
    from omnistage.stages.diffusion import apply_options

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path))

    def run(device: str, compile_default: bool = True, graphable: bool = False,
            **stage: object) -> SimpleNamespace:
        blocks = [torch.nn.ModuleList([torch.nn.Linear(2, 2)]) for _ in range(2)]
        pipe = SimpleNamespace(graphable=graphable, compile_default=compile_default,
                               graphs=None, denoisers=lambda: [torch.nn.Sequential(b)
                                                               for b in blocks])
        pipe.use_cuda_graphs = lambda n: setattr(pipe, "graphs", n)
        apply_options(from_dict(StageConfig, {"name": "dit", "kind": "diffusion", **stage}), pipe,
                      torch.device(device))
        pipe.compiled = [isinstance(b[0], torch._dynamo.eval_frame.OptimizedModule)
                         for b in blocks]
        return pipe

    compiled = run("cuda")
    assert compiled.compiled == [True, True] and not compiled.graphs
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    graphed = run("cuda", compile_default=False, graphable=True)
    assert graphed.compiled == [False, False] and graphed.graphs
    assert run("cuda", diffusion={"compile": False}).compiled == [False, False]
    assert run("cuda", parallel={"ulysses": 2}, placement={"devices": [0, 1]}).compiled == [False, False]
    assert run("cpu").compiled == [False, False] and run("cpu", graphable=True).graphs is None
    assert run("cpu", compile_default=False, diffusion={"compile": "eager"}).compiled == \
        [True, True]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    run("cuda")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_request_whose_routing_raises_ends_with_the_error(random_digits: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """An exception while the orchestrator routes a stage's output (once lost the request:
    its client waited for ever) ends that request with the error; the next one is served."""
    with Omni(stage_config=graph(random_digits, "inproc"), device="cpu") as omni:
        orchestrator = omni.engine.orchestrator
        real = orchestrator._route
        broken: list[str] = []

        def route(out):  # type: ignore[no-untyped-def]
            if not broken:
                broken.append(out.request_id)
                raise RuntimeError("a routing bug")
            return real(out)

        monkeypatch.setattr(orchestrator, "_route", route)
        done: list = []          # a daemon thread: were the request lost, the test fails
        waiter = threading.Thread(target=lambda: done.extend(omni.generate(
            "four", DiffusionParams(num_inference_steps=3))), daemon=True)
        waiter.start()
        waiter.join(timeout=60)
        assert done, "the request never ended"
        (out,) = done
        assert broken == [out.request_id]
        assert out.finish_reason == "error" and "a routing bug" in str(out.error)
        assert orchestrator.num_requests == 0
        (again,) = omni.generate("four", DiffusionParams(num_inference_steps=2))
        assert again.error is None and again.images
