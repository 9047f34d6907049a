"""Streamed Qwen2.5-Omni token2wav on the tiny checkpoint: the vocoder streams exactly (the
whole decode's samples, within float32 rounding, for any pieces of mel); the DiT's chunks,
each integrated on a window of context, come within the seam error measured by
scripts/measure_token2wav_seams.py of the whole decode (same noise), and a misaligned window
or noise fails that bound by far; several requests streamed together equal each alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from omnistage.generation import token2wav as token2wav_module
from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions
from omnistage.generation.token2wav_stream import (
    Chunking,
    Token2WavStream,
    Window,
    admit_windows,
)
from omnistage.models.qwen2_5_omni.bigvgan_stream import MelStream, vocode_streams
from omnistage.testing.tiny_qwen2_5_omni import SEAM_MIN_SNR_DB, SEAM_TOLERANCE

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def whole(omni25_path: Path) -> Token2WavGenerator:
    return Token2WavGenerator.from_pretrained(omni25_path, "", CPU, None,
                                              Token2WavOptions(chunk_blocks=0))


@pytest.fixture(scope="module")
def streamed(omni25_path: Path) -> Token2WavGenerator:
    """The shipped chunking, but a first chunk of 6 blocks: the tiny vocoder holds back 22
    frames (5.5 of these 4-frame blocks), where the released one holds back 34 of 24."""
    return Token2WavGenerator.from_pretrained(omni25_path, "", CPU, None,
                                              Token2WavOptions(first_chunk_blocks=6))


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return codes_of(64, 1)


@pytest.fixture(scope="module")
def reference(whole: Token2WavGenerator, codes: torch.Tensor) -> torch.Tensor:
    """The whole decode of `codes` by speaker 1."""
    (pieces,) = run(whole, [(codes, 1)], per_call=codes.numel())
    return torch.cat(pieces)


def codes_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def run(generator: Token2WavGenerator, requests: list[tuple[torch.Tensor, int]],
        per_call: int = 4, delays: list[int] | None = None,
        fed_at_first: list[int] | None = None) -> list[list[torch.Tensor]]:
    """Feed each request `per_call` codes a call (request i joins at call delays[i]), all
    in the same calls, then step until no backlog; each request's audio pieces (and into
    `fed_at_first`, how many codes it had been fed when its first audio came)."""
    states: list[dict] = [{} for _ in requests]
    fed = [0] * len(requests)
    pieces: list[list[torch.Tensor]] = [[] for _ in requests]
    delays = delays or [0] * len(requests)
    with torch.inference_mode():
        for call in range(1000):
            live = [i for i, (codes, _) in enumerate(requests) if call >= delays[i] and (
                fed[i] < codes.numel() or generator.has_backlog(states[i]))]
            if not live and call > max(delays):
                return pieces
            inputs = []
            for i in live:
                codes, speaker = requests[i]
                x = codes[fed[i]:fed[i] + per_call]
                fed[i] += x.numel()
                inputs.append({"codes": x, "speaker": torch.full_like(x, speaker)}
                              if x.numel() else {})
            outs = generator.generate(inputs, [states[i] for i in live],
                                      [fed[i] >= requests[i][0].numel() for i in live])
            for i, out in zip(live, outs):
                if out:
                    if not pieces[i] and fed_at_first is not None:
                        fed_at_first.append(fed[i])
                    pieces[i].append(out["audio"])
    raise AssertionError("the streams did not finish in 1000 calls")


def test_vocoder_streams_exactly(whole: Token2WavGenerator) -> None:
    """Mel in odd pieces, two streams at once (one ends early): each equals the whole
    vocoder decode; frames come out once `context_frames` later ones are in."""
    model = whole.model
    vocoder = model.code2wav_bigvgan_model
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(70, 16, generator=gen) * 2 - 4, torch.randn(35, 16, generator=gen) - 5]
    expected = [model.vocode(m[None])[0] for m in mels]
    assert 0.1 < min(e.abs().max() for e in expected), "audible"
    streams = [MelStream(vocoder, 16, CPU) for _ in mels]
    pieces: list[list[torch.Tensor]] = [[], []]
    cuts = [[0, 1, 24, 25, 50, 70], [0, 7, 30, 31, 35]]
    for step in range(len(cuts[0]) - 1):
        for s, m, c in zip(streams, mels, cuts):
            if step + 1 < len(c):
                s.append(m[c[step]:c[step + 1]])
            elif not s.is_finished:
                s.finish()
        for p, out in zip(pieces, vocode_streams(streams)):
            p.append(out)
        assert streams[0].num_done == max(0, cuts[0][step + 1] - vocoder.context_frames)
    streams[0].finish()
    for p, out in zip(pieces, vocode_streams(streams)):
        p.append(out)
    for p, e in zip(pieces, expected):
        assert sum(1 for x in p if x.numel()) >= 3, "several pieces"
        audio = torch.cat(p)
        assert audio.shape == e.shape
        assert (audio - e).abs().max() <= 1e-5


def seam_error(audio: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    err = audio - reference
    return err.abs().max().item(), 10 * math.log10(reference.pow(2).sum() / err.pow(2).sum())


def test_chunked_dit_within_the_measured_seam_error(whole: Token2WavGenerator,
                                                    streamed: Token2WavGenerator,
                                                    codes: torch.Tensor,
                                                    reference: torch.Tensor) -> None:
    """Codes two a call, as a talker writes them: the audio comes in pieces, the first while
    half the codes are still to come, and within the seam bound of the whole decode."""
    assert 0.1 < reference.abs().max() < 0.99, "audible, not clamped"
    fed_at_first: list[int] = []
    (pieces,) = run(streamed, [(codes, 1)], per_call=2, fed_at_first=fed_at_first)
    assert len(pieces) >= 4, "the audio comes in several pieces"
    # the first window (6 + 2 blocks: 16 codes) starts at call 8, ends 9 RK4 steps later
    assert fed_at_first == [32], "the first audio waits for its window's codes only"
    audio = torch.cat(pieces)
    assert audio.shape == reference.shape
    max_err, snr = seam_error(audio, reference)
    assert max_err <= SEAM_TOLERANCE and snr >= SEAM_MIN_SNR_DB, (max_err, snr)
    (short,) = run(streamed, [(codes[:5], 1)], per_call=5)    # one window: the whole decode
    (short_ref,) = run(whole, [(codes[:5], 1)], per_call=5)
    assert (torch.cat(short) - torch.cat(short_ref)).abs().max() <= 1e-5


class Recorded(Token2WavStream):
    """Records every started window's kept frames [s, e)."""
    kept: list[tuple[int, int]] = []

    def start_window(self) -> Window:
        w = super().start_window()
        Recorded.kept.append((w.keep_from, w.keep_to))
        return w


