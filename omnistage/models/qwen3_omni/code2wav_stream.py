"""Streaming Qwen3-Omni code2wav: one request's state (`Code2WavStream`) and the batched
decode of many requests' ready chunks (`decode_streams`), exactly the whole decode. The
layout of a window and why it is exact: see `Code2WavStream`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.models.qwen3_omni.code2wav import Code2Wav, check_chunking
from omnistage.utils.host import int_tensor


class Code2WavStream:
    """One request's streaming decode, exact: the concatenated output is the whole decode
    `model.decode(all frames)` (its `num_samples(T)` samples, each within float32 rounding)
    whenever `left_context >= cfg.receptive_field_frames`, the default.

    Frames arrive in any pieces (`append`); every complete chunk (`first_chunk_frames`, then
    `chunk_frames`) is decoded as soon as it is there, in two parts:

    - the sliding-window transformer continues from the keys and values the stream keeps of
      its last `sliding_window - 1` rows in every layer, so each row sees what it sees in the
      whole decode, however far back its stacked windows reach (568 frames in the real model);
    - the convolutional vocoder decodes a window of `left_context` earlier rows + the chunk's.
      A window ending at frame `end` can compute only `end * U - num_lost` samples (U =
      total_upsample): the rest need frame `end` (each decoder block's transposed conv looks
      one step ahead). So each window's last `num_lost` samples are held back, and the next
      window, which starts `left_context` frames earlier, recomputes them:

        frames    | chunk 0        | chunk 1            | chunk 2 ...
        window 0  [0 ............ e0)                     emits [0, e0*U - lost)
        window 1            [e0 - ctx ......... e1)        emits [e0*U - lost, e1*U - lost)
        last window                                       emits up to num_samples(T)

    With a `left_context` below the receptive field, a window's first samples see zeros for
    the rows before it: samples after the first chunk differ slightly from the whole decode;
    none is dropped or repeated. Samples come back as float32 1-D tensors on the model's
    device.
    """

    def __init__(self, model: Code2Wav, chunk_frames: int = 25, left_context: int | None = None,
                 first_chunk_frames: int | None = None) -> None:
        if left_context is None:
            left_context = model.cfg.receptive_field_frames
        check_chunking(model.cfg, chunk_frames, left_context)
        if first_chunk_frames is not None:
            check_chunking(model.cfg, first_chunk_frames, left_context)
        if left_context < 1:
            raise ValueError(f"left_context {left_context}: streaming needs at least 1 frame "
                             "(each window recomputes the last samples of the one before it)")
        self.model = model
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames or chunk_frames
        self.left_context = left_context
        cfg = model.cfg
        dtype = model.dtype
        # frames not decoded yet, kept on the host: appending a frame touches no device (on a
        # GPU shared with the talker, any copy of this process waits for a time slice, 14 ms a
        # frame at concurrency 8); they go over once per chunk, in `_continue_transformer`.
        # Before them, the `model.embed_context` frames the next chunk's embedding reaches
        # back to: code -1 before the first frame
        self._codes = torch.full((cfg.num_quantizers, model.embed_context), -1,
                                 dtype=torch.long)
        # the transformer's keys and values of the last rows: (layers, 2, P, Hkv, D), the last
        # `_num_past` of the P real
        self._past = empty_past(model)
        self._num_past = 0
        self._rows = torch.empty(0, model.row_size, dtype=dtype, device=model.device)
        self.num_frames = 0            # frames received
        self.num_decoded_frames = 0
        self.num_samples_out = 0       # samples returned so far
        self.is_finished = False

    def _chunk_size(self, num_decoded: int) -> int:
        return self.first_chunk_frames if num_decoded == 0 else self.chunk_frames

    @property
    def num_pending_frames(self) -> int:
        """Frames received and not decoded yet."""
        return self.num_frames - self.num_decoded_frames

    @property
    def has_ready_chunk(self) -> bool:
        pending = self.num_pending_frames
        return (pending >= self._chunk_size(self.num_decoded_frames)
                or (self.is_finished and pending > 0))

    @property
    def next_window_frames(self) -> int:
        """Rows the next vocoder window holds (left context + chunk), 0 if none is ready."""
        if not self.has_ready_chunk:
            return 0
        n = min(self._chunk_size(self.num_decoded_frames), self.num_pending_frames)
        return min(self.left_context, self.num_decoded_frames) + n

    def append(self, frames: Tensor) -> None:
        """Buffer frames (num_quantizers, n); decodes nothing."""
        if self.is_finished:
            raise ValueError("frames: the stream is already finished")
        self.model.check_codes(frames, "frames", batched=False)
        self._codes = torch.cat([self._codes, frames.to("cpu", torch.long)], dim=1)
        self.num_frames += frames.shape[1]

    def finish(self) -> None:
        """No more frames: the last partial chunk becomes ready."""
        self.is_finished = True

    def take_chunk(self) -> int:
        """Mark the next ready chunk as decoded; its number of frames."""
        assert self.has_ready_chunk, "no chunk is ready"
        n = min(self._chunk_size(self.num_decoded_frames), self.num_pending_frames)
        self.num_decoded_frames += n
        return n

    def push(self, frames: Tensor) -> Tensor:
        """Append frames (num_quantizers, n); the samples of every chunk now complete."""
        return push_streams([(self, frames)])[0]

    def flush(self) -> Tensor:
        """Finish the stream; the samples of the last partial chunk (maybe none)."""
        self.finish()
        return decode_streams([self])[0]


def empty_past(model: Code2Wav) -> Tensor:
    """A new stream's transformer cache: (layers, 2, P, Hkv, D) zeros."""
    cfg = model.cfg
    return torch.zeros(cfg.num_hidden_layers, 2, model.pre_transformer.num_cached,
                       cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype,
                       device=model.device)


