"""QwenImagePipeline in our engine against diffusers' QwenImagePipeline and
QwenImageImg2ImgPipeline on a tiny random pipeline folder (float32, with and without true CFG):
same packed latents and images, the same image alone or batched with other requests (captions
of different lengths, CFG and no CFG, other grids, image-to-image), bad requests refused at the
boundary, and the folder served by `Omni`."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

import pytest
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.qwen_image import QwenImagePipeline
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SIZE = 64                       # pixels; the tiny VAE downsamples 8x: 8x8 latents, 4x4 tokens
C = 4                           # latent channels
PROMPT = "a photo of the sea shore"
NEGATIVE = "blurry, low quality"
THRESHOLD = 0.3                 # step caching: the tiny model's input moves ~0.12-0.2 a step


def build_reference(path: Path) -> diffusers.QwenImagePipeline:
    """diffusers' QwenImagePipeline from tiny random components, saved to `path`."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, rope_theta=10000.0, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=16),
        vocab_size=len(tokenizer))).eval()
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * C, out_channels=C, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4)).eval()
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=8, z_dim=C, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0]).eval()
    with torch.no_grad():   # diffusers zero-inits some layers: make every path count
        for p in transformer.parameters():
            p.normal_(0.0, 0.1)
        for m in transformer.modules():   # RMS weights near 1: attention peaked enough for
            if type(m).__name__ == "RMSNorm":   # the caption (and true CFG) to matter
                m.weight.normal_(1.0, 0.1)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(   # Qwen-Image's scheduler config
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
        num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True,
        time_shift_type="exponential")
    pipe = diffusers.QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                       tokenizer=tokenizer, transformer=transformer)
    return golden.save_reference(pipe, path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, diffusers.QwenImagePipeline]:
    path = tmp_path_factory.mktemp("qwen_image")
    return path, build_reference(path)


@pytest.fixture(scope="module")
def pair(folder: tuple[Path, diffusers.QwenImagePipeline]
         ) -> tuple[diffusers.QwenImagePipeline, QwenImagePipeline]:
    path, ref = folder
    ours = load_component("diffusion", "qwen_image").from_pretrained(path, "qwen_image",
                                                            torch.device("cpu"), torch.float32)
    return ref, ours


