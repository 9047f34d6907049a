"""One speech frame for a batch of requests: the diffusion head's sampling loop with CFG, the
streamed acoustic decode, the streamed semantic encode and the embedding fed back to the LM.

Each request keeps its own state (`FrameState`): its noise generator, its decoders' conv
states and its frame count, so requests at different frames share one batched call. The
noise is drawn as transformers' `generate` draws it for a request alone: (2, latent) standard
normals per frame (the conditional and the unconditional row; only the first is used, the
second is drawn so that the next frame's draw matches), on the request's generator.

    x ~ N(0, 1)                                                         (B, latent)
    for each solver step t:  v_c, v_u = head([x, x], t, [pos, neg])
                             v = v_u + g (v_c - v_u);  x = dpm_step(x, v)
    audio = acoustic_decoder(unscale(x))           (B, 1, hop), streamed
    sem = semantic_encoder(audio)                  (B, 1, semantic), streamed
    next input = acoustic_connector(x) + semantic_connector(sem)       (B, H)

transformers' batched `generate` differs for batches whose rows are not all speaking (a
silent row's decoder state is fed a zero frame); ours equals its single-request run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.models.vibevoice.model import VibeVoiceSpeech
from omnistage.models.vibevoice.solver import SolverSteps, dpm_step
from omnistage.models.vibevoice.tokenizer import ConvState, split_state, stack_states


@dataclass
class FrameState:
    """A request's speech state across frames."""
    generator: torch.Generator          # on the CPU: the reference draws its noise there
    guidance_scale: float
    acoustic: ConvState = field(default_factory=dict)
    semantic: ConvState = field(default_factory=dict)
    num_frames: int = 0


@dataclass(frozen=True, slots=True)
class Frames:
    """One frame per request: the latent (B, latent) (scaled, as the head produces it), the
    audio (B, hop) and the next LM input (B, H)."""
    latents: Tensor
    audio: Tensor
    next_embeds: Tensor


@torch.inference_mode()
def sample_latents(speech: VibeVoiceSpeech, steps: SolverSteps, positive: Tensor,
                   negative: Tensor, states: list[FrameState]) -> Tensor:
    """positive, negative (B, H) conditions -> latents (B, latent)."""
    head = speech.diffusion_head
    latent = head.cfg.latent_size
    noise = [torch.randn(2, latent, generator=s.generator)[0] for s in states]
    x = torch.stack(noise).to(positive)
    scale = torch.tensor([s.guidance_scale for s in states], dtype=x.dtype,
                         device=x.device)[:, None]
    cond = torch.cat([positive, negative])
    b = x.shape[0]
    prev_x0: Tensor | None = None
    for i, t in enumerate(steps.timesteps.tolist()):
        both = torch.cat([x, x])
        v = head(both, torch.full((2 * b,), float(t), dtype=both.dtype, device=both.device), cond)
        v_c, v_u = v[:b], v[b:]
        x, prev_x0 = dpm_step(steps, i, x, v_u + scale * (v_c - v_u), prev_x0)
    return x


@torch.inference_mode()
def speech_frames(speech: VibeVoiceSpeech, steps: SolverSteps, positive: Tensor,
                  negative: Tensor, states: list[FrameState]) -> Frames:
    """One frame for each request (row) of `positive` / `negative` (B, H); advances the
    states."""
    latents = sample_latents(speech, steps, positive, negative, states)
    acoustic = stack_states([s.acoustic for s in states])
    audio = speech.acoustic_decoder(speech.unscale(latents)[:, None, :], acoustic)  # (B, 1, hop)
    semantic = stack_states([s.semantic for s in states])
    features = speech.semantic_encoder(audio, semantic)[:, -1]                    # (B, sem)
    embeds = speech.acoustic_connector(latents) + speech.semantic_connector(features)
    for s, a, m in zip(states, split_state(acoustic, len(states)),
                       split_state(semantic, len(states))):
        s.acoustic, s.semantic = a, m
        s.num_frames += 1
    return Frames(latents, audio[:, 0], embeds)
