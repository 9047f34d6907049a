"""Driving our LTX-2 pipeline beside diffusers' in the golden tests: the prompt side as
diffusers' connectors make it (`conditioning`), requests run on our engine (`run_ours`), our
final rows as diffusers' `output_type="latent"` returns them (`final_latents`)."""

from __future__ import annotations

import torch

from omnistage.diffusion.params import DiffusionParams
from omnistage.testing.diffusion import run_recording_latents
from tests.helpers.ltx2 import text_states


def conditioning(ref, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """diffusers' prompt arguments (hidden states, masks) and what its connectors make of
    them for our pipeline (per request, batch dim dropped)."""
    states, mask = text_states(2, [5, 3], seed=seed)
    kwargs = dict(prompt_embeds=states[:1], prompt_attention_mask=mask[:1],
                  negative_prompt_embeds=states[1:], negative_prompt_attention_mask=mask[1:])
    with torch.no_grad():
        video, audio, out_mask = ref.connectors(states, mask, padding_side="left")
    cond = {}
    for i, prefix in enumerate(("", "negative_")):
        cond.update({f"{prefix}prompt_embeds": video[i], f"{prefix}audio_prompt_embeds": audio[i],
                     f"{prefix}prompt_attention_mask": out_mask[i].float()})
    return kwargs, cond


def run_ours(ours, jobs: dict[str, tuple[DiffusionParams, dict]], lag: int = 0):
    def drive(engine):
        for k, (rid, (p, cond)) in enumerate(jobs.items()):
            engine.add_request(rid, None, p)
            keep = {k: v for k, v in cond.items()
                    if ours.guided(p) or not k.startswith("negative_")}
            engine.set_conditioning(rid, keep)
            for _ in range(lag if k < len(jobs) - 1 else 0):
                engine.step()
        return {rid: p for rid, (p, _) in jobs.items()}
    return run_recording_latents(ours, drive)[0]


def final_latents(ours, p: DiffusionParams, latents: torch.Tensor):
    """Our final row as diffusers' latent output: denormalized video (n, C, F', h, w) and
    audio (n, z, T, m)."""
    lay = ours.layout(p, final=True)
    video, audio = lay.split(latents)
    n = video.shape[0]
    video = ours.vae.denormalize(video.transpose(1, 2).reshape(n, lay.channels, *lay.grid))
    return video, ours.audio_vae.unpack(ours.audio_vae.denormalize(audio))
