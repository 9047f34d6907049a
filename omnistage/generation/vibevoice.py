"""VibeVoice's decoding loop on the AR engine: each request is one engine sequence (the
positive context) with shadow sequences (ar/shadows.py) for the other two contexts, and the
model's two per-step hooks do the rest of `SpeechLoop` (models/vibevoice/generate.py):

    shadow "neg"  the CFG negative context. Every step it is fed, speculatively, what the
                  negative context takes if the step's token is audio: the step's own input
                  (audio_bos's embedding on a request's first step). After the step: kept for
                  audio (its last hidden is the head's uncond condition), rolled back for
                  any other id, restarted at audio_bos.
    shadow "tok"  transformers' token CFG (guidance_scale != 1 only): fed the prompt's last
                  id, then each chosen id; `guide_logits` mixes its log-probs into the choice:
                  g (lp - lp_u) + lp_u over the four speech ids, then greedy (temperature 0).
    feedback      per step, for the rows that said audio, one batched `speech_frames` (their
                  own noise generators and conv states): the frame's latent and audio are
                  kept here, its embedding is the request's next input; other ids feed their
                  own embedding.

Tokens, latents and audio are `SpeechLoop`'s, hence transformers' generate's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.ar import shadows
from omnistage.ar.engine import AREngine
from omnistage.ar.sequence import Sequence
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.models.vibevoice.solver import SolverSteps
from omnistage.models.vibevoice.speech import FrameState, speech_frames
from omnistage.sampling_params import SamplingParams

NEG, TOK = "neg", "tok"


@dataclass
class SpeechState:
    """One request's speech: its frame state, what it said so far, and the frames not yet
    taken by the stage (`take`)."""
    frame: FrameState
    num_diffusion_steps: int
    tokens: list[int] = field(default_factory=list)
    latents: list[Tensor] = field(default_factory=list)
    audio: list[Tensor] = field(default_factory=list)
    num_taken: int = 0


class VibeVoiceSpeaker:
    """Installs the hooks on the engine's model and keeps every request's `SpeechState`."""

    def __init__(self, engine: AREngine) -> None:
        self.engine = engine
        self.model: VibeVoiceForConditionalGeneration = engine.model
        self.ids = self.model.config.tokens
        self.states: dict[str, SpeechState] = {}
        self._steps: dict[int, SolverSteps] = {}
        self.model.guide_logits = self.guide_logits
        self.model.feedback = self.feedback

    def add(self, request_id: str, prompt_embeds: Tensor, last_prompt_id: int,
            max_new_tokens: int, generator: torch.Generator, guidance_scale: float,
            num_diffusion_steps: int) -> None:
        """Queue a request: its prompt embeddings (T, H) (models/vibevoice/prompt.py)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
        self.engine.add_request(request_id, None, params, prompt_embeds=prompt_embeds)
        self.engine.add_shadow(request_id, NEG, self._embed([self.ids.audio_bos]))
        if guidance_scale != 1.0:
            self.engine.add_shadow(request_id, TOK, self._embed([last_prompt_id]))
        self.states[request_id] = SpeechState(FrameState(generator, guidance_scale),
                                              num_diffusion_steps)

    def drop(self, request_id: str) -> SpeechState | None:
        """Forget a finished or aborted request (the engine frees its sequences)."""
        return self.states.pop(request_id, None)

    def _embed(self, ids: list[int]) -> Tensor:
        return self.engine.embed_input_ids(torch.tensor(ids, device=self.engine.device))

    def solver_steps(self, n: int) -> SolverSteps:
        if n not in self._steps:
            self._steps[n] = SolverSteps.make(self.model.config.schedule, n)
        return self._steps[n]

    # -- the engine's hooks -----------------------------------------------------------------
    def guide_logits(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """Token CFG for the rows with a "tok" shadow. logits are the masked lm_head's: their
        log-softmax differs from transformers' (over the whole vocabulary) by a constant a
        row, and so does the mix: the greedy choice is the same."""
        guided = [i for i, s in enumerate(seqs) if TOK in s.shadows]
        if not guided:
            return logits
        mask = self.model.logits_mask
        uncond = torch.stack([seqs[i].shadows[TOK].last_hidden for i in guided])
        lu = torch.log_softmax(self.model.compute_logits(uncond), dim=-1)
        lp = torch.log_softmax(logits[guided], dim=-1)
        g = torch.tensor([self.states[seqs[i].request_id].frame.guidance_scale
                          for i in guided], device=logits.device)[:, None]
        mixed = torch.where(mask == 0, g * (lp - lu) + lu, mask)
        logits = logits.clone()
        logits[guided] = mixed
        return logits

    def feedback(self, last: Tensor, token_ids: Tensor, seqs: list[Sequence]
                 ) -> tuple[Tensor, list[None]]:
        tokens = token_ids.tolist()
        nxt = self._embed(tokens)
        speaking = [j for j, t in enumerate(tokens) if t == self.ids.audio]
        if speaking:
            self._speak(speaking, last, seqs, nxt)
        for j, (seq, tok) in enumerate(zip(seqs, tokens)):
            self.states[seq.request_id].tokens.append(tok)
            neg = seq.shadows[NEG]
            if tok == self.ids.audio_bos:
                shadows.restart(neg)
            elif tok != self.ids.audio:   # (audio keeps the row: on the first step audio_bos's)
                shadows.rollback(neg, 1)
            shadows.feed(neg, nxt[j:j + 1])
            if TOK in seq.shadows:
                shadows.feed(seq.shadows[TOK], self._embed([tok]))
        return nxt, [None] * len(seqs)

    def _speak(self, speaking: list[int], last: Tensor, seqs: list[Sequence],
               nxt: Tensor) -> None:
        by_steps: dict[int, list[int]] = {}
        for j in speaking:
            n = self.states[seqs[j].request_id].num_diffusion_steps
            by_steps.setdefault(n, []).append(j)
        for n, rows in by_steps.items():
            states = [self.states[seqs[j].request_id] for j in rows]
            neg = torch.stack([seqs[j].shadows[NEG].last_hidden for j in rows])
            frames = speech_frames(self.model.speech, self.solver_steps(n), last[rows], neg,
                                   [s.frame for s in states])
            for k, (j, s) in enumerate(zip(rows, states)):
                s.latents.append(frames.latents[k])
                s.audio.append(frames.audio[k])
                nxt[j] = frames.next_embeds[k]
