"""Qwen2.5-Omni's token2wav as a generation-stage model: codec tokens in, 24 kHz audio out.

Streamed (the default): the mel is integrated chunk by chunk on windows of context while the
talker still writes, and vocoded exactly (generation/token2wav_stream.py says how, and why
a chunk's mel can only come close to the whole decode's, not equal it). Whole
(`chunk_blocks: 0`): a request's codes collect until the talker is done, then its mel is
integrated from noise, one RK4 step (four guided DiT evaluations) per engine step, and
vocoded whole, as the reference's generate(return_audio=True) does.

Either way steps interleave: windows or requests at different steps share an engine step,
and no long request holds the stage for all of its steps at once. Streamed on CUDA, each
engine step's DiT step and vocoder forwards replay CUDA graphs at planned shapes, captured
at start-up (generation/token2wav_graphs.py; option cuda_graphs: false runs them eagerly).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from omnistage.diffusion.pipeline import compile_blocks
from omnistage.diffusion.solvers.rk4 import rk4_step, sway_times
from omnistage.generation.token2wav_graphs import Token2WavGraphs, plan_shapes
from omnistage.generation.token2wav_stream import (
    Chunking,
    SpeakerRows,
    Token2WavStream,
    admit_windows,
    step_windows,
)
from omnistage.layers.fp8 import MIN_FEATURES, quantize_fp8
from omnistage.layers.graph_capture import PaddedShapes
from omnistage.layers.int8 import quantize_int8
from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen2_5_omni.bigvgan_stream import vocode_streams
from omnistage.models.qwen2_5_omni.token2wav import (Speaker, Token2Wav, Token2WavDiT,
                                                     load_speakers)
from omnistage.payloads import SAMPLE_RATE, AudioChunk, CodecFrames


@dataclass(frozen=True, slots=True)
class Token2WavOptions:
    """A token2wav stage's `generation.options` (see Token2WavGenerator)."""

    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    seed: int = 0
    chunk_blocks: int = 4           # 0: whole decodes
    first_chunk_blocks: int = 2
    left_blocks: int = 2
    right_blocks: int = 2
    max_batch_frames: int = 4096
    cuda_graphs: bool = True
    # the DiT's transformer in bfloat16: auto (the default) on a CUDA device, where it took
    # the real-time factor at 8 streams from 1.94 to 0.60 on an H200 at 53.5 dB waveform SNR
    # against float32 (bench omni25: `omni25_waveform_snr_db`); float32, the reference's,
    # on the CPU and wherever `float32` is named (the golden tests)
    dit_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # the DiT's blocks through torch.compile (dynamic shapes, one compile for every window
    # count) before the graphs are captured: fused kernels in each replayed RK4 step (10.3 ->
    # 6.6 ms for one window, 27.7 -> 16.7 ms for eight on an H200), real-time factor at 8
    # streams 0.67 -> 0.57 in the same run, for 5-17 s more start-up; CUDA only (elsewhere it
    # changes nothing). The vocoder compiled likewise gained nothing end to end (profile_token2wav)
    compile: bool = True
    vocoder_rows: int = 8           # the most vocoder windows of one graphed forward
    # the DiT's block linears (q / k / v / out, MLP: `Token2WavDiT.fp8_keep` says what stays)
    # quantized at load, on top of dit_dtype: fp8 (e4m3 weights per channel, activations per
    # token, layers/fp8.py; CUDA compute capability 8.9 or newer, refused elsewhere) or int8
    # (W8A8 through torch._int_mm, layers/int8.py; the CPU too). Their waveform SNR against
    # float32: bench omni25's `omni25_waveform_snr_db` (benchmarks/device_session.sh, t2wq)
    dit_quantization: Literal["none", "fp8", "int8"] = "none"
    # linears with a side below this stay as they are (layers/fp8.py's MIN_FEATURES: the
    # released DiT's projections are 1024 and 2048 wide); the tiny test checkpoint lowers it
    dit_quantization_min_features: int = MIN_FEATURES

    def __post_init__(self) -> None:
        if self.num_steps < 2:
            raise ValueError(f"num_steps={self.num_steps}: must be >= 2")
        if self.chunk_blocks < 0:
            raise ValueError(f"chunk_blocks={self.chunk_blocks}: must be >= 0")
        if self.max_batch_frames < 1:
            raise ValueError(f"max_batch_frames={self.max_batch_frames}: must be >= 1")
        if self.dit_quantization_min_features < 1:
            raise ValueError(f"dit_quantization_min_features="
                             f"{self.dit_quantization_min_features}: must be >= 1")
        if self.vocoder_rows < 1:
            raise ValueError(f"vocoder_rows={self.vocoder_rows}: must be >= 1")
        if self.chunk_blocks:       # the window sizes checked now, not at the first request
            Chunking(self.chunk_blocks, self.first_chunk_blocks, self.left_blocks,
                     self.right_blocks)


