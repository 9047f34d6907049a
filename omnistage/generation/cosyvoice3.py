"""CosyVoice3's flow and vocoder as a generation-stage model: the LM stage's speech tokens in
(TokenDelta, a few a step, on a chunked edge) with the clone's voice prompt on the first chunk
(VoicePrompt), the waveform out in chunks while the LM still writes, as upstream's
`CosyVoice3Model.tts(stream=True)`:

    a chunk is due once hop + pre_lookahead_len tokens past the offset are in (the first hop
    padded by the prompt's tokens up to a whole number of hops; the hop then grows
    x stream_scale_factor up to token_max_hop_len: 25, 50, 100, 100, ... as upstream's);
    flow: token2mel over prompt + tokens so far with the DiT's chunk mask, finalize=False (the
    last pre_lookahead_len tokens are look-ahead only) -> the mel of the hop's tokens joins
    the request's mel cache; HiFT over the whole cache with finalize=False (it holds back
    its last `lag` frames) -> the samples past those already sent go out.
    the input closed: the hops still due go out one a step (`has_backlog`), then the last
    chunk: the flow over every token, full attention, finalize=True (upstream's last
    token2wav call passes no stream flag), HiFT over the cache with finalize=True.

Upstream's stream is not its whole decode: earlier mel was made with the chunk mask and less
look-ahead (docs/models/cosyvoice3.md gives the measured difference). `stream: false` keeps
the whole decode (one chunk when the input closes); a request shorter than one hop gets its
whole decode either way. One difference with upstream: its hop lives on the model and keeps
growing over requests (the second stream starts at token_max_hop_len); here every request
starts at token_hop_len, as upstream's first.

Requests due in the same step share one flow call (the flow batches: a padded row equals its
run alone), whatever chunk each is at; the vocoder takes one utterance a call (its look-ahead
would read a padded row's padding). The vocoder's source noise is
`SourceNoise.seeded(options.noise_seed, ...)` (upstream draws it from the global RNG when it
builds HiFT), the flow's noise upstream's fixed buffer (seed 0).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from omnistage.diffusion.pipelines.cosyvoice3 import CloneInput, fixed_noise, solve, token2mel
from omnistage.layers.graph_capture import PaddedShapes, ShapeGraphs
from omnistage.models.cosyvoice3.flow import CausalMaskedDiffWithDiT
from omnistage.models.cosyvoice3.hift import SourceNoise
from omnistage.models.cosyvoice3.model import CosyVoice3
from omnistage.payloads import SAMPLE_RATE, AudioChunk, Payload, TokenDelta, VoicePrompt
from omnistage.utils import trace

# per-request state, not payloads
_TOKENS, _VOICE, _OFFSET, _HOP, _MEL, _SENT, _CLOSED, _DONE = (
    "cosyvoice3.tokens", "cosyvoice3.voice", "cosyvoice3.offset", "cosyvoice3.hop",
    "cosyvoice3.mel", "cosyvoice3.sent", "cosyvoice3.closed", "cosyvoice3.done")
GRAPH_ROWS = 16              # the most rows of a graphed flow call (cuda_graphs)


@dataclass(frozen=True, slots=True)
class CosyVoice3FlowOptions:
    """The stage's `generation.options`: num_steps, the flow's Euler steps (upstream: 10);
    noise_seed, the seed of the vocoder's source noise; stream (False: the whole utterance
    once the LM stops); token_hop_len, token_max_hop_len, stream_scale_factor: upstream's
    CosyVoice3Model hop schedule (25 tokens = the released DiT's 50-frame chunk)."""

    num_steps: int = 10
    noise_seed: int = 0
    stream: bool = True
    token_hop_len: int = 25
    token_max_hop_len: int = 100
    stream_scale_factor: int = 2
    # the flow's DiT in bfloat16 (`CausalMaskedDiffWithDiT.compute_in`: its matmuls and
    # attention; the Euler state, the token encoder and HiFT stay float32); auto: bfloat16 on
    # CUDA, float32 (upstream's, the golden tests') elsewhere. With cuda_graphs, against
    # float32 eager on one H200 (bench speech, released shape; benchmarks/results/runs/
    # issue43_h200_s27/): RTF 0.072 / 0.66 / 0.93 against 0.43 / 0.79 / 1.65 at 1 / 8 / 32,
    # first audio 0.14 against 1.26 s alone; the waveform's SNR against float32 eager is
    # checked in tests/gpu/test_cosyvoice3_flow_cuda.py (random weights)
    flow_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # each flow call's Euler steps (all num_steps guided velocities) replayed from one CUDA
    # graph, CUDA only (elsewhere eager): the batch padded to 1, 2, 4, 8 or 16 rows of a
    # multiple of graph_frames frames up to graph_max_frames (a row padded equals its run
    # alone; a longer or larger batch runs eagerly), each shape captured the first time it
    # runs
    cuda_graphs: bool = True
    graph_frames: int = 64
    graph_max_frames: int = 4096

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps}: must be >= 1")
        if not 1 <= self.token_hop_len <= self.token_max_hop_len:
            raise ValueError(f"token_hop_len={self.token_hop_len}, token_max_hop_len="
                             f"{self.token_max_hop_len}: need 1 <= hop <= max hop")
        if self.stream_scale_factor < 1:
            raise ValueError(f"stream_scale_factor={self.stream_scale_factor}: must be >= 1")
        if not 1 <= self.graph_frames <= self.graph_max_frames:
            raise ValueError(f"graph_frames={self.graph_frames}, graph_max_frames="
                             f"{self.graph_max_frames}: need 1 <= graph_frames <= max")


