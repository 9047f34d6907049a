"""Our StableDiffusion3Pipeline in our engine against diffusers' on a tiny random
SD3.5-medium-like folder (qk RMS-norm, a dual-attention block; CLIP-L and CLIP-G with
projection, T5, the 16-channel-style VAE with shift and scaling), float32: two prompts batched
with CFG and a negative prompt over several steps, skip-layer guidance, the images; a second
folder of odd sizes (TinySD3: the builder takes them) with an image larger than its VAE's
sample_size; bad requests refused at the boundary; served through `Omni` by its default
graph."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines import sd3
from omnistage.diffusion.pipelines.sd3 import SkipLayerGuidance
from omnistage.testing.diffusion import run_alone, run_recording_latents
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

SEQ = 12                        # T5 max_sequence_length
HEIGHT, WIDTH = 20, 36          # pixels: the tiny VAE halves them, patches of 2 -> 5x9 tokens
PROMPTS = ("a photo of the sea shore", "the weather today is sunny")
NEGATIVE = "blurry, low quality"
STEPS, GUIDANCE, SEEDS = 4, 4.5, (0, 7)
Pair = tuple["diffusers.StableDiffusion3Pipeline", sd3.StableDiffusion3Pipeline, Path]


@dataclass(frozen=True)
class TinySD3:
    """The sizes of a tiny random SD3.5 folder. BASE: the medium-like folder most tests use;
    ODD: one where nothing happens to line up (caption projection 24 against the T5 width 56,
    CLIPs 16 + 32 zero-padded to 56, 16 latent channels, the VAE's sample_size left at
    diffusers' default of 32 px, so every image here is larger than it)."""

    clip_widths: tuple[int, int] = (32, 24)
    clip_projection: int = 12               # each CLIP's; pooled = 2x this
    t5_width: int = 40                      # = the transformer's joint_attention_dim
    heads: int = 2
    head_dim: int = 8                       # caption_projection_dim = heads * head_dim
    sample_size: int = 16
    pos_embed_max_size: int = 12
    latent_channels: int = 4
    vae_sample_size: int | None = 64        # None: diffusers' default (32)
    shift_factor: float = 0.0609
    scaling_factor: float = 1.5305


BASE = TinySD3()
ODD = TinySD3(clip_widths=(16, 32), clip_projection=20, t5_width=56, heads=4, head_dim=6,
              sample_size=24, pos_embed_max_size=40, latent_channels=16, vae_sample_size=None,
              shift_factor=0.07, scaling_factor=1.3)


def clip(vocab: int, hidden: int, projection: int) -> transformers.CLIPTextModelWithProjection:
    return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=3, max_position_embeddings=77, projection_dim=projection,
        hidden_act="gelu", bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()


def build_reference(path: Path, sizes: TinySD3 = BASE) -> diffusers.StableDiffusion3Pipeline:
    """diffusers' StableDiffusion3Pipeline from tiny random components, saved to `path`."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    tokenizer.model_max_length = 77                     # CLIP's; diffusers pads to it
    vocab = len(tokenizer)
    text_encoder_3 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=vocab, d_model=sizes.t5_width, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0)).eval()
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=sizes.sample_size, patch_size=2, in_channels=sizes.latent_channels,
        num_layers=3, attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads,
        joint_attention_dim=sizes.t5_width, caption_projection_dim=sizes.heads * sizes.head_dim,
        pooled_projection_dim=2 * sizes.clip_projection, out_channels=sizes.latent_channels,
        pos_embed_max_size=sizes.pos_embed_max_size, dual_attention_layers=(0,),
        qk_norm="rms_norm").eval()
    vae_sample_size = {} if sizes.vae_sample_size is None else {
        "sample_size": sizes.vae_sample_size}
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=sizes.latent_channels, norm_num_groups=4, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=sizes.shift_factor,
        scaling_factor=sizes.scaling_factor, **vae_sample_size).eval()
    golden.randomize(transformer, vae, std=0.15, keep=("pos_embed.pos_embed",))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)      # SD3's config
    width_l, width_g = sizes.clip_widths
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=clip(vocab, width_l, sizes.clip_projection), tokenizer=tokenizer,
        text_encoder_2=clip(vocab, width_g, sizes.clip_projection), tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer)
    return golden.save_reference(pipe, path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    path = tmp_path_factory.mktemp("sd3")
    ref = build_reference(path)
    ours = golden.load_ours(path, "sd3")
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours, path


def reference(ref: diffusers.StableDiffusion3Pipeline, output_type: str, **kwargs: object
              ) -> torch.Tensor:
    """Both prompts in one diffusers call, one generator per prompt (as ours: per request)."""
    params = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                             guidance_scale=GUIDANCE, negative_prompt=NEGATIVE)
    kwargs = {"max_sequence_length": SEQ, **kwargs}
    return golden.reference(ref, list(PROMPTS), params, output_type, seeds=SEEDS, **kwargs)


def run_ours(ours: sd3.StableDiffusion3Pipeline) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Both prompts through our engine, the second joining one step after the first."""
    params = [DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                              guidance_scale=GUIDANCE, negative_prompt=NEGATIVE, seed=s)
              for s in SEEDS]

    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        engine.add_request("a", PROMPTS[0], params[0])
        engine.step()
        engine.add_request("b", PROMPTS[1], params[1])
        return {"a": params[0], "b": params[1]}

    seen, engine = run_recording_latents(ours, drive)
    assert engine.num_steps_run == STEPS + 1             # "b" shared every step but a's first
    return [seen["a"], seen["b"]]


