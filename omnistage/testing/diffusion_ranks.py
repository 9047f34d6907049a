"""Rank bodies for the parallel diffusion tests (tests/system/diffusion/test_parallel.py,
test_sd3_pipeline.py), run on CPU gloo ranks by `omnistage.testing.ranks.run_ranks` (or in the
test's process for one rank), and the tiny Qwen-Image, Z-Image, FLUX and Wan folders they load.

The pipeline folders have no text encoder: requests bring their caption states
(`set_conditioning`, as a split graph's encoder stage sends them), drawn from a seed per
request, so captions of any length, odd ones included, cost nothing to make. SD3's folder (its
test builds it whole) is the exception: rank 0 encodes the prompts, as a stage's leader does."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.layers.groups import StageRanks
from omnistage.layers.sequence_parallel import SequenceSplit, sdpa
from omnistage.testing.diffusion import run_to_end

JOINT_DIM = 16        # caption state width of the tiny transformer
CASES = [   # sizes in pixels: 64 -> 4x4 image tokens, 48 -> 3x3; len / neg_len: caption tokens
    dict(id="a", size=64, steps=3, seed=1, len=7, neg_len=4, cfg=4.0, num_images=2),
    dict(id="b", size=64, steps=3, seed=2, len=5),
    dict(id="c", size=64, steps=4, seed=3, len=6, neg_len=9, cfg=2.5),
    dict(id="d", size=48, steps=3, seed=4, len=3, neg_len=3, cfg=3.0),
    # Qwen-Image's relative changes ~0.18, 0.22, 0.29, 0.25, 0.13, 0.15: skips steps 1 and 5,
    # far from 0.2
    dict(id="e", size=64, steps=8, seed=5, len=5, neg_len=6, cfg=4.0, cache_threshold=0.2),
]
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192,
                            max_shift=0.9, num_train_timesteps=1000, shift=1.0,
                            shift_terminal=0.02, use_dynamic_shifting=True,
                            time_shift_type="exponential")


def build_tiny_qwen_image(path: Path, head_dim: int = 16) -> Path:
    """transformer/ (2 heads of `head_dim`, 2 layers), vae/, scheduler/ and model_index.json
    of a tiny random Qwen-Image, saved by diffusers. Every weight drawn (diffusers zero-inits
    some), RMS norm weights near 1 so that attention, and with it the captions, matter."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=head_dim,
        num_attention_heads=2, joint_attention_dim=JOINT_DIM,
        axes_dims_rope=(head_dim // 2, head_dim // 4, head_dim // 4))
    with torch.no_grad():
        for p in transformer.parameters():
            p.normal_(0.0, 0.1)
        for m in transformer.modules():
            if type(m).__name__ == "RMSNorm":
                m.weight.normal_(1.0, 0.1)
    transformer.save_pretrained(path / "transformer")
    diffusers.AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0]).save_pretrained(path / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER).save_pretrained(
        path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return path


def build_tiny_flux_transformer(path: Path) -> Path:
    """transformer/ of a tiny random FLUX.1-dev (2 heads of 16, 1 double and 2 single blocks,
    guidance embedding), saved by diffusers, every weight drawn."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=True)
    with torch.no_grad():
        for p in transformer.parameters():
            p.normal_(0.0, 0.1)
    transformer.save_pretrained(path / "transformer")
    return path


def build_tiny_wan_transformer(path: Path) -> Path:
    """transformer/ of a tiny random Wan2.1 I2V (4 heads of 6, 2 layers, CLIP image tokens),
    saved by diffusers, every weight drawn (norm weights around 1)."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=6, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2, image_dim=8,
        added_kv_proj_dim=24)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            p.normal_(1.0 if ".norm" in name and name.endswith("weight") else 0.0, 0.1)
    transformer.save_pretrained(path / "transformer")
    return path