def png_bytes(size: tuple[int, int], seed: int = 0) -> bytes:
    """A random RGB image (width, height) as PNG bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# the last three: what diffusers warns about and ignores, ignored here too (logged)
@pytest.mark.parametrize("negative, cfg, guidance", [
    (None, 1.0, None), (NEGATIVE, 4.0, None), (None, 4.0, None), (NEGATIVE, 1.0, None),
    (None, 1.0, 3.5)], ids=["no-cfg", "true-cfg", "cfg-without-negative",
                            "negative-without-cfg", "guidance-scale"])
def test_matches_diffusers(pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline],
                           negative: str | None, cfg: float, guidance: float | None) -> None:
    ref, ours = pair
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4, true_cfg_scale=cfg,
                             negative_prompt=negative, guidance_scale=guidance, seed=0,
                             num_images=2)
    golden.matches_diffusers(ref, ours, PROMPT, params, shape=(2, (SIZE // 16) ** 2, 4 * C))


def test_encode_prompt_drops_the_template(pair: tuple[diffusers.QwenImagePipeline,
                                                      QwenImagePipeline]) -> None:
    ref, ours = pair
    with torch.no_grad():
        expected, mask = ref.encode_prompt(PROMPT, device=torch.device("cpu"))
    encoder = ours.prompt_encoder
    (got,) = encoder.encode_texts([PROMPT])                               # (L, hidden)
    assert mask is None and got.shape == expected.shape[1:]
    torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=0)
    longer, again = encoder.encode_texts(["a much longer prompt " * 3, PROMPT])  # one batch
    assert longer.shape[0] > got.shape[0]
    torch.testing.assert_close(again, got, atol=1e-6, rtol=0)    # right padding changes nothing


def test_true_cfg_changes_the_image(pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline]
                                    ) -> None:
    _, ours = pair
    images = {}
    for name, scale, neg in [("off", 1.0, None), ("neg", 4.0, NEGATIVE), ("space", 4.0, " ")]:
        engine = DiffusionEngine(ours)
        engine.add_request(name, PROMPT, DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=2, true_cfg_scale=scale,
            negative_prompt=neg, seed=7))
        images[name] = run_to_end(engine)[name].images.float()
    assert (images["off"] - images["neg"]).abs().max() > 2
    assert (images["neg"] - images["space"]).abs().max() > 2


def test_same_image_alone_or_batched(pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline]
                                     ) -> None:
    _, ours = pair

    def alone(rid: str, prompt: str, params: DiffusionParams) -> Tensor:
        engine = DiffusionEngine(ours)
        engine.add_request(rid, prompt, params)
        return run_to_end(engine)[rid].images

    a = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4, true_cfg_scale=4.0,
                        negative_prompt=NEGATIVE, seed=3)
    # same token count as a, other grid: one engine batch, its own image rope
    c = DiffusionParams(height=SIZE // 2, width=SIZE * 2, num_inference_steps=4, seed=5,
                        num_images=2)
    d = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3, true_cfg_scale=2.5,
                        negative_prompt="dark", seed=6)
    e = DiffusionParams(num_inference_steps=5, strength=0.5, seed=8,     # 3 steps, 64x64
                        image=png_bytes((SIZE, SIZE), seed=2))

    batched = DiffusionEngine(ours)
    batched.add_request("b", "the weather today is sunny with a light breeze", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=5, seed=4))
    batched.step()                                       # a, c join one step behind b
    batched.add_request("a", PROMPT, a)
    batched.add_request("c", "hello world", c)
    batched.step()
    batched.add_request("d", "a red cube", d)            # and d, e two steps behind
    batched.add_request("e", "a blue sphere", e)
    done = run_to_end(batched)
    assert batched.num_steps_run == 5                    # every step shared one batch
    for rid, prompt, params in [("a", PROMPT, a), ("c", "hello world", c),
                                ("d", "a red cube", d), ("e", "a blue sphere", e)]:
        expected = alone(rid, prompt, params)
        assert done[rid].images.shape == expected.shape
        assert (done[rid].images.int() - expected.int()).abs().max() <= 1, rid


@pytest.mark.parametrize("strength, negative, cfg", [(0.6, None, 1.0), (1.0, NEGATIVE, 4.0),
                                                    (0.3, NEGATIVE, 3.0)])
def test_image_to_image_matches_diffusers(
        pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline],
        monkeypatch: pytest.MonkeyPatch, strength: float, negative: str | None,
        cfg: float) -> None:
    """An input image (80x48, resized to the 64x64 asked for) encoded, noised to the
    strength-shortened schedule and denoised: latents and images equal
    QwenImageImg2ImgPipeline's."""
    ref, ours = pair
    data = png_bytes((80, 48), seed=1)
    seen = golden.record_latents(ours, monkeypatch, key=golden.size_seed)
    engine = DiffusionEngine(ours)
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=4, seed=2,
                             true_cfg_scale=cfg, negative_prompt=negative, image=data,
                             strength=strength, num_images=2)
    engine.add_request("a", PROMPT, params)
    (res,) = run_to_end(engine).values()
    assert res.metrics.num_steps == 4 - int(4 - 4 * strength)

    img2img = diffusers.QwenImageImg2ImgPipeline(**ref.components)
    img2img.set_progress_bar_config(disable=True)

    ref_latents, ref_images = (
        golden.reference(img2img, PROMPT, params, kind, image=Image.open(io.BytesIO(data)),
                         strength=strength) for kind in ("latent", "pt"))
    with torch.no_grad():
        images = ours.decode_float(seen[f"{SIZE}x{SIZE}:2"], params)
    golden.assert_latents_match(seen[f"{SIZE}x{SIZE}:2"], ref_latents)
    torch.testing.assert_close(images, ref_images, atol=1e-4, rtol=0)
    assert res.images.shape == (2, SIZE, SIZE, 3)