def test_matches_diffusers(pair: Pair) -> None:
    ref, ours, _ = pair
    got = run_ours(ours)
    latents = torch.cat([g[0] for g in got])
    golden.assert_latents_match(latents, reference(ref, "latent"),
                                shape=(2, 4, HEIGHT // 2, WIDTH // 2))
    expected_images = reference(ref, "pt")                               # (2, 3, H, W) in [0, 1]
    with torch.no_grad():
        images = ours.decode_float(latents, DiffusionParams(height=HEIGHT, width=WIDTH))
    torch.testing.assert_close(images, expected_images, atol=1e-4, rtol=0)
    golden.assert_output_matches(torch.cat([g[1] for g in got]), expected_images)


def test_odd_sizes_match_diffusers(tmp_path: Path) -> None:
    """ODD's folder (nothing lines up; the image larger than the VAE's default sample_size,
    which diffusers' pipeline decodes whole, not in tiles), a wide image with CFG and a
    negative prompt: the latents, the float images and the uint8 output as diffusers'."""
    ref = build_reference(tmp_path, ODD)
    ours = sd3.StableDiffusion3Pipeline.from_pretrained(tmp_path, "sd3", torch.device("cpu"),
                                                       torch.float32)
    ours.prompt_encoder.max_sequence_length = SEQ
    params = DiffusionParams(height=48, width=80, num_inference_steps=3, guidance_scale=5.0,
                             negative_prompt=NEGATIVE, seed=5)
    run = golden.matches_diffusers(ref, ours, PROMPTS[1], params, shape=(1, 16, 24, 40),
                                   max_sequence_length=SEQ)
    assert run.output.shape == (1, 48, 80, 3)


def test_bfloat16_matches_diffusers(pair: Pair) -> None:
    """Both loaded in bfloat16 from the float32 folder: noise drawn in the model dtype,
    timesteps in float32, CFG in bfloat16, as diffusers (bit-equal when written)."""
    _, _, folder = pair
    # loaded in float32 and cast: diffusers' own bfloat16 load leaves the patch conv's bias
    # float32 here (no accelerate), and its forward then fails
    ref = diffusers.StableDiffusion3Pipeline.from_pretrained(folder).to(torch.bfloat16)
    ref.set_progress_bar_config(disable=True)
    ours = sd3.StableDiffusion3Pipeline.from_pretrained(folder, "sd3", torch.device("cpu"),
                                                       torch.bfloat16)
    ours.prompt_encoder.max_sequence_length = SEQ
    params = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=0,
                             guidance_scale=GUIDANCE, negative_prompt=NEGATIVE)
    got, _ = run_alone(ours, PROMPTS[0], params)
    expected = golden.reference(ref, PROMPTS[0], params, "latent", max_sequence_length=SEQ)
    assert got.dtype == expected.dtype == torch.bfloat16
    golden.assert_latents_match(got, expected, atol=1e-2)


def test_skip_layer_guidance_matches_diffusers(pair: Pair) -> None:
    """Active on steps 1 and 2 of 4 (start 0.1, stop 0.7); it changes the result."""
    ref, ours, _ = pair
    slg = SkipLayerGuidance(layers=(1,), scale=2.8, start=0.1, stop=0.7)
    expected = reference(ref, "latent", skip_guidance_layers=[1], skip_layer_guidance_scale=2.8,
                         skip_layer_guidance_start=0.1, skip_layer_guidance_stop=0.7)
    plain = reference(ref, "latent")
    assert (expected - plain).abs().max() > 1e-2
    ours.use_skip_layer_guidance(slg)
    try:
        got = torch.cat([g[0] for g in run_ours(ours)])
    finally:
        ours.use_skip_layer_guidance(None)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"layers \[3\]: the transformer has 3 blocks"):
        ours.use_skip_layer_guidance(SkipLayerGuidance(layers=(3,)))
    with pytest.raises(ValueError, match="start=0.5, stop=0.2"):
        SkipLayerGuidance(layers=(1,), start=0.5, stop=0.2)


