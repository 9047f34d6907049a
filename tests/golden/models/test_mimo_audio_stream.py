"""MiMo-Audio's decoder streamed (generation/mimo_audio_stream.py, generation/mimo_audio.py)
against its whole decode (golden against upstream's decode in test_mimo_audio_tokenizer.py):
exact when the windows' context covers the utterance; otherwise the seam error (GroupNorm's
statistics over the window, not the utterance) measured as an SNR above a stated floor, at an
audible magnitude. On the generation engine: audio leaves before the input closes, odd chunk
sizes, and several requests at once at different points, each equal to its own stream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.generation.engine import GenerationEngine
from omnistage.generation.mimo_audio import MiMoAudioDecoderOptions, MiMoAudioGenerator
from omnistage.generation.mimo_audio_stream import Chunking, stream_decode
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder
from omnistage.payloads import AudioChunk, CodecFrames

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"
EMPTY0 = 32          # the tiny tokenizer's channel-0 codebook size: channel 0's empty id


@pytest.fixture(scope="module")
def decoder() -> MiMoAudioTokenizerDecoder:
    return MiMoAudioTokenizerDecoder.from_pretrained(FIXTURES / "tokenizer")


def _codes(decoder: MiMoAudioTokenizerDecoder, n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, b.shape[0], (n,), generator=g)
                        for b in decoder.codebooks])                      # (channels, n)


def _snr_db(got: Tensor, want: Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum()))


@pytest.mark.parametrize("n", [1, 4, 7, 37, 61])
def test_streamed_with_context_over_the_utterance_equals_whole(decoder, n: int) -> None:
    codes = _codes(decoder, n, n)
    whole = decoder(codes)
    chunks = stream_decode(decoder, codes, Chunking(8, 3, n, n))
    assert len(chunks) == (1 if n <= 3 else 2 + (n - 4) // 8)
    assert [c.numel() for c in chunks[:2]] == [min(n, 3) * 16, *([min(8, n - 3) * 16]
                                                                 if n > 3 else [])]
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=1e-6)


def test_seam_error_is_measured_and_context_reduces_it(decoder) -> None:
    """Floors below the measured values (module docstring of mimo_audio_stream.py), on two
    random utterances of 120 frames, with the right context the decoder's reach (2 frames)."""
    assert decoder.right_reach_frames == 2 and decoder.frame_samples == 16
    for seed in range(2):
        codes = _codes(decoder, 120, seed)
        whole = decoder(codes)
        assert float(whole.pow(2).mean().sqrt()) > 0.1        # audible, not a tiny signal
        snr = {name: _snr_db(torch.cat(stream_decode(decoder, codes, chunking)), whole)
               for name, chunking in (("default", Chunking(25, 5, 250, 2)),
                                      ("short", Chunking(8, 5, 25, 2)),
                                      ("none", Chunking(8, 5, 0, 0)))}
        assert snr["default"] > 27.0 and snr["short"] > 23.0, (seed, snr)
        assert snr["none"] < 15.0 < snr["short"], (seed, snr)


def _generator(**options: object) -> MiMoAudioGenerator:
    return MiMoAudioGenerator.from_pretrained(
        None, "mimo_audio_decoder", torch.device("cpu"), None,
        MiMoAudioDecoderOptions(tokenizer=str(FIXTURES / "tokenizer"), empty_id=EMPTY0,
                                **options))


def _frames(codes: Tensor) -> dict[str, Tensor]:
    return CodecFrames(codes.T.contiguous()).pack()                    # (frames, channels)


def test_engine_streams_several_requests_at_different_points(decoder) -> None:
    """Three requests fed in odd pieces (one with silent frames the decoder drops), joining at
    different steps: audio leaves before each input closes, and each request's chunks are its
    own stream's (equal, chunk for chunk, to stream_decode of its spoken frames)."""
    gen = _generator(chunk_frames=6, first_chunk_frames=3, left_frames=10)
    assert gen.chunking == Chunking(6, 3, 10, 2)
    engine = GenerationEngine(gen)
    lengths = {"a": 29, "b": 13, "c": 40}
    codes = {rid: _codes(decoder, n, i) for i, (rid, n) in enumerate(lengths.items())}
    silent = torch.tensor([EMPTY0, *[0] * 7])[:, None].expand(-1, 2)
    fed = {rid: 0 for rid in lengths}
    joins = {"a": 0, "b": 2, "c": 4}
    got: dict[str, list[tuple[bool, Tensor]]] = {rid: [] for rid in lengths}
    for step in range(200):
        for rid, n in lengths.items():
            if step == joins[rid]:
                engine.add_request(rid)
            if step >= joins[rid] and fed[rid] < n:
                k = min(n - fed[rid], 5 if rid != "b" else 2)
                piece = codes[rid][:, fed[rid]:fed[rid] + k]
                if rid == "a" and fed[rid] == 10:
                    piece = torch.cat([silent, piece], dim=1)
                fed[rid] += k
                engine.feed(rid, _frames(piece), fed[rid] == n)
        for out in engine.step():
            assert out.error is None, out.error
            if out.tensors:
                closed = out.request is not None and out.request.input_closed
                got[out.request_id].append((closed, AudioChunk.unpack(out.tensors).samples))
        if not engine.has_unfinished_requests:
            break
    assert not engine.has_unfinished_requests
    for rid in lengths:
        want = stream_decode(decoder, codes[rid], gen.chunking)
        assert len(got[rid]) == len(want) >= 3, rid
        for (_, chunk), w in zip(got[rid], want):
            torch.testing.assert_close(chunk, w, rtol=0, atol=1e-6)
        assert not got[rid][0][0], f"{rid}: its first audio only after its input closed"


def test_no_spoken_frames_is_a_second_of_silence_and_options_are_checked() -> None:
    gen = _generator()
    state: dict = {}
    silent = torch.tensor([EMPTY0, *[0] * 7])[:, None].expand(-1, 4)
    assert gen.generate([_frames(silent)], [state], [False]) == [{}]
    out = gen.generate([{}], [state], [True])[0]
    wave = AudioChunk.unpack(out).samples
    assert wave.shape == (gen.model.sample_rate,) and not bool(wave.any())
    assert not gen.has_backlog(state)
    for bad in ({"chunk_frames": -1}, {"first_chunk_frames": 0}, {"left_frames": -2},
                {"right_frames": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MiMoAudioDecoderOptions(**bad)
