"""Streaming Qwen2.5-Omni token2wav: a request's mel integrated chunk by chunk while the talker
still writes codes, each chunk's ODE run on a window of context around it, the windows of all
requests stepped together, and the mel vocoded exactly (models/qwen2_5_omni/bigvgan_stream.py).

Why windows and not exact: a DiT evaluation lets a frame see its own block of `block_size`
mel frames, the block before it in the look-back layers and the block after it in the
look-ahead layer: in the released model (layers 0 and 20 back, 10 ahead) a forward reaches 2
blocks back and 1 ahead. The ODE chains 36 evaluations (9 RK4 steps of 4), so a mel frame
depends on codes 36 blocks (8.6 s of audio) ahead and 72 behind. An exact stream would hold
every chunk back until 8.6 s of codes after it were written, so instead each chunk of mel
frames [s, e) (whole blocks) integrates the window

    blocks    | ... | left_blocks | chunk [s, e) | right_blocks | ...
    window          [s - left * block_size ......... e + right * block_size)

from the same noise the whole decode starts from at those frames (a per-request CPU
generator drawn frame by frame in order: a frame's noise is a function of its position,
equal to the whole decode's first draw of that seed on the CPU), and keeps [s, e). Windows
start on block boundaries, so their blocks are the whole decode's. The error this leaves at
the shipped defaults: measured in docs/models/qwen2_5-omni.md
(scripts/measure_token2wav_seams.py). A request whose codes all arrive before its first chunk is
ready decodes in one window: the whole.

Windows are independent (codes and noise in, mel out), so a request may have several in
flight; every engine step takes each window in flight one RK4 step (`step_windows`, one
batched DiT call per evaluation, rows padded and masked: `Token2WavDiT.forward(lengths=)`),
and a window that has taken its last step hands its chunk's mel to the request's MelStream.
With planned shapes (on CUDA), that batch is padded to one of a few (rows, frames), and the
whole step, four guided evaluations and their sum (`dit_step`), replays a CUDA graph of that
shape (generation/token2wav_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.diffusion.solvers.rk4 import rk4_update
from omnistage.layers.graph_capture import PaddedShapes, stack_padded
from omnistage.models.qwen2_5_omni.bigvgan_stream import MelStream
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavDiT


@dataclass(frozen=True, slots=True)
class Chunking:
    """Chunk and context sizes, in the DiT's attention blocks (24 mel frames, 12 codes,
    0.24 s in the released model). Chunks grow: the first is `first_chunk_blocks`, each next
    one twice the one before, up to `chunk_blocks` (2, 4, 4, ... by default; 2, 4, 8, 8, ...
    with chunk_blocks 8): a small first chunk for the first audio, then longer windows, fewer
    of them, without the playback waiting on one long second chunk."""
    chunk_blocks: int = 4
    first_chunk_blocks: int = 2
    left_blocks: int = 2
    right_blocks: int = 2

    def blocks_after(self, previous: int) -> int:
        """The next chunk's blocks after one of `previous` blocks (0: the first chunk)."""
        return min(self.chunk_blocks, 2 * previous) if previous else self.first_chunk_blocks

    def sizes(self) -> tuple[int, ...]:
        """Every chunk size a stream plans, in order (its last chunk may be shorter)."""
        out: list[int] = []
        k = 0
        while (k := self.blocks_after(k)) not in out:
            out.append(k)
        return tuple(out)

    def __post_init__(self) -> None:
        if min(self.chunk_blocks, self.first_chunk_blocks) < 1 or \
                min(self.left_blocks, self.right_blocks) < 0:
            raise ValueError(f"token2wav options {self}: chunk_blocks and first_chunk_blocks "
                             "must be >= 1 (0 chunk_blocks: whole decodes), left_blocks and "
                             "right_blocks >= 0")


@dataclass(frozen=True, slots=True)
class SpeakerRows:
    """A speaker's conditioning as the DiT takes it, on the device: the speaker vector
    `cond` (1, enc_emb_dim), the encoded reference mel (1, enc_dim) and the encoded zero
    reference of the unconditional half (1, enc_dim)."""
    cond: Tensor
    speaker: Tensor
    null_speaker: Tensor


@dataclass(frozen=True, slots=True)
class Window:
    """One chunk's ODE in flight: frames [start, start + x.shape[0]) of the request's mel,
    of which it keeps [keep_from, keep_to)."""
    x: Tensor                   # (W, mel) on the device, at step `step_idx`
    codes: Tensor               # (W / repeats,) on the device
    start: int
    keep_from: int
    keep_to: int
    step_idx: int = 0


