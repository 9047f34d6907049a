"""Wan text-to-video's step caching and CUDA graphs through the engine, on the tiny random
folder (float32; the VAE decode stubbed: only final latents are compared). A threshold of 0
or None runs every step; a large one skips every step but the first and the last in both
branches and reports it; requests of other thresholds batched at other steps each equal
themselves alone. The forward replayed from (emulated) CUDA graphs equals eager."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.models.wan_transformer import (TEACACHE_I2V_480P, TEACACHE_I2V_720P, TEACACHE_T2V,
                                              WanTransformerConfig, teacache_coefficients)
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_wan import build_tiny_wan

pytest.importorskip("diffusers")

STEPS = 4
Jobs = dict[str, tuple[str, DiffusionParams]]


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("wan")
    build_tiny_wan(path)
    return load_component("diffusion", "wan").from_pretrained(path, "wan", torch.device("cpu"),
                                                              torch.float32)


def params(threshold: float | None, guidance: float = 5.0, seed: int = 0,
           steps: int = STEPS) -> DiffusionParams:
    return DiffusionParams(height=32, width=48, num_frames=5, num_inference_steps=steps,
                           guidance_scale=guidance, seed=seed, cache_threshold=threshold,
                           negative_prompt="blurry" if guidance > 1 else None)


def serve(pipe, monkeypatch: pytest.MonkeyPatch, jobs: Jobs, stagger: bool = False
          ) -> tuple[dict[str, Tensor], dict[str, int], DiffusionEngine]:
    """-> per request its final latents and steps skipped (stagger: each joins a step after
    the one before)."""
    seen: dict[int, Tensor] = {}

    def stub(latents: Tensor, p: DiffusionParams) -> Tensor:
        seen[p.seed] = latents.clone()
        return torch.zeros(latents.shape[0], 1, 1, 1, 3, dtype=torch.uint8)

    monkeypatch.setattr(pipe, "decode", stub)
    engine = DiffusionEngine(pipe)
    for rid, (prompt, p) in jobs.items():
        engine.add_request(rid, prompt, p)
        if stagger:
            engine.step()
    done = run_to_end(engine)
    monkeypatch.undo()
    return ({rid: seen[p.seed] for rid, (_, p) in jobs.items()},
            {rid: done[rid].metrics.num_steps_skipped for rid in jobs}, engine)


@pytest.fixture(scope="module")
def uncached(wan) -> Tensor:
    """Request "a cat"'s final latents without caching."""
    with pytest.MonkeyPatch.context() as m:
        plain, skipped, _ = serve(wan, m, {"a": ("a cat", params(None))})
    assert skipped == {"a": 0} and plain["a"].abs().max() > 0.5
    return plain["a"]