class Token2WavGenerator:
    """Inputs per chunk: CodecFrames, codes (n,) codec ids and speaker (n,) the speaker's index in
    the checkpoint's speaker map. Options: num_steps, guidance_scale, sway_coefficient (the
    reference's defaults 10, 0.5, -1.0), seed (the noise: the first draw of a generator
    seeded with it, as the reference's after torch.manual_seed(seed); streamed, always a CPU
    generator's), and the streaming (`Chunking`, in DiT blocks: chunk_blocks, 0 for whole
    decodes, first_chunk_blocks, left_blocks, right_blocks; max_batch_frames, the frames
    of one batched DiT call that new windows may fill), cuda_graphs (streamed on CUDA,
    default on: each engine step's forwards padded to planned shapes and replayed from CUDA
    graphs captured now, `use_graphs`), dit_dtype, compile and dit_quantization (the DiT's
    block linears in fp8 or int8, swapped now: `quantize_dit`). At load, every block's q / k
    / v projections become one matmul (`Token2WavDiT.fuse_qkv`: the same products)."""

    Options = Token2WavOptions

    def __init__(self, model: Token2Wav, speakers: list[Speaker],
                 options: Token2WavOptions = Token2WavOptions()) -> None:
        o = self.options = options
        self.model = model
        model.dit.fuse_qkv()        # one matmul for q, k and v: the same products
        if o.dit_dtype == "bfloat16" or (o.dit_dtype == "auto" and
                                         next(model.parameters()).device.type == "cuda"):
            model.dit.compute_in(torch.bfloat16)
        if o.dit_quantization != "none":            # after the cast: the swapped layers
            quantize_dit(model.dit, o.dit_quantization,          # keep their own dtypes
                         o.dit_quantization_min_features)
        self.guidance_scale = o.guidance_scale
        self.seed = o.seed
        self.device = next(model.parameters()).device
        self.times = sway_times(o.num_steps, o.sway_coefficient, self.device)
        self.chunking = None if o.chunk_blocks == 0 else \
            Chunking(o.chunk_blocks, o.first_chunk_blocks, o.left_blocks, o.right_blocks)
        self.max_batch_frames = o.max_batch_frames
        self.speakers = [self._speaker_rows(s) for s in speakers]
        self.info = {SAMPLE_RATE: model.cfg.sample_rate}
        self.dit_shapes: PaddedShapes | None = None
        self.mel_shapes: PaddedShapes | None = None
        self.graphs: Token2WavGraphs | None = None
        if o.compile and self.device.type == "cuda":
            compile_blocks(model.dit)
        if self.chunking is not None and self.device.type == "cuda" and o.cuda_graphs:
            self.use_graphs(o.vocoder_rows)

    def use_graphs(self, max_vocoder_rows: int = 8) -> None:
        """Pad the streams' DiT steps and vocoder forwards to planned shapes and replay them
        from CUDA graphs, every one captured now (CPU tests: under an emulated capture)."""
        assert self.chunking is not None, "CUDA graphs are for streamed decodes"
        self.dit_shapes, self.mel_shapes = plan_shapes(self.model, self.chunking,
                                                       self.max_batch_frames, max_vocoder_rows)
        self.graphs = Token2WavGraphs(self.model, self.times, self.guidance_scale,
                                      self.dit_shapes, self.mel_shapes)

    @torch.inference_mode()
    def _speaker_rows(self, speaker: Speaker) -> SpeakerRows:
        ref_mel = speaker.ref_mel.to(self.device)
        dit = self.model.dit
        return SpeakerRows(speaker.cond.to(self.device), dit.encode_speaker(ref_mel),
                           dit.encode_speaker(torch.zeros_like(ref_mel)))

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None,
                        options: Token2WavOptions = Token2WavOptions()) -> Token2WavGenerator:
        folder = resolve_model_path(str(path))
        model = Token2Wav.from_pretrained(folder, device, torch.float32)   # float32 only
        return cls(model, list(load_speakers(folder).values()), options)

    def has_backlog(self, state: dict) -> bool:
        stream = state.get("stream")
        return "x" in state or (stream is not None and stream.has_work)

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        if self.chunking is not None:
            return self._generate_streams(inputs, states, is_last)
        outs: list[dict[str, Tensor]] = []
        for x, state, last in zip(inputs, states, is_last):
            frames = CodecFrames.unpack(x)
            if frames is not None:
                before = state.get("pending", torch.zeros(0, dtype=torch.long))
                state["pending"] = torch.cat([before, frames.codes.long()])
                state["speaker_idx"] = int(frames.speaker[0])
            if last and "x" not in state and state.get("pending") is not None \
                    and state["pending"].numel():
                self._start(state)
            outs.append(self._step(state) if "x" in state else {})
        return outs

    def _generate_streams(self, inputs: list[dict[str, Tensor]], states: list[dict],
                          is_last: list[bool]) -> list[dict[str, Tensor]]:
        """Codes into each request's stream; new windows admitted; every window one RK4 step;
        what the vocoder can now return, per request."""
        streams: list[Token2WavStream | None] = []
        for x, state, last in zip(inputs, states, is_last):
            stream = state.get("stream")
            frames = CodecFrames.unpack(x)
            if stream is None and frames is not None:
                stream = state["stream"] = Token2WavStream(
                    self.model, self.chunking, int(frames.speaker[0]), self.seed, self.device,
                    self.mel_shapes)
            if stream is not None:
                stream.mel = copy.copy(stream.mel)    # changed below; the snapshot keeps its own
                if frames is not None:
                    stream.append(frames.codes)
                if last and not stream.is_finished:
                    stream.finish()
            streams.append(stream)
        live = [s for s in streams if s is not None]
        graphs = self.graphs
        admit_windows(live, self.max_batch_frames, self.dit_shapes)
        step_windows(self.model, live, self.times, self.guidance_scale, self.speakers,
                     self.dit_shapes, graphs.dit if graphs is not None else None)
        for s in live:
            if s.is_finished and not s.windows and s.next_chunk() is None:
                s.mel.finish()
        audio = iter(vocode_streams([s.mel for s in live], self.mel_shapes,
                                    graphs.vocode if graphs is not None else None))
        outs = [next(audio) if s is not None else torch.empty(0) for s in streams]
        sizes = [a.numel() for a in outs]
        if not any(sizes):
            return [{} for _ in outs]
        host = iter(torch.cat([a for a in outs if a.numel()]).cpu()       # one copy, one sync
                    .split([n for n in sizes if n]))
        return [AudioChunk(next(host)).pack() if n else {} for n in sizes]

    def _start(self, state: dict) -> None:
        """The request's noise and conditioning, on the device; step 0 next."""
        codes = state.pop("pending").to(self.device)[None]                # (1, N)
        cfg = self.model.cfg.dit
        gen = torch.Generator(self.device).manual_seed(self.seed)
        state["x"] = torch.randn(1, codes.shape[1] * cfg.repeats, cfg.mel_dim, generator=gen,
                                 device=self.device)
        state["cond"] = (codes, self.speakers[state["speaker_idx"]])
        state["step_idx"] = 0

    def _step(self, state: dict) -> dict[str, Tensor]:
        """One RK4 step of the request's mel; after the last, its waveform."""
        codes, rows = state["cond"]
        dit, scale = self.model.dit, self.guidance_scale

        def velocity(t: Tensor, x: Tensor) -> Tensor:
            return dit.guided_velocity(x, t.reshape(1), rows.cond, rows.speaker,
                                       rows.null_speaker, codes, scale)

        x = rk4_step(velocity, self.times, state["step_idx"], state["x"])
        state["step_idx"] += 1
        if state["step_idx"] < self.times.shape[0] - 1:
            state["x"] = x           # replaced, not changed in place (GenerationModel)
            return {}
        del state["x"]
        return AudioChunk(self.model.vocode(x)[0].float().cpu()).pack()


def quantize_dit(dit: Token2WavDiT, method: str, min_features: int = MIN_FEATURES,
                 allow_cpu: bool = False) -> list[str]:
    """The DiT's linears but those it keeps (`Token2WavDiT.fp8_keep`) swapped in place for
    FP8 or INT8 ones (option `dit_quantization`); returns the names swapped. fp8 off a GPU
    of compute capability 8.9 or newer: ValueError naming the option (allow_cpu: tests, on
    torch's CPU `_scaled_mm`)."""
    if method == "fp8":
        try:
            return quantize_fp8(dit, min_features, allow_cpu)
        except ValueError as e:
            raise ValueError(f"token2wav option dit_quantization=fp8: {e}") from None
    assert method == "int8", f"dit_quantization={method!r}"
    return quantize_int8(dit, min_features)