def build_tiny_z_image(path: Path) -> Path:
    """transformer/ (2 heads of 24, 2 layers, 1 refiner layer each), vae/, scheduler/ and
    model_index.json of a tiny random Z-Image, saved by diffusers, every weight drawn."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=JOINT_DIM, rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 8, 8],
        axes_lens=[128, 32, 32])
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    with torch.no_grad():
        for model in (transformer, vae):
            for p in model.parameters():
                p.normal_(0.0, 0.1)
    transformer.save_pretrained(path / "transformer")
    vae.save_pretrained(path / "vae")
    diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False).save_pretrained(
        path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    return path


def captions(case: dict) -> dict[str, torch.Tensor]:
    """A case's caption states: prompt_embeds (len, J), and negative_prompt_embeds with CFG."""
    g = torch.Generator().manual_seed(case["seed"])
    out = {"prompt_embeds": torch.randn(case["len"], JOINT_DIM, generator=g)}
    if case.get("neg_len"):
        out["negative_prompt_embeds"] = torch.randn(case["neg_len"], JOINT_DIM, generator=g)
    return out


def case_params(case: dict, pipeline: str = "qwen_image") -> DiffusionParams:
    """A case's params: CFG (a negative caption) as Qwen-Image's true CFG or Z-Image's
    guidance_scale; the negative prompt's text is never encoded here."""
    cfg = case.get("neg_len") is not None
    guidance = ({"guidance_scale": case["cfg"] if cfg else 0.0} if pipeline == "z_image" else
                {"true_cfg_scale": case["cfg"] if cfg else 1.0})
    return DiffusionParams(height=case["size"], width=case["size"],
                           num_inference_steps=case["steps"], seed=case["seed"],
                           num_images=case.get("num_images", 1),
                           negative_prompt="n" if cfg else None,
                           cache_threshold=case.get("cache_threshold"), **guidance)


def pipeline_run(ranks: StageRanks, folder: str, cases: list[dict],
                 pipeline: str = "qwen_image", device: str = "cpu", graphs: bool = False
                 ) -> dict:
    """Every case, batched by the engine, to the end on these ranks: rank 0 serves, the others
    follow. -> per request its final latents (flat list) and the steps each step-cache branch
    skipped on this rank (and with `graphs`, how many forwards replayed from CUDA graphs:
    emulated on CPU, as graph_emulation.py does). device "cuda": this rank's current CUDA
    device, float32."""
    from omnistage.registry import load_component

    pipe = load_component("diffusion", pipeline).from_pretrained(
        folder, pipeline, torch.device(device), torch.float32, text_encoders=False)
    if graphs:
        if device == "cpu":
            from omnistage.layers import graph_capture
            from omnistage.testing.graph_emulation import rerun_capture

            graph_capture.capture_graph = rerun_capture     # this rank process's own
        pipe.use_cuda_graphs()

    def submit(engine: DiffusionEngine) -> None:
        for case in cases:
            engine.add_request(case["id"], None, case_params(case, pipeline))
            engine.set_conditioning(case["id"], captions(case))

    return _serve(ranks, pipe, submit)


def sd3_run(ranks: StageRanks, folder: str, cases: list[dict], skip_layers: list[int]) -> dict:
    """SD3 cases ({"id", "prompt", "params": DiffusionParams fields}) with skip-layer guidance
    on `skip_layers` from step 0 to 70% of each schedule, batched by the engine, on these
    ranks: rank 0 loads the text encoders and encodes, as a stage's leader does."""
    from omnistage.diffusion.pipelines.sd3 import SkipLayerGuidance
    from omnistage.registry import load_component

    pipe = load_component("diffusion", "sd3").from_pretrained(
        folder, "sd3", torch.device("cpu"), torch.float32, text_encoders=ranks.is_leader)
    pipe.use_skip_layer_guidance(SkipLayerGuidance(layers=tuple(skip_layers), start=0.0,
                                                   stop=0.7))

    def submit(engine: DiffusionEngine) -> None:
        for case in cases:
            engine.add_request(case["id"], case["prompt"], DiffusionParams(**case["params"]))

    return _serve(ranks, pipe, submit)