@dataclass(frozen=True, slots=True)
class VocoderShapes:
    """The few shapes every vocoder forward is padded to, so that each is planned once (and,
    on CUDA, replayed from a graph: `VocoderGraphs`): cuDNN picks and builds a convolution's
    kernels per input shape, 70 to 180 ms for the bench-size vocoder on an H100 (a forward
    itself: 8 to 25 ms), and streams of requests at different points would otherwise bring a
    new shape nearly every step.

    lengths: a stream's windows hold its first chunk alone, then `left_context` + a chunk, so
    those two lengths cover every window. new_lengths: the frames a transformer call continues
    a stream by, its first chunk or a chunk (a longer backlog: its exact count). windows /
    streams: 1 to 8, then every 4, up to what `max_batch_frames` lets in one forward (the
    exact count above that: a single window)."""
    lengths: tuple[int, ...]
    max_batch_frames: int
    new_lengths: tuple[int, ...] = ()

    @classmethod
    def for_stream(cls, first_chunk_frames: int, chunk_frames: int, left_context: int,
                   max_batch_frames: int) -> VocoderShapes:
        return cls(tuple(sorted({first_chunk_frames, left_context + chunk_frames})),
                   max_batch_frames, tuple(sorted({first_chunk_frames, chunk_frames})))

    def batch_sizes(self, frames: int) -> list[int]:
        most = max(1, self.max_batch_frames // frames)
        return [b for b in (*range(1, 9), *range(12, most, 4)) if b < most] + [most]

    def pad(self, num_windows: int, longest: int) -> tuple[int, int]:
        """The shape a forward of `num_windows` windows, the longest `longest`, runs at."""
        return self._pad(num_windows, longest, self.lengths)

    def pad_new(self, num_streams: int, longest: int) -> tuple[int, int]:
        """The (streams, frames) a transformer call of `num_streams` streams, the longest
        continued by `longest` frames, runs at."""
        return self._pad(num_streams, longest, self.new_lengths)

    def _pad(self, num: int, longest: int, lengths: tuple[int, ...]) -> tuple[int, int]:
        frames = next((n for n in lengths if n >= longest), longest)
        return next((b for b in self.batch_sizes(frames) if b >= num), num), frames

    def all(self) -> list[tuple[int, int]]:
        """Every padded shape of a vocoder forward (to plan them all at start-up)."""
        return [(b, n) for n in self.lengths for b in self.batch_sizes(n)]

    def all_new(self) -> list[tuple[int, int]]:
        """Every padded shape of a transformer call."""
        return [(b, n) for n in self.new_lengths for b in self.batch_sizes(n)]


class VocoderGraphs:
    """CUDA graphs of a vocoder's two forwards, the transformer continued (`continue_rows`)
    and the convolutions (`vocode`), at every padded shape of `shapes` of at most `max_batch`
    streams / windows, all captured now; larger ones run eagerly. A forward of the bench-size
    Qwen3-TTS vocoder launches about a thousand small kernels: 20 to 30 ms of host time for
    3 ms of GPU work, which a first chunk's audio waited for."""

    def __init__(self, model: Code2Wav, shapes: VocoderShapes, max_batch: int = 16) -> None:
        dev, dt, cfg = model.device, model.dtype, model.cfg
        new = [(b, n) for b, n in shapes.all_new() if b <= max_batch]
        windows = [(b, n) for b, n in shapes.all() if b <= max_batch]
        self.transformer = ShapeGraphs(model.continue_rows, max_graphs=len(new),
                                       capture_after=1)
        self.vocode = ShapeGraphs(model.vocode, max_graphs=len(windows), capture_after=1)
        past = empty_past(model)
        with torch.inference_mode():
            for b, n in new:
                codes = torch.zeros(b, cfg.num_quantizers, model.embed_context + n,
                                    dtype=torch.long, device=dev)
                zeros = torch.zeros(b, dtype=torch.int64, device=dev)    # as int_tensor
                self.transformer(codes, past.expand(b, *past.shape).contiguous(), zeros,
                                 zeros)
            for b, n in windows:
                self.vocode(torch.zeros(b, n, model.row_size, dtype=dt, device=dev))


def decode_streams(streams: Sequence[Code2WavStream], max_batch_frames: int | None = None,
                   shapes: VocoderShapes | None = None, graphs: VocoderGraphs | None = None
                   ) -> list[Tensor]:
    """Decode ready chunks of `streams` (one model) together; per stream, the new samples
    (float32, 1-D, possibly empty). With `max_batch_frames`, the vocoder's forward holds at
    most that many frames (windows x the longest, as they are padded; always at least one
    window) and the rest stay ready for the next call. Chunks are taken one per stream per
    round: first chunks before later ones (a new request's first audio waits for no one's
    backlog), then the streams with the least audio out so far. With `shapes`, the vocoder's
    batches are padded to one of them (exact: see `Code2Wav.vocode_windows`), and with
    `graphs` (made for those shapes) replayed from CUDA graphs where captured."""
    if not streams:
        return []
    model = streams[0].model
    assert all(s.model is model for s in streams), "streams of different models in one batch"
    chunks = _plan_chunks(streams, max_batch_frames, shapes)
    busy = [i for i, c in enumerate(chunks) if c]
    rows = _continue_transformer(model, [streams[i] for i in busy],
                                 [sum(chunks[i]) for i in busy], shapes, graphs)
    windows: list[tuple[Tensor, int]] = []
    owner: list[int] = []
    upsample, lost = model.total_upsample, model.num_lost
    for i, new in zip(busy, rows):
        s, start = streams[i], 0
        decoded = s.num_decoded_frames - sum(chunks[i])   # before this call
        for n in chunks[i]:
            ctx = min(s.left_context, decoded)
            window = torch.cat([s._rows[s._rows.shape[0] - ctx:], new[start:start + n]])
            # the first window starts at sample 0; later ones recompute the held-back tail
            skip = 0 if decoded == 0 else ctx * upsample - lost
            windows.append((window, skip))
            owner.append(i)
            s._rows = window[-s.left_context:]
            s.num_samples_out += model.cfg.num_samples(ctx + n) - skip
            decoded += n
            start += n
    out: list[list[Tensor]] = [[] for _ in streams]
    shape = None
    if shapes is not None and windows:
        shape = shapes.pad(len(windows), max(w.shape[0] for w, _ in windows))
    vocode = graphs.vocode if graphs is not None else None
    for i, wav in zip(owner, model.vocode_windows(windows, shape, vocode)):
        out[i].append(wav)
    empty = torch.empty(0, dtype=torch.float32, device=model.device)
    return [torch.cat(o) if o else empty for o in out]


def _plan_chunks(streams: Sequence[Code2WavStream], max_batch_frames: int | None,
                 shapes: VocoderShapes | None = None) -> list[list[int]]:
    """Which ready chunks of each stream go into this call (their sizes), in priority order
    within the vocoder's frame budget (windows counted at their padded length); the streams'
    decoded counts advance."""
    order = sorted(range(len(streams)), key=lambda i: (streams[i].num_decoded_frames > 0,
                                                      streams[i].num_samples_out))
    chunks: list[list[int]] = [[] for _ in streams]
    num_windows, longest = 0, 0
    while True:
        took = False
        for i in order:
            n = streams[i].next_window_frames
            if n == 0:
                continue
            if shapes is not None:
                n = shapes.pad(1, n)[1]
            if (max_batch_frames is not None and num_windows
                    and (num_windows + 1) * max(longest, n) > max_batch_frames):
                return chunks
            chunks[i].append(streams[i].take_chunk())
            num_windows, longest, took = num_windows + 1, max(longest, n), True
        if not took:
            return chunks


def _continue_transformer(model: Code2Wav, streams: Sequence[Code2WavStream],
                          counts: Sequence[int], shapes: VocoderShapes | None = None,
                          graphs: VocoderGraphs | None = None) -> list[Tensor]:
    """Run each stream's next `counts` buffered frames through the pre-transformer from its
    kept keys and values, all streams in one batch (padded to `shapes.pad_new`: streams that
    continue by no frame, frames of code 0 after the real ones, all dropped); their rows
    (n, hidden) in order."""
    if not streams:
        return []
    ctx = model.embed_context
    num, n_max = (len(streams), max(counts)) if shapes is None else \
        shapes.pad_new(len(streams), max(counts))
    codes = torch.zeros(num, model.cfg.num_quantizers, ctx + n_max,
                        dtype=torch.long)                         # code 0 pads
    for b, (s, n) in enumerate(zip(streams, counts)):
        codes[b, :, :ctx + n] = s._codes[:, :ctx + n]
        s._codes = s._codes[:, n:]
    dev = model.device
    padding = [0] * (num - len(streams))
    codes = codes.to(dev)                                         # one copy for the batch
    num_past = int_tensor([s._num_past for s in streams] + padding).to(dev)
    num_new = int_tensor([*counts, *padding]).to(dev)
    past = torch.stack([s._past for s in streams])
    if padding:
        past = torch.cat([past, past.new_zeros(len(padding), *past.shape[1:])])
    run = model.continue_rows if graphs is None else graphs.transformer
    with torch.inference_mode():
        rows, past = run(codes, past, num_past, num_new)
    P = model.pre_transformer.num_cached
    for b, (s, n) in enumerate(zip(streams, counts)):
        s._past = past[b]
        s._num_past = min(P, s._num_past + n)
    return [rows[b, :n] for b, n in enumerate(counts)]


def push_streams(items: Sequence[tuple[Code2WavStream, Tensor]],
                 shapes: VocoderShapes | None = None) -> list[Tensor]:
    """Append each stream's frames, then decode all ready chunks in one forward (padded to
    one of `shapes`, if given). Frames are checked first: a ValueError leaves every stream
    as it was."""
    for stream, frames in items:
        if stream.is_finished:
            raise ValueError("frames: the stream is already finished")
        stream.model.check_codes(frames, "frames", batched=False)
    for stream, frames in items:
        stream.append(frames)
    return decode_streams([stream for stream, _ in items], shapes=shapes)