class Token2WavStream:
    """One request: its codes as they come (`append`, `finish`), the windows of its chunks,
    and the MelStream its chunks' mel goes to (vocoded at `mel_shapes`, if planned).
    Attributes are replaced, never changed in place (the generation engine snapshots a state
    one level deep)."""

    def __init__(self, model: Token2Wav, chunking: Chunking, speaker_idx: int, seed: int,
                 device: torch.device, mel_shapes: PaddedShapes | None = None) -> None:
        cfg = model.cfg.dit
        assert cfg.block_size % cfg.repeats == 0, \
            f"block_size {cfg.block_size} is not a whole number of codes ({cfg.repeats} frames)"
        self.block, self.repeats, self.mel_dim = cfg.block_size, cfg.repeats, cfg.mel_dim
        self.chunking = chunking
        self.speaker_idx = speaker_idx
        self.device = device
        # the codes and the whole decode's noise from frame `_first` on (what later windows
        # may still need), on the host
        self._first = 0
        self._codes = torch.zeros(0, dtype=torch.long)
        self._gen = torch.Generator().manual_seed(seed)
        self._noise = torch.zeros(0, cfg.mel_dim)
        self.num_planned = 0        # mel frames whose windows have started
        self.last_blocks = 0        # the last started chunk's blocks (0: none yet)
        self.windows: tuple[Window, ...] = ()
        self.mel = MelStream(model.code2wav_bigvgan_model, cfg.mel_dim, device, mel_shapes)
        self.is_finished = False

    @property
    def num_frames(self) -> int:
        """Mel frames of the codes received."""
        return self._first + self._codes.shape[0] * self.repeats

    def append(self, codes: Tensor) -> None:
        assert not self.is_finished, "codes after the stream's end"
        self._codes = torch.cat([self._codes, codes.to("cpu", torch.long)])

    def finish(self) -> None:
        self.is_finished = True

    def next_chunk(self) -> tuple[int, int] | None:
        """The next chunk's frames [s, e) if its window's frames are all in, else None."""
        c, s = self.chunking, self.num_planned
        e = s + self.block * c.blocks_after(self.last_blocks)
        if self.num_frames >= e + c.right_blocks * self.block:
            return s, e
        if self.is_finished and self.num_frames > s:
            return s, min(e, self.num_frames)
        return None

    def start_window(self) -> Window:
        """The next ready chunk's window, at step 0."""
        chunk = self.next_chunk()
        assert chunk is not None, "no chunk is ready"
        s, e = chunk
        w0, w1 = self.window_bounds(s, e)
        a, b = w0 - self._first, w1 - self._first
        window = Window(self._noise_until(w1)[a:b].to(self.device),
                        self._codes[a // self.repeats:b // self.repeats].to(self.device), w0, s,
                        e)
        self.num_planned = e
        self.last_blocks = self.chunking.blocks_after(self.last_blocks)
        self.windows = (*self.windows, window)
        drop = max(0, e - self.chunking.left_blocks * self.block - self._first)  # behind all
        self._codes, self._noise = self._codes[drop // self.repeats:], self._noise[drop:]
        self._first += drop
        return window

    def window_bounds(self, s: int, e: int) -> tuple[int, int]:
        """The frames [w0, w1) a chunk's window integrates: its context blocks, clipped to
        the codes received."""
        c = self.chunking
        return (max(0, s - c.left_blocks * self.block),
                min(self.num_frames, e + c.right_blocks * self.block))

    def _noise_until(self, end: int) -> Tensor:
        """The whole decode's noise for frames [_first, end), drawn on in order as needed.
        Drawing frame by frame gives the same numbers as one draw of them all whenever mel_dim
        is a multiple of 16 (80 and 16 are): the CPU generator fills 16 values at a time."""
        missing = end - self._first - self._noise.shape[0]
        if missing > 0:                         # a new generator: a snapshot keeps the old one
            gen = torch.Generator().set_state(self._gen.get_state())
            more = torch.randn(missing, self.mel_dim, generator=gen)
            self._noise, self._gen = torch.cat([self._noise, more]), gen
        return self._noise

    @property
    def has_work(self) -> bool:
        return bool(self.windows) or self.next_chunk() is not None or self.mel.num_ready > 0


def admit_windows(streams: Sequence[Token2WavStream], max_batch_frames: int,
                  shapes: PaddedShapes | None = None) -> None:
    """Start windows of ready chunks, one per stream per round: streams with no mel yet
    first (a new request's first audio waits for no one's backlog), then those with the
    least planned; while the batch (windows in flight x the longest, as padded to `shapes`)
    stays within `max_batch_frames` (always at least one window)."""
    order = sorted(streams, key=lambda s: (s.num_planned > 0, s.num_planned))
    rows = sum(len(s.windows) for s in streams)
    pad = shapes.length if shapes is not None else int
    longest = max((pad(w.x.shape[0]) for s in streams for w in s.windows), default=0)
    while True:
        took = False
        for s in order:
            chunk = s.next_chunk()
            if chunk is None:
                continue
            w0, w1 = s.window_bounds(*chunk)
            size = pad(w1 - w0)
            if rows and (rows + 1) * max(longest, size) > max_batch_frames:
                return
            s.start_window()
            rows, longest, took = rows + 1, max(longest, size), True
        if not took:
            return


def dit_step(dit: Token2WavDiT, guidance_scale: float, x: Tensor, t0: Tensor, t1: Tensor,
             cond: Tensor, speaker: Tensor, null_speaker: Tensor, codes: Tensor,
             lengths: Tensor | None) -> Tensor:
    """One RK4 step of every row of x (B, T, mel) from its t0 to its t1 (B,), the velocity
    guided (`Token2WavDiT.guided_velocity`); from device tensors alone, so that one CUDA
    graph holds the whole step (four evaluations of both halves)."""

    def velocity(t: Tensor, x: Tensor) -> Tensor:
        return dit.guided_velocity(x, t, cond, speaker, null_speaker, codes, guidance_scale,
                                   lengths)

    return rk4_update(velocity, t0, t1, x)


def step_windows(model: Token2Wav, streams: Sequence[Token2WavStream], times: Tensor,
                 guidance_scale: float, speakers: Sequence[SpeakerRows],
                 shapes: PaddedShapes | None = None,
                 step: Callable[..., Tensor] | None = None) -> None:
    """Take every window in flight one RK4 step, all rows in one batch (each at its own
    step; padded to `shapes` if planned: rows of length 0 and frames past each row's
    length, which no real frame sees); a window past its last step hands its chunk's mel to
    its stream's MelStream. step: what runs `dit_step` past its first two arguments (CUDA
    graphs of it; default: it, eagerly)."""
    flight = [(s, w) for s in streams for w in s.windows]
    if not flight:
        return
    lengths = [w.x.shape[0] for _, w in flight]
    num, frames = len(flight), max(lengths)
    if shapes is not None:
        frames = shapes.length(frames)
        num = shapes.rows(num, frames)
    padding = num - len(flight)
    x = stack_padded([w.x for _, w in flight], num, frames)                    # (B, T, mel)
    codes = stack_padded([w.codes for _, w in flight], num, frames // model.cfg.dit.repeats)
    rows = [speakers[s.speaker_idx] for s, _ in flight]
    rows += rows[:1] * padding                      # padding rows: any speaker's, dropped
    cond, speaker, null = (torch.cat([getattr(r, f) for r in rows])
                           for f in ("cond", "speaker", "null_speaker"))
    mask = None if shapes is None and min(lengths) == frames else \
        torch.tensor(lengths + [0] * padding, device=x.device)
    steps = torch.tensor([w.step_idx for _, w in flight] + [0] * padding)  # on the host
    num_steps = times.shape[0] - 1
    assert int(steps.max()) < num_steps, f"a window past step {num_steps}"
    run = step or (lambda *args: dit_step(model.dit, guidance_scale, *args))
    x = run(x, times[steps], times[steps + 1], cond, speaker, null, codes, mask)
    moved = {id(w): Window(x[b, :n], w.codes, w.start, w.keep_from, w.keep_to, w.step_idx + 1)
             for b, ((_, w), n) in enumerate(zip(flight, lengths))}
    for s in {id(s): s for s, _ in flight}.values():
        windows = [moved[id(w)] for w in s.windows]
        for w in windows:
            if w.step_idx == num_steps:
                s.mel.append(w.x[w.keep_from - w.start:w.keep_to - w.start])
        s.windows = tuple(w for w in windows if w.step_idx < num_steps)