def _serve(ranks: StageRanks, pipe, submit) -> dict:
    """`submit(engine)` adds the requests on rank 0, which steps them to the end; the other
    ranks follow its plans. -> pipeline_run's result."""
    engine = DiffusionEngine(pipe)
    finished = []
    if ranks.is_leader:
        pipe.decode = lambda latents, params: torch.zeros(1, 1, 1, 3)   # latents are compared
        submit(engine)
        reqs = dict(engine.requests)
        run_to_end(engine)
        engine.stop_followers()
        finished = list(reqs.values())
    else:
        while (plan := ranks.share_plan()) is not None:
            finished += engine.run_plan(plan)
    graphs = pipe.graphs if isinstance(pipe.graphs, list) else [pipe.graphs]
    return {"latents": {r.request_id: r.latents.flatten().tolist() for r in finished},
            "skipped": {r.request_id: {b: s.num_skipped for b, s in r.cache.items()}
                        for r in finished},
            "replays": sum(g.num_replays for g in graphs if g is not None)}


# Wan2.2 A14B's tiny folder (omnistage/testing/tiny_wan.py; its 4-step schedule crosses the
# boundary after step 2): CFG with a scale per expert, none, and step caching
WAN_CASES = [
    dict(id="a", prompt="a red kite over the sea", steps=4, seed=1, cfg=4.0, cfg2=2.0),
    dict(id="b", prompt="waves", steps=3, seed=2),
    dict(id="c", prompt="a cat on a wall", steps=6, seed=3, cfg=3.0, cache_threshold=0.5,
         negative_prompt="blurry"),
]


def wan_run(ranks: StageRanks, folder: str, cases: list[dict]) -> dict:
    """Wan's cases (prompts encoded by rank 0's UMT5, 5 frames of 32x48) to the end on these
    ranks: pipeline_run's result."""
    from omnistage.registry import load_component

    pipe = load_component("diffusion", "wan").from_pretrained(
        folder, "wan", torch.device("cpu"), torch.float32)

    def submit(engine: DiffusionEngine) -> None:
        for case in cases:
            engine.add_request(case["id"], case["prompt"], DiffusionParams(
                height=32, width=48, num_frames=5, num_inference_steps=case["steps"],
                seed=case["seed"], guidance_scale=case.get("cfg", 1.0),
                guidance_scale_2=case.get("cfg2"), negative_prompt=case.get("negative_prompt"),
                cache_threshold=case.get("cache_threshold")))

    return _serve(ranks, pipe, submit)


def qwen_image_stage_run(ranks: StageRanks, folder: str, cases: list[dict]) -> dict:
    """The cases through a DiffusionStage configured with these ranks' sizes (conditioning
    along an input edge): rank 0 adds, feeds and steps the stage, then stops the others, which
    `follow()`. -> rank 0: per request its final latents (flat list); others: {}."""
    import time

    from omnistage.configs.schema import StageConfig, StageInput
    from omnistage.payloads import Payload
    from omnistage.stages.adapters import StageFeed
    from omnistage.stages.diffusion import DiffusionStage
    from omnistage.stages.interface import StageRequest

    sizes = ranks.sizes
    stage = DiffusionStage(StageConfig(
        name="dit", kind="diffusion", component="qwen_image", model=folder, dtype="float32",
        inputs=(StageInput("encoder", "text"),), parallel=sizes),
        None, "cpu")
    if not ranks.is_leader:
        stage.follow()
        return {}
    latents = {}

    def decode(x: torch.Tensor, params: DiffusionParams) -> torch.Tensor:   # keeps the latents
        latents[params.seed] = x.flatten().tolist()
        return torch.zeros(1, 1, 1, 3)

    stage.engine.pipeline.decode = decode
    for case in cases:
        stage.add(StageRequest(case["id"], time.time(), diffusion=case_params(case),
                               streamed=True))
        stage.feed(case["id"], StageFeed(payload=Payload.unpack(captions(case))))
    while stage.has_unfinished_requests:
        assert all(r.error is None for r in stage.step())
    stage.stop_followers()
    return {"latents": {c["id"]: latents[c["seed"]] for c in cases}}