def test_threshold_zero_runs_every_step(wan, uncached: Tensor,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    zero, skipped, _ = serve(wan, monkeypatch, {"a": ("a cat", params(0.0))})
    assert skipped == {"a": 0}
    assert torch.equal(zero["a"], uncached)


def test_large_threshold_skips_both_branches(wan, uncached: Tensor,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step but the first and the last reuses its branch's residual; the final latents
    move (the skipped blocks' output is not recomputed) but stay finite."""
    engine = DiffusionEngine(wan)
    monkeypatch.setattr(wan, "decode", lambda x, p: torch.zeros(1, 1, 1, 1, 3,
                                                                dtype=torch.uint8))
    engine.add_request("a", "a cat", params(100.0))
    req = engine.requests["a"]
    done = run_to_end(engine)
    assert done["a"].metrics.num_steps_skipped == STEPS - 2
    assert set(req.cache) == {"cond0", "uncond0"}         # per branch and expert
    assert req.cache["uncond0"].num_skipped == STEPS - 2
    assert not torch.equal(req.cache["cond0"].residual, req.cache["uncond0"].residual)
    assert torch.isfinite(req.latents).all() and not torch.equal(req.latents, uncached)


def test_other_thresholds_batched_equal_each_alone(wan, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    jobs: Jobs = {"a": ("a cat", params(100.0, seed=1)),
                  "b": ("a dog", params(None, guidance=1.0, seed=2, steps=3)),
                  "c": ("waves", params(0.0, guidance=3.0, seed=3, steps=3))}
    batched, skipped, _ = serve(wan, monkeypatch, jobs, stagger=True)
    assert skipped == {"a": STEPS - 2, "b": 0, "c": 0}
    for rid, job in jobs.items():
        alone, alone_skipped, _ = serve(wan, monkeypatch, {rid: job})
        assert alone_skipped[rid] == skipped[rid]
        assert (batched[rid] - alone[rid]).abs().max() < 1e-5, rid


def test_cuda_graph_replays_equal_eager(wan, monkeypatch: pytest.MonkeyPatch) -> None:
    """use_cuda_graphs (a stage's cuda_graphs option): shapes seen twice are captured (on CPU
    by a stand-in whose replay reruns the forward on the graph's buffers) and replayed, the
    same latents as eager; a request that caches, and timesteps per token, run eagerly."""
    from omnistage.layers import graph_capture
    from omnistage.testing.graph_emulation import rerun_capture

    jobs: Jobs = {"a": ("a cat", params(None, seed=1, steps=4))}
    eager, _, _ = serve(wan, monkeypatch, jobs)
    wan.use_cuda_graphs()
    try:
        with monkeypatch.context() as m:
            m.setattr(graph_capture, "capture_graph", rerun_capture)
            graphed, _, _ = serve(wan, monkeypatch, jobs)
            assert wan.graphs is not None
            (graphs,) = wan.graphs                 # one expert: one set of graphs
            assert graphs.num_replays == 3         # steps 2..4
            serve(wan, monkeypatch, {"b": ("a dog", params(100.0, seed=2, steps=4))})
            x, text = torch.randn(1, 4, 2, 4, 6), torch.randn(1, 8, 16)
            for _ in range(3):                 # a timestep per token: eager (a host sync)
                wan.run_expert(0, x, torch.full((1, 12), 500), text)
            assert graphs.num_replays == 3
    finally:
        wan.graphs = None
    assert torch.equal(graphed["a"], eager["a"])


def test_published_polynomial_watches_the_timestep_embedding(
        wan, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where TeaCache's polynomial applies (an identity one stands in), the timestep
    embedding's change decides: other latents at the same timestep skip; the modulated input
    (no polynomial) sees them change and computes."""
    from omnistage.layers.step_cache import CacheGroup, StepCacheState
    from omnistage.models import wan_transformer

    gen = torch.Generator().manual_seed(0)
    x, other = (torch.randn(1, 4, 2, 4, 6, generator=gen) for _ in range(2))
    t, text = torch.tensor([500]), torch.randn(1, 8, 16, generator=gen)

    def skipped(coefficients: tuple[float, ...] | None) -> int:
        monkeypatch.setattr(wan_transformer, "teacache_coefficients", lambda cfg, grid:
                            coefficients)
        state = StepCacheState()
        for i, latents in enumerate([x, other]):
            wan.transformer(latents, t, text,
                            step_cache=[CacheGroup(slice(0, 1), state, 0.5, i == 0)])
        return state.num_skipped

    assert skipped((1.0, 0.0)) == 1
    assert skipped(None) == 0


def test_teacache_polynomials_by_config() -> None:
    """TeaCache's Wan2.1 polynomials go with the configs they were fitted on; I2V's by the
    resolution of the latent grid; others (Wan2.2 5B, FLF2V) watch the modulated input."""
    t2v = dict(num_attention_heads=40, num_layers=40, in_channels=16)
    i2v = dict(t2v, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
    grid_480p, grid_720p = (21, 30, 52), (21, 45, 80)
    assert teacache_coefficients(WanTransformerConfig(**t2v), grid_480p) == TEACACHE_T2V[5120]
    assert teacache_coefficients(WanTransformerConfig(num_attention_heads=12, num_layers=30),
                                 grid_480p) == TEACACHE_T2V[1536]
    assert teacache_coefficients(WanTransformerConfig(**i2v), grid_480p) == TEACACHE_I2V_480P
    assert teacache_coefficients(WanTransformerConfig(**i2v), grid_720p) == TEACACHE_I2V_720P
    assert teacache_coefficients(WanTransformerConfig(**i2v, pos_embed_seq_len=514),
                                 grid_480p) is None
    five_b = WanTransformerConfig(num_attention_heads=24, num_layers=30, in_channels=48,
                                  out_channels=48, ffn_dim=14336)
    assert teacache_coefficients(five_b, (31, 22, 40)) is None