def test_image_to_image_size_and_bad_input(
        pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline]) -> None:
    engine = DiffusionEngine(pair[1])
    engine.add_request("ok", PROMPT, DiffusionParams(             # size: the image's, 80x48
        num_inference_steps=2, seed=0, image=png_bytes((80, 48))))
    with pytest.raises(ValueError, match="cannot be decoded"):
        engine.add_request("x", PROMPT, DiffusionParams(image=b"not an image at all"))
    with pytest.raises(ValueError, match="smaller than"):
        engine.add_request("y", PROMPT, DiffusionParams(image=png_bytes((8, 8))))
    assert list(engine.requests) == ["ok"]               # the good request is undisturbed
    assert run_to_end(engine)["ok"].images.shape == (1, 48, 80, 3)


@pytest.mark.parametrize("params, prompt, match", [
    (DiffusionParams(height=72, width=64), PROMPT, "multiple of 16"),
    (DiffusionParams(height=4096, width=64), PROMPT, "maximum is 2048"),
    (DiffusionParams(height=64, width=64), "  ", "non-empty"),
])
def test_refuses_bad_requests(pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline],
                              params: DiffusionParams, prompt: str, match: str) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_graph(
        folder: tuple[Path, diffusers.QwenImagePipeline]) -> None:
    from omnistage import Omni

    path, _ = folder
    with Omni(str(path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate("a red cube", DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=2, true_cfg_scale=4.0,
            negative_prompt=" ", seed=1))
        assert out.error is None and out.images[0].size == (SIZE, SIZE)
        (bad,) = omni.generate("a red cube", DiffusionParams(height=65, width=64))
        assert bad.finish_reason == "error" and "multiple of" in str(bad.error)


@pytest.mark.parametrize("negative, cfg", [(None, 1.0), (NEGATIVE, 4.0)],
                         ids=["no-cfg", "true-cfg"])
def test_step_caching(pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline],
                      negative: str | None, cfg: float) -> None:
    """Threshold 0 equals no caching exactly; a positive threshold skips steps (counted), keeps
    close to the uncached image, and does not change what other requests in the batch get (a
    neighbour with true CFG and a longer caption: other caption padding every step)."""
    _, ours = pair

    def params(threshold: float | None) -> DiffusionParams:
        return DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=12, seed=9,
                               true_cfg_scale=cfg, negative_prompt=negative,
                               cache_threshold=threshold)

    neighbour = ("the weather today is sunny with a light breeze", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=12, true_cfg_scale=3.0,
        negative_prompt="dark", seed=1))

    def generate(threshold: float | None, with_neighbour: bool = False
                 ) -> dict[str, DiffusionResult]:
        engine = DiffusionEngine(ours)
        engine.add_request("a", PROMPT, params(threshold))
        if with_neighbour:
            engine.add_request("b", *neighbour)
        return run_to_end(engine)

    plain = generate(None)["a"]
    zero = generate(0.0)["a"]
    assert zero.metrics.num_steps_skipped == 0
    assert torch.equal(zero.images, plain.images)
    cached = generate(THRESHOLD, with_neighbour=True)
    skipped = cached["a"].metrics.num_steps_skipped
    assert 0 < skipped < 10, skipped
    assert cached["b"].metrics.num_steps_skipped == 0
    diff = (cached["a"].images.float() - plain.images.float()).abs().mean()
    assert diff < 5, f"mean pixel change {diff}"           # ~0.7 / 255 with 5 of 12 skipped
    alone_b = DiffusionEngine(ours)
    alone_b.add_request("b", *neighbour)
    assert (run_to_end(alone_b)["b"].images.int() - cached["b"].images.int()).abs().max() <= 1


