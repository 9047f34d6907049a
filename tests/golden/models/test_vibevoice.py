"""Golden: VibeVoice on our layers vs transformers' VibeVoiceForConditionalGeneration on tiny
random checkpoints (float32): the diffusion head and its DPM-Solver++ loop, the tokenizers
(streamed equal to whole), and `generate` end to end (ids identical, the head's latents and
the streamed audio within 1e-4 at an audible magnitude; two voice clips; two requests
joining at different steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler
from transformers import VibeVoiceForConditionalGeneration as Reference

from omnistage.models.vibevoice.generate import SpeechLoop, SpeechProgress, SpeechRequest
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.models.vibevoice.prompt import prompt_embeds
from omnistage.models.vibevoice.solver import NoiseSchedule, SolverSteps, dpm_step
from tests.helpers.vibevoice import (AUDIO_BOS, AUDIO_TOKEN, LATENT, PagedLM,
                                     build_tiny_vibevoice, reference_generate,
                                     reference_generate_with_clips)

PROMPT = [5, 17, 99, 3, 42, 7, AUDIO_BOS]


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return {seed: build_tiny_vibevoice(tmp_path_factory.mktemp(f"vibevoice{seed}"), seed)
            for seed in (0, 2)}


@pytest.fixture(scope="module")
def ours(roots: dict[int, Path]) -> dict[int, VibeVoiceForConditionalGeneration]:
    return {seed: VibeVoiceForConditionalGeneration.from_pretrained(root)
            for seed, root in roots.items()}


def _request(model: VibeVoiceForConditionalGeneration, rid: str, ids: list[int], seed: int,
             g: float, steps: int, max_new: int = 12, clips: list | None = None) -> SpeechRequest:
    embeds = prompt_embeds(model, torch.tensor(ids), clips or [])
    return SpeechRequest(rid, embeds, ids[-1], max_new, torch.Generator().manual_seed(seed),
                         g, steps)


def _assert_equal_to_reference(got: SpeechProgress, ref: dict, what: str) -> None:
    assert got.tokens == ref["tokens"], what
    assert len(got.latents) == (torch.tensor(ref["tokens"]) == AUDIO_TOKEN).sum() > 2, what
    audio = torch.cat(got.audio)
    assert ref["audio"].abs().mean() > 1.0, "the reference's audio is near silent"
    torch.testing.assert_close(torch.stack(got.latents), ref["latents"], atol=1e-4, rtol=1e-5,
                               msg=lambda m: f"{what} latents: {m}")
    torch.testing.assert_close(audio, ref["audio"], atol=1e-4, rtol=1e-5,
                               msg=lambda m: f"{what} audio: {m}")


def test_diffusion_head_and_solver(roots: dict[int, Path],
                                   ours: dict[int, VibeVoiceForConditionalGeneration]) -> None:
    ref = Reference.from_pretrained(roots[0], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    x, cond = torch.randn(3, LATENT, generator=g), torch.randn(3, 32, generator=g)
    t = torch.tensor([999.0, 500.0, 3.0])
    with torch.no_grad():
        want = ref.model.diffusion_head(x, t, condition=cond)
        got = ours[0].speech.diffusion_head(x, t, cond)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the solver, step for step, against diffusers' scheduler on made-up model outputs
    for n in (1, 3, 10):
        sched = DPMSolverMultistepScheduler(beta_schedule="squaredcos_cap_v2",
                                            prediction_type="v_prediction")
        sched.set_timesteps(n)
        steps = SolverSteps.make(NoiseSchedule(), n)
        assert torch.equal(steps.timesteps, sched.timesteps)
        a = b = torch.randn(2, LATENT, generator=g)
        prev = None
        for i, ts in enumerate(sched.timesteps):
            v = torch.randn(2, LATENT, generator=g)
            a = sched.step(v, ts, a).prev_sample
            b, prev = dpm_step(steps, i, b, v, prev)
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6, msg=lambda m: f"{n}/{i}: {m}")


def test_tokenizers_match_and_stream_exactly(
        roots: dict[int, Path], ours: dict[int, VibeVoiceForConditionalGeneration]) -> None:
    ref = Reference.from_pretrained(roots[0], dtype=torch.float32).eval()
    speech = ours[0].speech
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(2, 5, LATENT, generator=g)
    audio = torch.randn(2, 1, 30, generator=g) * 3
    with torch.no_grad():
        want = ref.model.audio_tower.decode(latents).audio
        whole = speech.acoustic_decoder(latents)
        state: dict = {}
        streamed = torch.cat([speech.acoustic_decoder(latents[:, a:b], state)
                              for a, b in ((0, 1), (1, 3), (3, 4), (4, 5))], dim=-1)
        sem_want = ref.model.semantic_tokenizer_encoder(audio).latents
        sem_state: dict = {}
        sem_streamed = torch.cat([speech.semantic_encoder(audio[..., a:b], sem_state)
                                  for a, b in ((0, 6), (6, 18), (18, 30))], dim=1)
        enc_want = ref.model.audio_tower.encode(audio, sample=False).latents
        enc = speech.acoustic_encoder(audio)
    assert want.abs().mean() > 0.5 and sem_want.abs().mean() > 0.5
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sem_streamed, sem_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(enc, enc_want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed,g,steps", [(0, 1.3, 5), (2, 1.0, 3)])
def test_generate_equals_transformers(roots: dict[int, Path],
                                      ours: dict[int, VibeVoiceForConditionalGeneration],
                                      seed: int, g: float, steps: int) -> None:
    """Model 0 with token CFG restarts its negative context at every audio_bos; model 2
    stops speaking once (audio_eos) in a long run."""
    ref = reference_generate(roots[seed], PROMPT, 11, 12, g, steps)
    model = ours[seed]
    loop = SpeechLoop(model, PagedLM(model))
    loop.add(_request(model, "a", PROMPT, 11, g, steps))
    got = loop.run()["a"]
    _assert_equal_to_reference(got, ref, f"model {seed}")
    if seed == 0:
        assert got.tokens.count(AUDIO_BOS) >= 2


def test_two_voice_clips(roots: dict[int, Path],
                         ours: dict[int, VibeVoiceForConditionalGeneration]) -> None:
    """A two-speaker prompt: each speaker's clip (11 and 14 samples: 2 and 3 frames) in place
    of its audio ids. Three frames: this random model amplifies float noise (paged attention
    vs SDPA) by about 2x a frame, past 1e-4 from the fifth frame on."""
    g = torch.Generator().manual_seed(5)
    clips = [torch.randn(11, generator=g), torch.randn(14, generator=g)]
    ids = [5, 9, AUDIO_TOKEN, AUDIO_TOKEN, 3, 6, AUDIO_TOKEN, AUDIO_TOKEN, AUDIO_TOKEN,
           40, 41, 42, AUDIO_BOS]
    ref = reference_generate_with_clips(roots[2], ids, clips, 7, 4, 1.3, 4)
    model = ours[2]
    loop = SpeechLoop(model, PagedLM(model))
    loop.add(_request(model, "a", ids, 7, 1.3, 4, max_new=4, clips=clips))
    _assert_equal_to_reference(loop.run()["a"], ref, "two clips")
    # without the clips the model says something else: the clips were read
    plain = reference_generate(roots[2], ids, 7, 4, 1.3, 4)
    assert plain["tokens"] != ref["tokens"] or \
        (plain["latents"] - ref["latents"]).abs().max() > 1e-3


def test_two_requests_joining_at_different_steps(
        roots: dict[int, Path], ours: dict[int, VibeVoiceForConditionalGeneration]) -> None:
    """Request b joins after a has taken 3 steps (a prefill beside decodes, frames of both in
    one head call); each equals its own reference run."""
    model = ours[0]
    b_ids = [8, 8, 31, 77, AUDIO_BOS]
    ref_a = reference_generate(roots[0], PROMPT, 11, 12, 1.3, 5)
    ref_b = reference_generate(roots[0], b_ids, 23, 9, 1.5, 5)
    loop = SpeechLoop(model, PagedLM(model))
    loop.add(_request(model, "a", PROMPT, 11, 1.3, 5))
    for _ in range(3):
        loop.step()
    loop.add(_request(model, "b", b_ids, 23, 1.5, 5, max_new=9))
    done = loop.run()
    _assert_equal_to_reference(done["a"], ref_a, "a")
    _assert_equal_to_reference(done["b"], ref_b, "b")


def test_loading_is_strict_and_unsupported_schedules_are_named(roots: dict[int, Path],
                                                               tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from omnistage.models.vibevoice.solver import NoiseSchedule

    folder = tmp_path / "partial"
    folder.mkdir()
    for f in ("config.json", "generation_config.json"):
        (folder / f).write_text((roots[0] / f).read_text())
    tensors = load_file(roots[0] / "model.safetensors")
    del tensors["model.diffusion_head.final_layer.linear_2.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="final_layer.linear_2.weight"):
        VibeVoiceForConditionalGeneration.from_pretrained(folder)
    with pytest.raises(NotImplementedError, match="use_karras_sigmas"):
        NoiseSchedule.from_config({"use_karras_sigmas": True})
    with pytest.raises(NotImplementedError, match="solver_order"):
        NoiseSchedule.from_config({"solver_order": 3})