def test_chunks_grow_to_chunk_blocks(omni25_path: Path, codes: torch.Tensor,
                                     reference: torch.Tensor,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """chunk_blocks 16 after a first chunk of 6: chunks of 6, 12, then the rest (16 at
    most), each window with its context; the audio within the seam bound of the whole
    decode, as the default's."""
    assert Chunking(8, 2).sizes() == (2, 4, 8) and Chunking().sizes() == (2, 4)
    assert Chunking(4, 6).sizes() == (6, 4) and Chunking(3, 1).sizes() == (1, 2, 3)
    growing = Token2WavGenerator.from_pretrained(omni25_path, "", CPU, None, Token2WavOptions(
        first_chunk_blocks=6, chunk_blocks=16))
    monkeypatch.setattr(token2wav_module, "Token2WavStream", Recorded)
    Recorded.kept = []
    (pieces,) = run(growing, [(codes, 1)], per_call=2)
    block = growing.model.cfg.dit.block_size
    assert [(e - s) // block for s, e in Recorded.kept] == [6, 12, 14], Recorded.kept
    audio = torch.cat(pieces)
    assert audio.shape == reference.shape
    max_err, snr = seam_error(audio, reference)
    assert max_err <= SEAM_TOLERANCE and snr >= SEAM_MIN_SNR_DB, (max_err, snr)


class ShiftedNoise(Token2WavStream):
    """A bug: the window's noise taken one frame late."""

    def _noise_until(self, end: int) -> torch.Tensor:
        return super()._noise_until(end + 1)[1:]


class UnalignedWindow(Token2WavStream):
    """A bug: a window starting one code after its block boundary (the blocks shift)."""

    def start_window(self) -> Window:
        w = super().start_window()
        if w.start == 0:
            return w
        moved = Window(w.x[self.repeats:], w.codes[1:], w.start + self.repeats, w.keep_from,
                       w.keep_to)
        self.windows = (*self.windows[:-1], moved)
        return moved


@pytest.mark.parametrize("bug", [ShiftedNoise, UnalignedWindow])
def test_a_misaligned_window_fails_the_bound(streamed: Token2WavGenerator, codes: torch.Tensor,
                                             reference: torch.Tensor,
                                             monkeypatch: pytest.MonkeyPatch, bug: type) -> None:
    monkeypatch.setattr(token2wav_module, "Token2WavStream", bug)
    (pieces,) = run(streamed, [(codes, 1)], per_call=16)
    max_err, snr = seam_error(torch.cat(pieces), reference)
    assert max_err > 10 * SEAM_TOLERANCE and snr < SEAM_MIN_SNR_DB - 20, (max_err, snr)


def test_streams_together_equal_each_alone(streamed: Token2WavGenerator) -> None:
    """Three requests (two speakers, different lengths, one joining later) in the same calls:
    their windows share DiT and vocoder forwards, padded; each equals itself alone."""
    requests = [(codes_of(30, 2), 0), (codes_of(17, 3), 1), (codes_of(23, 4), 1)]
    together = run(streamed, requests, per_call=5, delays=[0, 0, 2])
    for (codes, speaker), pieces in zip(requests, together):
        (alone,) = run(streamed, [(codes, speaker)], per_call=5)
        a, b = torch.cat(pieces), torch.cat(alone)
        assert a.shape == b.shape and b.abs().max() > 0.1
        assert (a - b).abs().max() <= 1e-5


def test_new_requests_first_chunks_go_first(streamed: Token2WavGenerator) -> None:
    """With room for one more window, a new request's first chunk is started before an
    older request's next one."""
    model, chunking = streamed.model, Chunking()
    old, new = (Token2WavStream(model, chunking, 0, 0, CPU) for _ in range(2))
    old.append(codes_of(40, 5))
    old.start_window()
    old.windows = ()                   # its first window done; the next chunk is ready
    new.append(codes_of(10, 6))
    assert old.next_chunk() is not None and new.next_chunk() is not None
    admit_windows([old, new], max_batch_frames=1)
    assert len(new.windows) == 1 and not old.windows


@pytest.mark.parametrize("options", [{"left_blocks": -1}, {"first_chunk_blocks": 0},
                                     {"chunk_blocks": -2}, {"max_batch_frames": 0}])
def test_bad_chunking_is_refused(whole: Token2WavGenerator, options: dict) -> None:
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        Token2WavGenerator(whole.model, [], Token2WavOptions(**options))


def test_bfloat16_dit_comes_within_its_measured_error(omni25_path: Path, codes: torch.Tensor,
                                                      reference: torch.Tensor) -> None:
    """`dit_dtype: bfloat16` runs the DiT's transformer in bfloat16 (the ODE state and the
    vocoder in float32): the whole decode moves (it is not the float32 path) but stays close
    to it (SNR measured on the tiny checkpoint; bench omni25 measures the real sizes); the
    float32 model loaded beside it is untouched."""
    bf16 = Token2WavGenerator.from_pretrained(omni25_path, "", CPU, None, Token2WavOptions(
        chunk_blocks=0, dit_dtype="bfloat16"))
    assert bf16.model.dit.transformer_blocks[0].attn.to_qkv.weight.dtype == torch.bfloat16
    assert bf16.model.dit.input_embed.spk_encoder.fc.weight.dtype == torch.float32
    (pieces,) = run(bf16, [(codes, 1)], per_call=codes.numel())
    audio = torch.cat(pieces)
    assert audio.dtype == torch.float32 and audio.shape == reference.shape
    err, snr = seam_error(audio, reference)
    assert 0 < err and snr > BF16_MIN_SNR_DB, (err, snr)


BF16_MIN_SNR_DB = 35.0      # measured 50.2 dB here