def test_step_caching_keeps_branches_apart(
        pair: tuple[diffusers.QwenImagePipeline, QwenImagePipeline]) -> None:
    """With true CFG the conditional and unconditional passes keep their own cache state: each
    reuses its own residual (the image stream's modulated input is the same for both, so they
    skip the same steps)."""
    _, ours = pair
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=12, seed=9, true_cfg_scale=4.0,
        negative_prompt=NEGATIVE, cache_threshold=THRESHOLD))
    req = engine.requests["a"]
    while engine.has_unfinished_requests:
        engine.step()
    assert set(req.cache) == {"cond", "uncond"}
    cond, uncond = req.cache["cond"], req.cache["uncond"]
    assert not torch.equal(cond.residual, uncond.residual)
    assert cond.num_skipped == uncond.num_skipped > 0


@pytest.mark.parametrize("negative, cfg", [(None, 1.0), (NEGATIVE, 4.0)],
                         ids=["no-cfg", "true-cfg"])
def test_text_encoder_in_its_own_stage(folder: tuple[Path, diffusers.QwenImagePipeline],
                                       negative: str | None, cfg: float) -> None:
    """qwen_image_split.yaml: Qwen2.5-VL in a text-encoder stage (captions of different
    lengths encoded in one right-padded batch), the diffusion stage without it: the same
    images as the default single-stage graph."""
    from omnistage import Omni

    path, _ = folder
    prompts = ["a red cube", "the weather today is sunny with a light breeze"]
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=2, seed=1,
                             true_cfg_scale=cfg, negative_prompt=negative)
    images = {}
    for graph in (None, "qwen_image_split"):
        with Omni(str(path), stage_config=graph, device="cpu", backend="inproc",
                  connector="inproc") as omni:
            outs = omni.generate(prompts, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        images[graph] = [o.tensors["images"] for o in outs]
    assert list(outs[0].stage_metrics) == ["text_encoder", "dit"]
    for split, single in zip(images["qwen_image_split"], images[None]):
        assert (split.int() - single.int()).abs().max() <= 1


def test_cuda_graph_replays_equal_eager(pair: tuple[diffusers.QwenImagePipeline,
                                                    QwenImagePipeline],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformer's forward from graphs (captured on CPU by a stand-in whose replay
    reruns it on the graph's input buffers, as CUDA's would read them): requests joining at
    different steps, CFG and not, captions of other lengths (a mask), two grids. Every latent
    equals the eager run's; the shapes seen twice were captured and replayed."""
    from omnistage.layers import graph_capture
    from omnistage.testing.graph_emulation import rerun_capture

    _, ours = pair
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)

    def serve() -> dict[str, Tensor]:
        seen = golden.record_latents(ours, monkeypatch, key=golden.size_seed)
        engine = DiffusionEngine(ours)
        engine.add_request("a", PROMPT, DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=6, true_cfg_scale=4.0,
            negative_prompt=NEGATIVE, seed=3))
        engine.step()
        engine.step()
        engine.add_request("b", "a red cube", DiffusionParams(
            height=SIZE, width=SIZE, num_inference_steps=5, seed=4, num_images=2))
        engine.add_request("c", "hello", DiffusionParams(
            height=SIZE // 2, width=SIZE * 2, num_inference_steps=4, seed=5))
        run_to_end(engine)
        monkeypatch.undo()                  # the decode spy (and the capture stand-in)
        monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
        return seen

    eager = serve()
    ours.use_cuda_graphs()
    try:
        graphed = serve()
        graphs = ours.graphs
    finally:
        ours.graphs = None
    assert graphs is not None and len(graphs.graphs) >= 2 and graphs.num_replays >= 6
    assert eager.keys() == graphed.keys() and len(eager) == 3
    for key in eager:
        assert eager[key].abs().max() > 0.5
        assert torch.equal(graphed[key], eager[key]), key
