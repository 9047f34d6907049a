"""Text encoding as a stage of its own, on a tiny random Z-Image pipeline folder (float32): the
diffusion engine parks a request until its conditioning arrives; the text-encoder engine
batches prompts; the split graph (z_image_split.yaml; in-process, and in stage processes over
shared memory) draws the same images as the single-stage graph, frees an aborted request in
both stages, and refuses bad requests cleanly."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import pytest
import torch

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.outputs import OmniOutput, RequestEvent
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SIZE = 32                       # pixels: 16x16 latents, 8x8 patches
NEGATIVE = "blurry, low quality"
# (prompt, params): CFG with a negative prompt, CFG with the default "" one, no CFG
REQUESTS = [
    ("a photo of the sea shore", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=4.0,
        negative_prompt=NEGATIVE, seed=1, num_images=2)),
    ("hello world", DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=2, seed=2)),
    ("a red cube", DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4,
                                   guidance_scale=0.0, seed=3)),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """diffusers' ZImagePipeline from tiny random components, saved as a pipeline folder."""
    path = tmp_path_factory.mktemp("z_image")
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    text_encoder = transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        pad_token_id=0))
    transformer = diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
        axes_lens=[128, 32, 32])
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    with torch.no_grad():   # diffusers zero-inits some layers: make every path count
        for model in (transformer, vae):
            for p in model.parameters():
                p.normal_(0.0, 0.1)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                         use_dynamic_shifting=False)
    diffusers.ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=transformer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def single_stage_images(folder: Path) -> list[torch.Tensor]:
    """What the default (single-stage) graph draws for REQUESTS."""
    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        assert omni.engine.graph.stage_names == ["dit"]
        outs = [omni.generate(prompt, params)[0] for prompt, params in REQUESTS]
    assert all(o.error is None for o in outs)
    return [o.tensors["images"] for o in outs]


# ---- the engines ---------------------------------------------------------------------------

# ---- the split graph -----------------------------------------------------------------------

def generate_together(omni: Omni, requests: list[tuple[str, DiffusionParams]]
                      ) -> list[OmniOutput]:
    """Submit every request at once (the text-encoder stage may batch them); wait for all."""
    events: queue.Queue[RequestEvent] = queue.Queue()
    outs = [omni.engine.submit(prompt, params, sink=events.put) for prompt, params in requests]
    by_id = {o.request_id: o for o in outs}
    while not all(o.finished for o in outs):
        ev = events.get(timeout=60)
        by_id[ev.request_id].apply(ev)
    return outs


@pytest.mark.parametrize("backend, connector", [("inproc", "inproc"), ("process", "shm")])
def test_split_graph_draws_what_the_single_stage_graph_draws(
        folder: Path, single_stage_images: list[torch.Tensor], backend: str,
        connector: str) -> None:
    """The requests submitted together (the text-encoder stage batches what it finds queued);
    then requests aborted at once, whatever state each reached, leave no request in either
    stage and, over shared memory, no segment behind."""
    with Omni(str(folder), stage_config="z_image_split", device="cpu", backend=backend,
              connector=connector) as omni:
        assert omni.engine.graph.stage_names == ["text_encoder", "dit"]
        outs = generate_together(omni, REQUESTS)
        for out, expected, (_, params) in zip(outs, single_stage_images, REQUESTS):
            assert out.error is None, out.error
            assert out.tensors["images"].shape == (params.num_images, SIZE, SIZE, 3)
            assert (out.tensors["images"].int() - expected.int()).abs().max() <= 1
            dit, text = out.stage_metrics["dit"], out.stage_metrics["text_encoder"]
            assert dit.num_steps == params.num_inference_steps
            assert dit.conditioning_wait_time >= 0 and text.encode_time >= 0
            assert text.connector_bytes_out > 0 and dit.connector_bytes_in > 0

        sink: queue.Queue[RequestEvent] = queue.Queue()
        for i in range(3):
            omni.engine.submit(*REQUESTS[1], request_id=f"gone-{i}", sink=sink.put)
            time.sleep(0.05 * i)
            omni.engine.abort(f"gone-{i}")
        namespace = omni.engine.orchestrator.resources["shm_namespace"]

        def freed() -> bool:
            stats = omni.engine.orchestrator.stage_stats()
            segments = [n for n in os.listdir("/dev/shm") if n.startswith(namespace + "_")]
            return not segments and all(s.num_requests == s.num_engine_requests == 0
                                        for s in stats.values())

        assert wait_for(freed, timeout=20)
        events = [sink.get_nowait() for _ in range(sink.qsize())]
        done = {ev.request_id: ev.finish_reason for ev in events if ev.done}
        assert done["gone-0"] == "abort" and set(done) == {"gone-0", "gone-1", "gone-2"}
        assert all(reason in ("abort", "stop") for reason in done.values())  # maybe finished
        last = {ev.request_id: ev for ev in events}
        assert all(ev.done for ev in last.values())           # nothing after a request's end


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False