@dataclass(frozen=True, slots=True)
class _Job:
    index: int                   # the request's row in the call
    clone: CloneInput
    offset: int                  # tokens whose mel is already in the cache
    hop: int                     # tokens this chunk adds (0: the last chunk)


class CosyVoice3Generator:
    Options = CosyVoice3FlowOptions

    def __init__(self, model: CosyVoice3, device: torch.device,
                 options: CosyVoice3FlowOptions = CosyVoice3FlowOptions()) -> None:
        self.model, self.options = model, options
        self.noise = fixed_noise(model.cfg.flow.input_size, device)
        self.hop = model.cfg.hift.samples_per_frame
        self.lookahead = model.cfg.flow.pre_lookahead_len
        self.info = {SAMPLE_RATE: model.sample_rate}
        if options.flow_dtype == "bfloat16" or (options.flow_dtype == "auto"
                                                and device.type == "cuda"):
            model.flow.compute_in(torch.bfloat16)
        self.graphs: FlowGraphs | None = None
        if options.cuda_graphs and device.type == "cuda":
            self.use_graphs()

    def use_graphs(self, capture_after: int = 1) -> None:
        """Pad every flow call to a planned shape and replay its Euler steps from CUDA graphs
        (`FlowGraphs`; CPU tests: under an emulated capture)."""
        self.graphs = FlowGraphs(self.model.flow, self.options.graph_frames,
                                 self.options.graph_max_frames, capture_after)

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None,
                        options: CosyVoice3FlowOptions = CosyVoice3FlowOptions()
                        ) -> CosyVoice3Generator:
        """The flow and HiFT run in float32 whatever the stage's dtype (as upstream's)."""
        if path is None:
            raise ValueError("the CosyVoice3 flow stage needs the checkpoint folder")
        return cls(CosyVoice3.from_pretrained(path, device), device, options)

    def has_backlog(self, state: dict) -> bool:
        """A chunk is due without new input (tokens came in a burst), or the input closed
        and the last chunk is not out yet."""
        if state.get(_DONE):
            return False
        return bool(state.get(_CLOSED)) or self._due_hop(state) is not None

    def _due_hop(self, state: dict) -> int | None:
        """Tokens the next streamed chunk adds, if it is due now."""
        if not self.options.stream or state.get(_DONE) or _VOICE not in state:
            return None
        offset = state.get(_OFFSET, 0)
        hop = state.get(_HOP, self.options.token_hop_len)
        if offset == 0:                      # the prompt plus the first hop: whole hops
            p = int(state[_VOICE].tokens.shape[0])
            hop += math.ceil(p / hop) * hop - p
        have = len(state.get(_TOKENS, ()))
        return hop if have - offset >= hop + self.lookahead else None

    @torch.inference_mode()
    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        jobs: list[_Job] = []
        out: list[dict[str, Tensor]] = [{} for _ in inputs]
        for b, (x, state, last) in enumerate(zip(inputs, states, is_last)):
            _take(x, state)
            if last:
                state[_CLOSED] = True
            job = self._job(b, state, last)
            if job is not None:
                jobs.append(job)
            elif last and not state.get(_DONE):
                state[_DONE] = True
                out[b] = AudioChunk(torch.zeros(0)).pack()       # nothing spoken: no audio
        if jobs:
            start = time.time()
            mels = token2mel(self.model.flow, [j.clone for j in jobs], self.noise,
                             self.options.num_steps,
                             None if self.graphs is None else self.graphs.shapes, self.graphs)
            trace.span("cosyvoice3.flow", start, rows=len(jobs), graphs=self.graphs is not None,
                       tokens=[int(j.clone.tokens.shape[0]) for j in jobs])
            ratio = self.model.cfg.flow.token_mel_ratio
            for j, mel in zip(jobs, mels):
                out[j.index] = AudioChunk(self._emit(states[j.index], j,
                                                     mel[j.offset * ratio:])).pack()
        return out

    def _job(self, b: int, state: dict, last: bool) -> _Job | None:
        """This step's chunk of one request: a due hop, else the last chunk once the input
        closed (None: nothing to do, or nothing spoken)."""
        if state.get(_DONE) or _VOICE not in state or not state.get(_TOKENS):
            return None
        v, tokens, offset = state[_VOICE], state[_TOKENS], state.get(_OFFSET, 0)
        hop = self._due_hop(state)
        if hop is not None:
            n, streaming, finalize = offset + hop + self.lookahead, True, False
        elif last:
            n, streaming, finalize, hop = len(tokens), False, True, 0
        else:
            return None
        clone = CloneInput(torch.tensor(tokens[:n]), v.tokens.long(), v.mel.float(),
                           v.xvector.float(), streaming=streaming, finalize=finalize)
        return _Job(b, clone, offset, hop)

    def _emit(self, state: dict, job: _Job, mel: Tensor) -> Tensor:
        """The request's new mel (T, mel) joins its cache; the vocoder runs over the whole
        cache; the samples not sent before come back."""
        cache = mel if _MEL not in state else torch.cat([state[_MEL], mel])
        state[_MEL] = cache
        finalize = job.hop == 0
        if finalize:
            state[_DONE] = True
        else:
            state[_OFFSET] = job.offset + job.hop
            hop = state.get(_HOP, self.options.token_hop_len)
            state[_HOP] = min(self.options.token_max_hop_len,
                              hop * self.options.stream_scale_factor)
        if not finalize and cache.shape[0] <= self.model.hift.lag:
            return torch.zeros(0)
        wave = self.vocode(cache, finalize)
        sent = state.get(_SENT, 0)
        state[_SENT] = max(sent, wave.shape[0])
        return wave[sent:]

    def speak(self, tokens: list[int], voice: VoicePrompt) -> list[Tensor]:
        """Every chunk the stage sends for these tokens, all in at once (the chunks do not
        depend on how the tokens arrive): the golden path of the served tests."""
        state: dict = {}
        x = Payload(tokens=TokenDelta(list(tokens)), voice_prompt=voice).pack()
        chunks = []
        while True:
            out = self.generate([x], [state], [True])[0]
            x = {}
            if out:
                chunks.append(AudioChunk.unpack(out).samples)
            if not self.has_backlog(state):
                return chunks

    def vocode(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """(T, mel) -> (T * hop,) float32 on the CPU ((T - hift.lag) * hop, finalize=False)."""
        h = self.model.cfg.hift
        noise = SourceNoise.seeded(self.options.noise_seed, mel.shape[0] * self.hop,
                                   h.nb_harmonics + 1)
        start = time.time()
        wave, _ = self.model.hift(mel.T[None], noise, finalize)
        wave = wave.reshape(-1).float().cpu()
        trace.span("cosyvoice3.hift", start, frames=int(mel.shape[0]))
        return wave


class FlowGraphs:
    """`solve` (a flow call's Euler steps) replayed from CUDA graphs, one per planned shape:
    rows 1, 2, 4, 8, 16 (GRAPH_ROWS) of a multiple of `frames` frames up to `max_frames`
    (token2mel pads a batch to `shapes`), each captured the `capture_after`-th time it runs;
    any other shape runs eagerly."""

    def __init__(self, flow: CausalMaskedDiffWithDiT, frames: int, max_frames: int,
                 capture_after: int = 1) -> None:
        self.flow = flow
        lengths = tuple(range(frames, max_frames + 1, frames))
        self.shapes = PaddedShapes(lengths, GRAPH_ROWS * lengths[-1], GRAPH_ROWS)
        self.graphs = ShapeGraphs(functools.partial(solve, flow),
                                  max_graphs=len(self.shapes.all()),
                                  capture_after=capture_after)

    @property
    def num_replays(self) -> int:
        return self.graphs.num_replays

    def __call__(self, x: Tensor, *rest: Tensor) -> Tensor:
        rows, length = x.shape[:2]
        if length in self.shapes.lengths and rows in self.shapes.row_sizes(length):
            return self.graphs(x, *rest)
        return solve(self.flow, x, *rest)


def _take(x: dict[str, Tensor], state: dict) -> None:
    """One step's input into the request's state (values replaced, never changed in place:
    the engine's snapshot contract). A voice with no x-vector rows is the edge's filler
    (stages/cosyvoice3_edge.py): only the first chunk carries the voice."""
    delta, voice = TokenDelta.unpack(x), VoicePrompt.unpack(x)
    if delta is not None and delta.token_ids:
        state[_TOKENS] = state.get(_TOKENS, []) + list(delta.token_ids)
    if voice is not None and voice.xvector.numel() and _VOICE not in state:
        state[_VOICE] = voice
