"""Text encoding as a stage of its own, on a tiny random Z-Image pipeline folder (float32): the
diffusion engine parks a request until its conditioning arrives; the text-encoder engine
batches prompts; the split graph (z_image_split.yaml; in-process, and in stage processes over
shared memory) draws the same images as the single-stage graph, frees an aborted request in
both stages, and refuses bad requests cleanly."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from omnistage import Omni
from omnistage.configs.defaults import resolve_graph
from omnistage.configs.schema import StageConfig, StageInput
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.z_image import ZImagePipeline, ZImagePromptEncoder
from omnistage.diffusion.text_encoding import TextEncodingEngine
from omnistage.outputs import RequestEvent
from omnistage.stages.diffusion import DiffusionStage
from omnistage.testing.diffusion import run_to_end
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


# ---- the engines ---------------------------------------------------------------------------

def test_engine_waits_for_conditioning_and_draws_the_same_image(folder: Path) -> None:
    cpu = torch.device("cpu")
    full = ZImagePipeline.from_pretrained(folder, "z_image", cpu, torch.float32)
    bare = ZImagePipeline.from_pretrained(folder, "z_image", cpu, torch.float32,
                                          text_encoders=False)
    encoder = ZImagePipeline.load_prompt_encoder(folder, cpu, torch.float32)
    assert bare.prompt_encoder is None
    prompt, params = REQUESTS[0]

    alone = DiffusionEngine(full)
    alone.add_request("a", prompt, params)
    expected = run_to_end(alone)["a"]

    engine = DiffusionEngine(bare)
    engine.add_request("a", None, params)
    assert engine.is_parked("a") and engine.has_unfinished_requests
    assert engine.step() == [] and engine.num_steps_run == 0          # nothing to denoise yet
    with pytest.raises(ValueError, match="loads no text encoder"):
        engine.add_request("b", prompt, params)
    (cond,) = encoder.encode([prompt], [params])
    engine.set_conditioning("a", cond)
    with pytest.raises(ValueError, match="already has its conditioning"):
        engine.set_conditioning("a", cond)
    got = run_to_end(engine)["a"]
    assert torch.equal(got.images, expected.images)
    assert got.metrics.conditioning_wait_time >= 0
    assert got.metrics.num_steps == params.num_inference_steps


def test_engine_refuses_bad_conditioning_and_aborts_parked(folder: Path) -> None:
    bare = ZImagePipeline.from_pretrained(folder, "z_image", torch.device("cpu"),
                                          torch.float32, text_encoders=False)
    engine = DiffusionEngine(bare)
    engine.add_request("cfg", None, REQUESTS[0][1])               # CFG: needs the negative
    emb = torch.randn(7, 16)
    for tensors, match in [
            ({"prompt_embeds": emb}, r"missing \['negative_prompt_embeds'\]"),
            ({"prompt_embeds": emb, "negative_prompt_embeds": emb, "pooled": emb},
             r"unexpected \['pooled'\]"),
            ({"prompt_embeds": torch.randn(7, 8), "negative_prompt_embeds": emb},
             r"conditioning\['prompt_embeds'\].*the last 16"),
            ({"prompt_embeds": emb[None], "negative_prompt_embeds": emb}, "2 dimensions")]:
        with pytest.raises(ValueError, match=match):
            engine.set_conditioning("cfg", tensors)
        assert engine.is_parked("cfg")                          # refused: still waiting
    with pytest.raises(KeyError, match="not waiting"):
        engine.set_conditioning("nobody", {"prompt_embeds": emb})
    with pytest.raises(ValueError, match="multiple of"):    # params checked at add, as ever
        engine.add_request("bad", None, DiffusionParams(height=SIZE + 2, width=SIZE))
    assert engine.abort("cfg") is not None
    assert not engine.has_unfinished_requests and engine.num_unfinished_requests == 0


def test_text_encoding_engine_batches_requests(folder: Path) -> None:
    encoder = ZImagePromptEncoder.from_pretrained(folder, torch.device("cpu"), torch.float32)
    engine = TextEncodingEngine(encoder, max_num_seqs=2)
    for i, (prompt, params) in enumerate(REQUESTS):
        engine.add_request(f"r{i}", prompt, params)
    with pytest.raises(ValueError, match="prompt: must be non-empty"):
        engine.add_request("empty", "  ", REQUESTS[1][1])
    with pytest.raises(ValueError, match="negative_prompt: has no effect"):
        engine.add_request("neg", "x", DiffusionParams(guidance_scale=0.0, negative_prompt="y"))
    first, second = engine.step(), engine.step()
    assert [r.request_id for r in first] == ["r0", "r1"]
    assert [r.request_id for r in second] == ["r2"]
    assert engine.num_batches_run == 2 and not engine.has_unfinished_requests
    assert first[0].metrics.num_batched_requests == 2
    for r, (prompt, params) in zip(first + second, REQUESTS):
        assert r.error is None
        (alone,) = encoder.encode([prompt], [params])
        assert r.tensors.keys() == alone.keys()
        assert ("negative_prompt_embeds" in alone) == (params.guidance(5.0) > 0)
        for key, t in alone.items():                  # batched rows: the same up to rounding
            torch.testing.assert_close(r.tensors[key], t, atol=1e-5, rtol=0)


# ---- the split graph -----------------------------------------------------------------------

def test_split_graph_by_name(folder: Path) -> None:
    graph = resolve_graph(str(folder), folder, "z_image_split")
    text, dit = graph.stages
    assert (text.component, dit.component) == ("z_image.text_encoder", "z_image")
    assert [i.source for i in dit.inputs] == ["text_encoder"] and text.final is None
    assert resolve_graph(str(folder), folder, "z_image_split.yaml") == graph
    with pytest.raises(ValueError, match="no packaged graph of that name.*z_image_split"):
        resolve_graph(str(folder), folder, "z_image_splitt")
    with pytest.raises(ValueError, match="can only be 'text_encoder'"):
        DiffusionStage(StageConfig("dit", "diffusion", "z_image.vae"), str(folder), "cpu")
    with pytest.raises(ValueError, match="takes no input edge"):
        DiffusionStage(StageConfig("te", "diffusion", "z_image.text_encoder",
                                   inputs=(StageInput("dit", "tensors"),)), str(folder), "cpu")
    with pytest.raises(ValueError, match="encodes its own prompts"):
        DiffusionStage(StageConfig("te", "diffusion", "digits_dit.text_encoder"), None, "cpu")


def test_an_edit_through_the_split_graph(folder: Path) -> None:
    """An image-to-image request in the split graph (over shared memory): its image file goes
    through the connector and reaches the diffusion stage; the image equals the single-stage
    graph's, and no segment stays behind."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((torch.arange(SIZE * SIZE * 3) % 251).to(torch.uint8)
                    .reshape(SIZE, SIZE, 3).numpy()).save(buf, format="PNG")
    params = DiffusionParams(num_inference_steps=4, seed=5, image=buf.getvalue(), strength=0.5)
    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        (single,) = omni.generate("a red cube", params)
    with Omni(str(folder), stage_config="z_image_split", device="cpu", backend="inproc",
              connector="shm") as omni:
        (split,) = omni.generate("a red cube", params)
        namespace = omni.engine.orchestrator.resources["shm_namespace"]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(namespace + "_")]
    assert single.error is None and split.error is None, (single.error, split.error)
    assert split.stage_metrics["dit"].num_steps == single.stage_metrics["dit"].num_steps == 2
    assert (split.tensors["images"].int() - single.tensors["images"].int()).abs().max() <= 1


