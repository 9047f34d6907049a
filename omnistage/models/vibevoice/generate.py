"""VibeVoice's decoding loop over an LM runner: the positive context (the prompt and what the
LM has said) and, per request, the negative one used for CFG, both sequences in the runner's
KV cache; one `step()` advances every active request by one token.

    step: hidden = LM(pending inputs)            one row per request (a prompt on its first)
          id = argmax(guided log-probs, 4 ids allowed); with guidance g != 1 the log-probs
               are transformers' token CFG: g (lp - lp_u) + lp_u, lp_u from a third context
               fed the ids alone (the prompt's last id, then each id the LM chose)
          id == audio_bos:   the negative context restarts (its sequence is freed)
          id == audio token: neg = LM_negative(this step's input; audio_bos's embedding on
                             the first step), frame = speech_frames(hidden, neg) (speech.py),
                             pending = frame.next_embeds
          otherwise:         pending = embed(id)
          done at eos or max_new_tokens

This is transformers' `VibeVoiceForConditionalGeneration.generate` for one request (its
greedy ids, its latents, its streamed audio); requests join and leave between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Protocol

import torch
from torch import Tensor

from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.models.vibevoice.solver import SolverSteps
from omnistage.models.vibevoice.speech import FrameState, speech_frames


class LMRunner(Protocol):
    """The LM on a KV cache: `run` appends each row's inputs (n, H) to its sequence `key`
    and returns their final hidden states (n, H); `free` drops a sequence."""

    def run(self, rows: list[tuple[Hashable, Tensor]]) -> list[Tensor]: ...

    def free(self, key: Hashable) -> None: ...


@dataclass
class SpeechRequest:
    request_id: str
    prompt_embeds: Tensor                       # (T, H)
    last_prompt_id: int                         # the token CFG context starts from it
    max_new_tokens: int
    generator: torch.Generator                  # CPU: the diffusion noise
    guidance_scale: float = 1.3
    num_diffusion_steps: int = 10


@dataclass
class SpeechProgress:
    request: SpeechRequest
    frame: FrameState
    pending: Tensor                             # the next LM input (n, H)
    tokens: list[int] = field(default_factory=list)
    latents: list[Tensor] = field(default_factory=list)
    audio: list[Tensor] = field(default_factory=list)
    neg_segment: int = 0                        # bumped at each audio_bos: a fresh sequence
    finished: bool = False

    @property
    def pos_key(self) -> tuple[str, str]:
        return (self.request.request_id, "pos")

    @property
    def tok_key(self) -> tuple[str, str]:
        return (self.request.request_id, "tok")

    @property
    def neg_key(self) -> tuple[str, str, int]:
        return (self.request.request_id, "neg", self.neg_segment)


class SpeechLoop:
    def __init__(self, model: VibeVoiceForConditionalGeneration, runner: LMRunner) -> None:
        self.model, self.runner = model, runner
        self.ids = model.config.tokens
        self.active: list[SpeechProgress] = []
        self.done: dict[str, SpeechProgress] = {}
        self._steps: dict[int, SolverSteps] = {}

    def add(self, request: SpeechRequest) -> None:
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={request.max_new_tokens}: must be >= 1")
        state = FrameState(request.generator, request.guidance_scale)
        self.active.append(SpeechProgress(request, state, request.prompt_embeds))

    def solver_steps(self, n: int) -> SolverSteps:
        if n not in self._steps:
            self._steps[n] = SolverSteps.make(self.model.config.schedule, n)
        return self._steps[n]

    @torch.inference_mode()
    def step(self) -> None:
        live = self.active
        guided = [p for p in live if p.request.guidance_scale != 1.0]
        rows = [(p.pos_key, p.pending) for p in live] + [(p.tok_key, self._tok_input(p))
                                                          for p in guided]
        out = self.runner.run(rows)
        hidden, uncond = out[:len(live)], out[len(live):]
        next_ids = self._choose(live, torch.stack([h[-1] for h in hidden]),
                                {id(p): u[-1] for p, u in zip(guided, uncond)})
        inputs = [p.pending for p in live]
        speaking = []
        for p, tok, x in zip(live, next_ids, inputs):
            p.tokens.append(tok)
            if tok == self.ids.audio_bos:
                self.runner.free(p.neg_key)
                p.neg_segment += 1
            if tok == self.ids.audio:
                first = len(p.tokens) == 1
                neg_in = self.model.embed_input_ids(
                    torch.tensor([self.ids.audio_bos], device=x.device)) if first else x
                speaking.append((p, neg_in))
            else:
                p.pending = self.model.embed_input_ids(torch.tensor([tok], device=x.device))
        if speaking:
            self._speak(speaking, {id(p): h[-1] for p, h in zip(live, hidden)})
        for p in live:
            if p.tokens[-1] == self.ids.eos or len(p.tokens) >= p.request.max_new_tokens:
                p.finished = True
                for key in (p.pos_key, p.neg_key, p.tok_key):
                    self.runner.free(key)
                self.done[p.request.request_id] = p
        self.active = [p for p in live if not p.finished]

    def _tok_input(self, p: SpeechProgress) -> Tensor:
        last = p.tokens[-1] if p.tokens else p.request.last_prompt_id
        return self.model.embed_input_ids(torch.tensor([last], device=p.pending.device))

    def _choose(self, live: list[SpeechProgress], last: Tensor,
                uncond: dict[int, Tensor]) -> list[int]:
        """Greedy over the four speech ids, after transformers' token CFG where g != 1."""
        scores = torch.log_softmax(self.model.lm_head(last).float(), dim=-1)
        for i, p in enumerate(live):
            if id(p) in uncond:
                lu = torch.log_softmax(self.model.lm_head(uncond[id(p)]).float(), dim=-1)
                g = p.request.guidance_scale
                scores[i] = g * (scores[i] - lu) + lu
        return (scores + self.model.logits_mask).argmax(-1).tolist()

    def _speak(self, speaking: list[tuple[SpeechProgress, Tensor]],
               pos_hidden: dict[int, Tensor]) -> None:
        neg = self.runner.run([(p.neg_key, x) for p, x in speaking])
        by_steps: dict[int, list[int]] = {}
        for i, (p, _) in enumerate(speaking):
            by_steps.setdefault(p.request.num_diffusion_steps, []).append(i)
        for n, rows in by_steps.items():
            group = [speaking[i][0] for i in rows]
            frames = speech_frames(self.model.speech, self.solver_steps(n),
                                   torch.stack([pos_hidden[id(p)] for p in group]),
                                   torch.stack([neg[i][-1] for i in rows]),
                                   [p.frame for p in group])
            for j, p in enumerate(group):
                p.latents.append(frames.latents[j])
                p.audio.append(frames.audio[j])
                p.pending = frames.next_embeds[j:j + 1]

    def run(self) -> dict[str, SpeechProgress]:
        while self.active:
            self.step()
        return self.done
