"""Qwen2.5-Omni's token2wav as a generation-stage model: a request's codec tokens collect
until the talker is done, then its mel is integrated from noise, one RK4 step (four
guided DiT evaluations) per engine step, and vocoded whole.

Why whole and not streamed: every DiT evaluation lets a frame see its neighbouring blocks, and
the ODE chains 36 of them, so each mel frame depends on every code; a chunk decoded alone would
differ from the whole decode (the reference decodes the whole sequence too).

Steps interleave: a request at step 3 and one at step 7 share an engine step (each runs its
own step; lengths differ, so they are not stacked), and no long request holds the stage for
all of its steps at once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from omnistage.diffusion.solvers.rk4 import rk4_step, sway_times
from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav, load_speakers


class Token2WavGenerator:
    """Inputs per chunk: "codes" (n,) codec ids and "speaker" (n,) the speaker's index in
    the checkpoint's speaker map. Options: num_steps, guidance_scale, sway_coefficient (the
    reference's defaults 10, 0.5, -1.0) and seed (the noise: every request's first draw of a
    generator seeded with it, as the reference's after torch.manual_seed(seed))."""

    def __init__(self, model: Token2Wav, speakers: list, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, seed: int = 0
                 ) -> None:
        if num_steps < 2:
            raise ValueError(f"token2wav option num_steps={num_steps}: must be >= 2")
        self.model = model
        self.speakers = speakers
        self.guidance_scale = guidance_scale
        self.seed = seed
        self.device = next(model.parameters()).device
        self.times = sway_times(num_steps, sway_coefficient, self.device)
        self.info = {"sample_rate": model.cfg.sample_rate}

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None, **options: float) -> Token2WavGenerator:
        folder = resolve_model_path(str(path))
        model = Token2Wav.from_pretrained(folder, device, torch.float32)   # float32 only
        return cls(model, list(load_speakers(folder).values()), **options)

    def has_backlog(self, state: dict) -> bool:
        return "x" in state

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        outs: list[dict[str, Tensor]] = []
        for x, state, last in zip(inputs, states, is_last):
            if "codes" in x:
                state["codes"] = torch.cat([state.get("codes", torch.zeros(0, dtype=torch.long)),
                                            x["codes"].long()])
                state["speaker"] = int(x["speaker"][0])
            if last and "x" not in state and state.get("codes") is not None \
                    and state["codes"].numel():
                self._start(state)
            outs.append(self._step(state) if "x" in state else {})
        return outs

    def _start(self, state: dict) -> None:
        """The request's noise and conditioning, on the device; step 0 next."""
        codes = state.pop("codes").to(self.device)[None]                  # (1, N)
        speaker = self.speakers[state["speaker"]]
        cfg = self.model.cfg.dit
        gen = torch.Generator(self.device).manual_seed(self.seed)
        state["x"] = torch.randn(1, codes.shape[1] * cfg.repeats, cfg.mel_dim, generator=gen,
                                 device=self.device)
        state["cond"] = (codes, speaker.cond.to(self.device), speaker.ref_mel.to(self.device))
        state["step_idx"] = 0

    def _step(self, state: dict) -> dict[str, Tensor]:
        """One RK4 step of the request's mel; after the last, its waveform."""
        codes, cond, ref_mel = state["cond"]
        dit, scale = self.model.dit, self.guidance_scale

        def velocity(t: Tensor, x: Tensor) -> Tensor:
            return dit.guided_velocity(x, t.reshape(1), cond, ref_mel, codes, scale)

        x = rk4_step(velocity, self.times, state["step_idx"], state["x"])
        state["step_idx"] += 1
        if state["step_idx"] < self.times.shape[0] - 1:
            state["x"] = x           # replaced, not changed in place (GenerationModel)
            return {}
        del state["x"]
        return {"audio": self.model.vocode(x)[0].float().cpu()}
