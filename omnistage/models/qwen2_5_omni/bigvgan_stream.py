"""Streaming BigVGAN: mel frames in any pieces, the waveform out as soon as it is final, and
the concatenation equal to the whole decode `vocoder(all mel)` within float32 rounding.

BigVGAN is convolutional and not causal: a sample depends on `context_frames` mel frames on
either side of its own (34 for the released vocoder; bigvgan.py says how it is bounded). So
a stream returns the samples of a frame once `context_frames` later frames are in, and
decodes each window with `context_frames` frames before the first frame it returns:

    mel frames    | 0 ........................... n1 | ........................ n2 |
    window 1      [0 ............................ n1)             returns frames [0, n1 - C)
    window 2                         [n1 - 2C ........................... n2)
                                         returns frames [n1 - C, n2 - C)
    last window   (input closed)          [n2 - 2C ........................ end)
                                         returns frames [n2 - C, end), to the last sample

Every returned sample sees real mel wherever the whole decode's does; a window's own edges
(zero and replicate padding) reach only samples it does not return, except at frame 0 and at
the last frame, which are the whole decode's edges too. Windows of several streams share one
forward, right-padded (the padding is out of reach of every returned sample); a stream's last
window runs unpadded, since its right edge is the decode's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from omnistage.models.qwen2_5_omni.bigvgan import BigVGAN


class MelStream:
    """One request's vocoder stream: `append` mel (n, mel), `finish`, and `vocode_streams`
    returns the new samples (float32, 1-D) of many streams at once."""

    def __init__(self, vocoder: BigVGAN, mel_dim: int, device: torch.device) -> None:
        self.vocoder = vocoder
        self.context = vocoder.context_frames
        self._mel = torch.empty(0, mel_dim, device=device)   # frames [_first, num_frames)
        self._first = 0
        self.num_frames = 0            # mel frames received
        self.num_done = 0              # frames whose samples were returned
        self.is_finished = False

    def append(self, mel: Tensor) -> None:
        assert not self.is_finished, "mel after the stream's end"
        self._mel = torch.cat([self._mel, mel.to(self._mel)])   # replaced, not grown in place
        self.num_frames += mel.shape[0]

    def finish(self) -> None:
        self.is_finished = True

    @property
    def num_ready(self) -> int:
        """Frames whose samples are final now: all but the last `context` (all, once the
        input is closed)."""
        end = self.num_frames if self.is_finished else self.num_frames - self.context
        return max(0, end - self.num_done)

    def take_window(self) -> tuple[Tensor, int, int, bool]:
        """The next window: (mel (W, mel), samples to skip, samples to return, whether it is
        the last); the stream moves past it and keeps the frames the next one needs."""
        n = self.num_ready
        assert n > 0, "no frame is ready"
        start = max(0, self.num_done - self.context)
        window = self._mel[start - self._first:]
        skip = (self.num_done - start) * self.vocoder.hop
        self.num_done += n
        keep = max(0, self.num_done - self.context)
        self._mel, self._first = self._mel[keep - self._first:], keep
        return window, skip, n * self.vocoder.hop, self.is_finished


@torch.inference_mode()
def vocode_streams(streams: Sequence[MelStream]) -> list[Tensor]:
    """The new samples of each stream (float32, 1-D, maybe empty): the ready windows of the
    streams still open in one right-padded forward, each last window alone."""
    out = [torch.empty(0)] * len(streams)
    windows = [(i, *s.take_window()) for i, s in enumerate(streams) if s.num_ready]
    if not windows:
        return out
    vocoder = streams[0].vocoder
    open_ = [w for w in windows if not w[4]]
    if open_:
        longest = max(mel.shape[0] for _, mel, *_ in open_)
        batch = open_[0][1].new_zeros(len(open_), longest, open_[0][1].shape[1])
        for row, (_, mel, *_) in enumerate(open_):
            batch[row, :mel.shape[0]] = mel
        wav = vocoder(batch.transpose(1, 2))                     # (B, samples)
        for row, (i, _, skip, n, _) in enumerate(open_):
            out[i] = wav[row, skip:skip + n].float()
    for i, mel, skip, n, last in windows:
        if last:                                                 # its right edge is the end's
            out[i] = vocoder(mel.T[None])[0, skip:skip + n].float()
    return out