def test_same_latents_alone_or_batched(pair: Pair) -> None:
    """A request without CFG and one with CFG, two images and skip-layer guidance, at other
    steps in one batch: each one's latents as when it runs alone."""
    _, ours, _ = pair
    plain = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=4,
                            guidance_scale=1.0, seed=4)
    guided = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=3,
                             num_images=2, negative_prompt=NEGATIVE)   # guidance 7.0

    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        engine.add_request("plain", PROMPTS[1], plain)
        engine.step()
        engine.add_request("guided", PROMPTS[0], guided)
        return {"plain": plain, "guided": guided}

    ours.use_skip_layer_guidance(SkipLayerGuidance(layers=(1,), start=0.0, stop=0.7))
    try:
        seen, engine = run_recording_latents(ours, drive)
        alone = {"plain": run_alone(ours, PROMPTS[1], plain)[0],
                 "guided": run_alone(ours, PROMPTS[0], guided)[0]}
    finally:
        ours.use_skip_layer_guidance(None)
    assert engine.num_steps_run == 4
    for rid, latents in alone.items():
        torch.testing.assert_close(seen[rid][0], latents, atol=1e-5, rtol=0)
    assert seen["guided"][0].shape == (2, 4, HEIGHT // 2, WIDTH // 2)


@pytest.mark.parametrize("params, prompt, match", [
    (DiffusionParams(height=22, width=36), PROMPTS[0], "height=22: must be a multiple of 4 "
                                                       r"\(VAE factor 2 x 2x2 patches\)"),
    (DiffusionParams(height=20, width=52), PROMPTS[0], "width=52: the maximum is 48"),
    (DiffusionParams(height=20, width=36, true_cfg_scale=4.0), PROMPTS[0], "true_cfg_scale"),
    (DiffusionParams(height=20, width=36, guidance_scale=1.0, negative_prompt="x"), PROMPTS[0],
     "negative_prompt: has no effect"),
    (DiffusionParams(height=20, width=36, cache_threshold=0.1), PROMPTS[0], "no step caching"),
    (DiffusionParams(height=20, width=36), "  ", "non-empty"),
])
def test_refuses_bad_requests(pair: Pair, params: DiffusionParams, prompt: str, match: str
                              ) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_and_split_graphs(pair: Pair) -> None:
    """sd3.yaml (one stage) and sd3_split.yaml (the text encoders in a stage of their own):
    the same images; a bad size fails its request, naming the rule."""
    from omnistage import Omni

    _, _, folder = pair
    params = DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=1,
                             negative_prompt=NEGATIVE)
    images = {}
    for graph in (None, "sd3_split"):
        with Omni(str(folder), stage_config=graph, device="cpu", backend="inproc",
                  connector="inproc") as omni:
            outs = omni.generate(list(PROMPTS), params)
            assert [o.error for o in outs] == [None, None]
            assert all(o.images[0].size == (WIDTH, HEIGHT) for o in outs)
            images[graph] = torch.cat([o.tensors["images"] for o in outs])
            (bad,) = omni.generate("a red cube", DiffusionParams(height=21, width=36))
            assert bad.finish_reason == "error" and "multiple of 4" in str(bad.error)
    assert list(outs[0].stage_metrics) == ["text_encoder", "dit"]
    assert (images["sd3_split"].int() - images[None].int()).abs().max() <= 1


def test_skip_layer_guidance_as_a_stage_option(pair: Pair, tmp_path: Path) -> None:
    """The default graph with `diffusion: {options: {skip_layer_guidance: ...}}`: diffusers'
    images with the same skip-layer guidance (and T5's default 256 tokens); a bad option fails the start,
    naming it."""
    from omnistage import Omni

    ref, _, folder = pair
    graph = (Path(__file__).parents[3] / "omnistage" / "configs" / "sd3.yaml").read_text()
    option = "      options: {skip_layer_guidance: {layers: %s, start: 0.1, stop: 0.7}}\n"
    (tmp_path / "slg.yaml").write_text(graph + option % "[1]")
    expected = reference(ref, "pt", skip_guidance_layers=[1], skip_layer_guidance_start=0.1,
                         skip_layer_guidance_stop=0.7, max_sequence_length=256)  # the default
    expected = (expected * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    params = [DiffusionParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                              guidance_scale=GUIDANCE, negative_prompt=NEGATIVE, seed=s)
              for s in SEEDS]
    with Omni(str(folder), stage_config=str(tmp_path / "slg.yaml"), device="cpu",
              backend="inproc", connector="inproc") as omni:
        outs = [omni.generate(p, q)[0] for p, q in zip(PROMPTS, params)]
    assert [o.error for o in outs] == [None, None]
    got = torch.cat([o.tensors["images"] for o in outs])
    assert (got.int() - expected.int()).abs().max() <= 1

    (tmp_path / "bad.yaml").write_text(graph + option % "[7]")
    with pytest.raises(Exception, match=r"layers \[7\]: the transformer has 3 blocks"):
        Omni(str(folder), stage_config=str(tmp_path / "bad.yaml"), device="cpu",
             backend="inproc", connector="inproc")