def test_abort_while_waiting_for_conditioning(folder: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, the text encoder held inside its batch: the diffusion stage holds the request
    parked; an abort frees it there at once, and in the text-encoder stage once its batch ends
    (the conditioning it then sends is dropped). The stages go on serving."""
    entered, gate = threading.Event(), threading.Event()
    encode = ZImagePromptEncoder.encode

    def held_encode(self: ZImagePromptEncoder, prompts: list[str],
                    params: list[DiffusionParams]) -> list[dict[str, torch.Tensor]]:
        if "held" in prompts:
            entered.set()
            assert gate.wait(30), "the test never released the text encoder"
        return encode(self, prompts, params)

    engines: list[DiffusionEngine] = []
    init = DiffusionEngine.__init__

    def recording_init(self: DiffusionEngine, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(ZImagePromptEncoder, "encode", held_encode)
    monkeypatch.setattr(DiffusionEngine, "__init__", recording_init)
    with Omni(str(folder), stage_config="z_image_split", device="cpu", backend="inproc",
              connector="inproc") as omni:
        (dit,) = engines
        events: queue.Queue[RequestEvent] = queue.Queue()
        omni.engine.submit("held", REQUESTS[0][1], request_id="held", sink=events.put)
        assert entered.wait(30)
        assert wait_for(lambda: dit.is_parked("held"))
        omni.engine.abort("held")
        ev = events.get(timeout=10)
        assert ev.done and ev.finish_reason == "abort"
        assert wait_for(lambda: not dit.has_unfinished_requests)    # freed while still waiting
        gate.set()
        stats = omni.engine.orchestrator.stage_stats()   # answered after the abort is applied
        assert all(s.num_requests == s.num_engine_requests == 0 for s in stats.values())
        (after,) = omni.generate(*REQUESTS[1])
        assert after.error is None and after.images
        assert events.empty()                  # nothing more came for the aborted request


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_bad_requests_are_refused_cleanly(folder: Path) -> None:
    with Omni(str(folder), stage_config="z_image_split", device="cpu", backend="inproc",
              connector="inproc") as omni:
        (bad_size,) = omni.generate("a red cube", DiffusionParams(height=SIZE + 1, width=SIZE))
        assert bad_size.finish_reason == "error" and bad_size.invalid_input
        assert "stage 'dit'" in str(bad_size.error) and "multiple of" in str(bad_size.error)
        (bad_neg,) = omni.generate("a red cube", DiffusionParams(
            height=SIZE, width=SIZE, guidance_scale=0.0, negative_prompt="dark"))
        assert bad_neg.finish_reason == "error" and bad_neg.invalid_input
        assert "negative_prompt: has no effect" in str(bad_neg.error)
        with pytest.raises(ValueError, match="empty"):
            omni.generate("   ", REQUESTS[1][1])
        time.sleep(0.2)     # the text stage may still encode a refused request: then it drops it
        stats = omni.engine.orchestrator.stage_stats()
        assert all(s.num_requests == s.num_engine_requests == 0 for s in stats.values())
        (good,) = omni.generate(*REQUESTS[2])
        assert good.error is None and good.images[0].size == (SIZE, SIZE)