def flux_forward(ranks: StageRanks, folder: str, num_txt: int, grid: list[int]) -> list[float]:
    """One forward of the tiny FLUX transformer on these ranks (2 rows, `num_txt` caption
    tokens, an h x w token grid, seeded inputs) -> its output, flat."""
    from omnistage.diffusion.pipelines.flux import latent_image_ids
    from omnistage.models.flux_transformer import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(Path(folder) / "transformer", "cpu",
                                                   torch.float32)
    g = torch.Generator().manual_seed(0)
    h, w = grid
    with torch.inference_mode():
        out = model(torch.randn(2, h * w, 16, generator=g),
                    torch.randn(2, num_txt, 32, generator=g),
                    torch.randn(2, 32, generator=g), torch.tensor([0.7, 0.3]),
                    img_ids=latent_image_ids(h, w), txt_ids=torch.zeros(num_txt, 3),
                    guidance=torch.tensor([3.5, 2.0]) / 1000)
    return out.flatten().tolist()


def wan_forward(ranks: StageRanks, folder: str, grid: list[int]) -> list[float]:
    """One forward of the tiny Wan transformer on these ranks (2 rows, latents of an
    f x h x w token grid, 7 caption and 5 image tokens, a timestep per token with the first
    frame at 0, seeded inputs) -> its output, flat."""
    from omnistage.models.wan_transformer import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(Path(folder) / "transformer", "cpu",
                                                  torch.float32)
    g = torch.Generator().manual_seed(0)
    f, h, w = grid
    timestep = torch.tensor([[700.0], [300.0]]).expand(2, f * h * w).clone()
    timestep[:, :h * w] = 0.0
    with torch.inference_mode():
        out = model(torch.randn(2, 4, f, 2 * h, 2 * w, generator=g), timestep,
                    torch.randn(2, 7, 16, generator=g), torch.randn(2, 5, 8, generator=g))
    return out.flatten().tolist()


def sequence_attention(ranks: StageRanks, cases: list[tuple[list[int], bool]]) -> list[dict]:
    """Per case (segment lengths, whether the first segment has a key mask): joint attention
    split over the sequence-parallel ranks against the whole sequence's SDPA. -> per case the
    largest difference and the reference's largest value."""
    return [_sequence_attention(lengths, masked) for lengths, masked in cases]


def _sequence_attention(lengths: list[int], masked: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    batch, heads, dim = 2, 4, 8
    q, k, v = ([torch.randn(batch, n, heads, dim, generator=g) for n in lengths]
               for _ in range(3))
    masks: list[torch.Tensor | None] = [None] * len(lengths)
    if masked:
        masks[0] = torch.rand(batch, lengths[0], generator=g) > 0.4
        masks[0][:, 0] = True
    whole = [torch.ones(batch, n, dtype=torch.bool) if m is None else m
             for m, n in zip(masks, lengths)]
    ref = sdpa(torch.cat(q, 1), torch.cat(k, 1), torch.cat(v, 1), torch.cat(whole, 1))

    split = SequenceSplit.split(lengths, masks)
    local = [torch.cat([split.local(t, i) for i, t in enumerate(ts)], 1) for ts in (q, k, v)]
    out = split.attend(*local)
    sizes = [seg[split.ranks.index] for seg in split.sizes]
    got = torch.cat([split.gather(part, i) for i, part in enumerate(out.split(sizes, 1))], 1)
    return {"diff": float((got - ref).abs().max()), "scale": float(ref.abs().max())}
