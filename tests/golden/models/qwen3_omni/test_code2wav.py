"""Our Qwen3-Omni code2wav against transformers' `Qwen3OmniMoeCode2Wav` on the tiny random
checkpoint (the real 1920x upsampling, waveform peaking near 0.5) in float32: whole decode,
HF's chunked decode, and the streaming decoder (frames pushed one, ten or odd numbers at a
time, several first-chunk and chunk sizes, several requests batched, a frame budget per
forward) equal to the whole decode that generate(return_audio=True) returns; a mutation that
drops the held-back samples fails; strict loading from single and sharded checkpoints; clear
errors on bad codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_stream import (Code2WavStream, VocoderShapes,
                                                         decode_streams, push_streams)
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

ATOL = 1e-4   # max abs difference on samples in [-1, 1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"), with_processor=False)


@pytest.fixture(scope="module")
def ref(ckpt: Path) -> torch.nn.Module:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    return full.code2wav.eval()


@pytest.fixture(scope="module")
def ours(ckpt: Path) -> Code2Wav:
    return Code2Wav.from_pretrained(ckpt)


def random_codes(model: Code2Wav, *shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.codebook_size, shape, generator=g)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= ATOL, (a - b).abs().max().item()


@pytest.mark.parametrize("num_frames", [1, 7, 40])
@torch.no_grad()
def test_decode_matches_hf(ref: torch.nn.Module, ours: Code2Wav, num_frames: int) -> None:
    q = ours.cfg.num_quantizers
    codes = random_codes(ours, 2, q, num_frames, seed=num_frames)          # (B, Q, T)
    # compare the last conv's output before the clamp to [-1, 1] too
    unclamped: dict[str, torch.Tensor] = {}
    hooks = [m.decoder[-1].register_forward_hook(
        lambda _m, _i, out, key=key: unclamped.__setitem__(key, out))
        for key, m in (("ours", ours), ("ref", ref))]
    try:
        wav, expected = ours.decode(codes), ref(codes)
    finally:
        for hook in hooks:
            hook.remove()
    assert ours.total_upsample == int(ref.total_upsample) == 1920
    assert wav.shape == (2, 1, num_frames * ours.total_upsample - ours.num_lost)
    assert wav.shape[-1] == ours.cfg.num_samples(num_frames)
    assert_close(wav, expected)
    scale = max(1.0, unclamped["ref"].abs().max().item())
    assert (unclamped["ours"] - unclamped["ref"]).abs().max().item() <= ATOL * scale
    assert 0.1 < wav.abs().max() < 0.99   # audible, and not clamped flat


@pytest.mark.parametrize("chunk_size,left_context", [(300, 25), (10, 4), (7, 0), (16, 20)])
@torch.no_grad()
def test_chunked_decode_matches_hf(ref: torch.nn.Module, ours: Code2Wav, chunk_size: int,
                                   left_context: int) -> None:
    codes = random_codes(ours, 2, ours.cfg.num_quantizers, 53, seed=chunk_size)
    wav = ours.chunked_decode(codes, chunk_size, left_context)
    assert_close(wav, ref.chunked_decode(codes, chunk_size, left_context))
    if chunk_size < 53:   # windows really were cut: not the whole decode
        assert wav.shape != ours.decode(codes).shape


def stream_decode(model: Code2Wav, codes: torch.Tensor, pieces: list[int], chunk: int,
                  ctx: int, first: int | None = None) -> torch.Tensor:
    """Push `codes` (Q, T) into a stream in `pieces`, then flush: the whole streamed output."""
    stream = Code2WavStream(model, chunk_frames=chunk, left_context=ctx, first_chunk_frames=first)
    outs, start = [], 0
    for n in pieces:
        out = stream.push(codes[:, start:start + n])
        assert out.dtype == torch.float32 and out.ndim == 1
        assert not stream.has_ready_chunk   # audio leaves as soon as a chunk is complete
        outs.append(out)
        start += n
    assert start == codes.shape[1]
    outs.append(stream.flush())
    assert stream.num_decoded_frames == codes.shape[1]
    assert stream.num_samples_out == sum(o.numel() for o in outs)
    return torch.cat(outs)


def pieces_of(num_frames: int, size: int) -> list[int]:
    return [size] * (num_frames // size) + ([num_frames % size] if num_frames % size else [])


def test_tiny_code2wav_is_audible_and_seams_would_show(ref: torch.nn.Module, ours: Code2Wav
                                                       ) -> None:
    """The golden tests below compare something of meaningful size: the real upsampling
    (1920 samples a frame, 555 of them lost at a window's end) and a waveform peaking near
    0.5, neither faint nor clamped flat."""
    assert ours.total_upsample == 1920 and ours.num_lost == 555
    wav = ref(random_codes(ours, 1, ours.cfg.num_quantizers, 29, seed=1))
    assert wav.shape[-1] == 55125
    assert 0.1 <= wav.abs().max().item() <= 0.99 and wav.abs().mean().item() > 0.01


@pytest.mark.parametrize("first,chunk,piece", [(1, 5, 1), (7, 25, 10), (12, 25, 1),
                                               (12, 5, 10), (1, 25, 10), (7, 5, 1),
                                               (12, 25, 0)])
@torch.no_grad()
def test_stream_equals_whole_decode(ref: torch.nn.Module, ours: Code2Wav, first: int,
                                    chunk: int, piece: int) -> None:
    """Several chunkings, frames one at a time, ten at a time or in odd pieces (piece 0),
    with a context covering the receptive field: the stream is transformers' whole decode
    (what generate(return_audio=True) returns), sample for sample."""
    q, num_frames = ours.cfg.num_quantizers, 61
    ctx = ours.cfg.receptive_field_frames
    codes = random_codes(ours, q, num_frames, seed=first * 100 + chunk)
    pieces = pieces_of(num_frames, piece) if piece else [1, 3, 17, 5, 2, 9, 20, 4]
    wav = stream_decode(ours, codes, pieces, chunk, ctx, first)
    assert_close(wav, ref(codes[None])[0, 0])


@torch.no_grad()
def test_stream_with_the_shipped_context(ref: torch.nn.Module, ours: Code2Wav) -> None:
    """The default graph's chunking (first 12, then 25, context 25) covers the tiny model's
    receptive field: exact here too."""
    assert ours.cfg.receptive_field_frames <= 25
    codes = random_codes(ours, ours.cfg.num_quantizers, 70, seed=7)
    wav = stream_decode(ours, codes, pieces_of(70, 3), chunk=25, ctx=25, first=12)
    assert_close(wav, ref(codes[None])[0, 0])


@pytest.mark.parametrize("ctx", [1, 8])
@torch.no_grad()
def test_short_context_keeps_every_sample(ref: torch.nn.Module, ours: Code2Wav, ctx: int
                                          ) -> None:
    """A context shorter than the receptive field changes samples after the first chunk (the
    windows see a truncated history) but drops or repeats none: the length is the whole
    decode's, the first chunk is exact, and no seam steps further than the whole decode's own
    largest step from one sample to the next (no click)."""
    codes = random_codes(ours, ours.cfg.num_quantizers, 40, seed=ctx)
    wav = stream_decode(ours, codes, pieces_of(40, 10), chunk=10, ctx=ctx, first=10)
    whole = ref(codes[None])[0, 0]
    assert wav.shape == whole.shape
    first = ours.cfg.num_samples(10)
    assert_close(wav[:first], whole[:first])
    assert (wav - whole).abs().max().item() > 1e-3   # the context matters: not vacuous
    seams = [k * 10 * ours.total_upsample - ours.num_lost for k in (1, 2, 3)]
    largest_step = whole.diff().abs().max().item()
    for b in seams:
        assert abs(wav[b] - wav[b - 1]).item() <= largest_step, (b, largest_step)


@torch.no_grad()
def test_dropping_the_held_back_samples_fails(ref: torch.nn.Module, ours: Code2Wav,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: with the old behaviour (a window's last num_lost samples never recomputed:
    num_lost taken as 0 when the next window is cut) the golden comparison fails."""
    codes = random_codes(ours, ours.cfg.num_quantizers, 40, seed=3)
    whole = ref(codes[None])[0, 0]
    ctx = ours.cfg.receptive_field_frames
    monkeypatch.setattr(Code2Wav, "num_lost", property(lambda self: 0))
    wav = stream_decode(ours, codes, pieces_of(40, 10), chunk=10, ctx=ctx, first=12)
    assert wav.shape[0] == whole.shape[0] - 3 * 555   # three seams, each 555 samples short
    with pytest.raises(AssertionError):
        assert_close(wav, whole)
    # aligned to the same length, the error after the first seam is audible
    assert (wav - whole[:wav.shape[0]]).abs().max().item() > 0.1


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Code2Wav]:
    """Code2wav with the real model's attention reach (8 layers of window 72: 568 frames),
    tiny in width: (transformers' module, ours)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("deep"), with_processor=False,
                                 code2wav_overrides={"num_hidden_layers": 8,
                                                     "sliding_window": 72})
    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return full.code2wav.eval(), Code2Wav.from_pretrained(path)


def test_receptive_field_of_the_real_model() -> None:
    from omnistage.models.qwen3_omni.code2wav import Code2WavConfig

    cfg = Code2WavConfig()      # the real model's sizes
    assert (cfg.total_upsample, cfg.num_samples(1)) == (1920, 1365)
    assert cfg.receptive_field_frames == 12


@torch.no_grad()
def test_stream_exact_beyond_the_context(deep: tuple[torch.nn.Module, Code2Wav]) -> None:
    """Stacked attention windows reach 568 frames back, far past the vocoder's 12-frame
    context: the kept keys and values make 150 streamed frames (first chunk 12, then 25, in
    odd pieces) equal transformers' whole decode."""
    ref, ours = deep
    codes = random_codes(ours, ours.cfg.num_quantizers, 150, seed=11)
    wav = stream_decode(ours, codes, [1, 7, 30, 2, 60, 11, 39], chunk=25, ctx=12, first=12)
    assert_close(wav, ref(codes[None])[0, 0])


@torch.no_grad()
def test_dropping_the_kept_keys_and_values_fails(deep: tuple[torch.nn.Module, Code2Wav],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: a stream that keeps no keys and values (each chunk's transformer sees only
    the chunk) is audibly off the whole decode."""
    from omnistage.models.qwen3_omni.code2wav import Code2WavTransformer

    ref, ours = deep
    codes = random_codes(ours, ours.cfg.num_quantizers, 80, seed=12)
    monkeypatch.setattr(Code2WavTransformer, "num_cached", property(lambda self: 0))
    wav = stream_decode(ours, codes, pieces_of(80, 10), chunk=25, ctx=12, first=12)
    assert (wav - ref(codes[None])[0, 0]).abs().max().item() > 0.05


@torch.no_grad()
def test_padded_streams_equal_exact_ones(ours: Code2Wav) -> None:
    """Ten streams continued in one transformer call padded to twelve (two streams of no
    frames) and to 6 frames: every stream's audio as unpadded, and its kept keys and values
    too (its second chunk equal)."""
    q, ctx = ours.cfg.num_quantizers, ours.cfg.receptive_field_frames
    shapes = VocoderShapes((6, ctx + 5), 400, (6,))
    assert shapes.pad_new(10, 4) == (12, 6)
    codes = [random_codes(ours, q, 9, seed=40 + i) for i in range(10)]
    outs = []
    for use in (None, shapes):
        streams = [Code2WavStream(ours, 5, ctx, 4) for _ in codes]
        first = push_streams([(s, c[:, :4]) for s, c in zip(streams, codes)], use)
        second = push_streams([(s, c[:, 4:]) for s, c in zip(streams, codes)], use)
        outs.append([torch.cat(pair) for pair in zip(first, second)])
    for exact, padded in zip(*outs):
        assert exact.abs().max() > 1e-2
        torch.testing.assert_close(padded, exact, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shapes", [None, VocoderShapes((9, 20, 40), 200, (4, 12, 25))],
                         ids=["exact", "padded"])
@torch.no_grad()
def test_streams_batched_in_one_forward(ref: torch.nn.Module, ours: Code2Wav,
                                        monkeypatch: pytest.MonkeyPatch,
                                        shapes: VocoderShapes | None) -> None:
    """Requests at different points (first chunk without context, later ones with it, two
    chunks at once, a short final chunk) decode together and equal each one's whole decode;
    also with every forward padded to one of a few shapes (as on a GPU), final windows too."""
    q, ctx = ours.cfg.num_quantizers, ours.cfg.receptive_field_frames
    setups = [(10, 4, [3, 12, 9, 1, 20]), (6, None, [14, 2, 7]), (25, 12, [30, 26, 5])]
    codes = [random_codes(ours, q, sum(p), seed=10 + i) for i, (_, _, p) in enumerate(setups)]
    streams = [Code2WavStream(ours, chunk, ctx, first) for chunk, first, _ in setups]
    outs: list[list[torch.Tensor]] = [[] for _ in setups]

    forwards: list[tuple[int, int]] = []
    vocode = ours.vocode

    def counted(batch: torch.Tensor) -> torch.Tensor:
        forwards.append(tuple(batch.shape[:2]))
        return vocode(batch)

    continued: list[tuple[int, int]] = []
    continue_rows = ours.continue_rows

    def counted_rows(codes: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        continued.append((codes.shape[0], codes.shape[2] - ours.embed_context))
        return continue_rows(codes, *args)

    monkeypatch.setattr(ours, "vocode", counted)
    monkeypatch.setattr(ours, "continue_rows", counted_rows)
    starts, num_calls_with_audio = [0] * len(setups), 0
    for step in range(max(len(p) for _, _, p in setups)):
        items = []
        for i, (_, _, pieces) in enumerate(setups):
            if step < len(pieces):
                items.append((streams[i], codes[i][:, starts[i]:starts[i] + pieces[step]]))
                starts[i] += pieces[step]
        new = push_streams(items, shapes)
        num_calls_with_audio += any(out.numel() for out in new)
        for (stream, _), out in zip(items, new):
            outs[streams.index(stream)].append(out)
    for s in streams:
        s.finish()
    new = decode_streams(streams, shapes=shapes)
    num_calls_with_audio += any(out.numel() for out in new)
    for i, out in enumerate(new):
        outs[i].append(out)
    monkeypatch.undo()

    # windows of several requests (and lengths) in one forward
    assert max(num for num, _ in forwards) >= 3
    assert len(forwards) == num_calls_with_audio   # one forward per call, whatever was ready
    if shapes is not None:
        assert set(forwards) <= set(shapes.all()), (forwards, shapes.all())
        # transformer calls padded too (streams and frames), a backlog of two chunks exact
        assert set(continued) - set(shapes.all_new()) <= {(b, 2 * 25) for b in range(9)}, \
            continued
        assert (2, 12) in continued              # a 6- and a 4-frame first chunk, padded
    for c, out in zip(codes, outs):
        assert_close(torch.cat(out), ref(c[None])[0, 0])


@torch.no_grad()
def test_frame_budget_puts_first_chunks_first(ref: torch.nn.Module, ours: Code2Wav,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget per forward, a new request's first chunk goes ahead of the backlog of
    older ones; the rest waits for later calls, and every stream still equals its whole
    decode."""
    q, ctx = ours.cfg.num_quantizers, ours.cfg.receptive_field_frames
    old = [Code2WavStream(ours, 10, ctx, 4) for _ in range(3)]
    old_codes = [random_codes(ours, q, 40, seed=20 + i) for i in range(3)]
    outs: dict[int, list[torch.Tensor]] = {id(s): [] for s in old}
    for s, c in zip(old, old_codes):
        outs[id(s)].append(s.push(c[:, :4]))         # first chunks out
        s.append(c[:, 4:])                           # then a backlog of 36 frames each
    new = Code2WavStream(ours, 10, ctx, 4)
    new_codes = random_codes(ours, q, 9, seed=30)
    new.append(new_codes[:, :5])
    outs[id(new)] = []
    streams = [*old, new]
    first = decode_streams(streams, max_batch_frames=30)   # room for one 4-frame + ...
    assert first[-1].numel() == ours.cfg.num_samples(4)  # the new request's first chunk
    for s, o in zip(streams, first):
        outs[id(s)].append(o)
    budget_calls = 1
    while any(s.has_ready_chunk for s in streams):
        for s, o in zip(streams, decode_streams(streams, max_batch_frames=70)):
            outs[id(s)].append(o)
        budget_calls += 1
    assert budget_calls > 3                          # the backlog was spread over calls
    new.append(new_codes[:, 5:])
    for s in streams:
        s.finish()
    for s, o in zip(streams, decode_streams(streams)):
        outs[id(s)].append(o)
    for s, c in zip(streams, [*old_codes, new_codes]):
        assert_close(torch.cat(outs[id(s)]), ref(c[None])[0, 0])


def _rewrite_checkpoint(src: Path, dst: Path, edit: dict[str, torch.Tensor | None],
                        num_shards: int = 1) -> Path:
    """Copy config.json and the weights into `dst` with `edit` applied (None: drop the tensor),
    in one file or `num_shards` shards with an index."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    weights = load_file(src / "model.safetensors")
    for name, tensor in edit.items():
        if tensor is None:
            del weights[name]
        else:
            weights[name] = tensor
    if num_shards == 1:
        save_file(weights, dst / "model.safetensors")
        return dst
    names = sorted(weights)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]
        save_file({n: weights[n] for n in part}, dst / file)
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@torch.no_grad()
def test_loads_sharded_checkpoint(ckpt: Path, ours: Code2Wav, tmp_path: Path) -> None:
    sharded = Code2Wav.from_pretrained(_rewrite_checkpoint(ckpt, tmp_path / "s", {}, 3))
    codes = random_codes(ours, 1, ours.cfg.num_quantizers, 9)
    assert torch.equal(sharded.decode(codes), ours.decode(codes))
    half = Code2Wav.from_pretrained(ckpt, dtype=torch.bfloat16)
    assert half.code_embedding.weight.dtype == torch.bfloat16
    assert half.pre_transformer.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_strict_loading_errors(ckpt: Path, tmp_path: Path) -> None:
    name = "code2wav.decoder.1.block.2.conv1.conv.weight"
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        Code2Wav.from_pretrained(_rewrite_checkpoint(ckpt, tmp_path / "a", {name: None}))
    q_proj = "code2wav.pre_transformer.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"missing tensors: .*q_proj"):
        Code2Wav.from_pretrained(_rewrite_checkpoint(ckpt, tmp_path / "b", {q_proj: None}))
    extra = "code2wav.decoder.9.conv.weight"
    with pytest.raises(ValueError, match=rf"unexpected tensors .*{extra}"):
        Code2Wav.from_pretrained(
            _rewrite_checkpoint(ckpt, tmp_path / "c", {extra: torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"code2wav.*decoder.0.conv.weight.*shape"):
        Code2Wav.from_pretrained(_rewrite_checkpoint(
            ckpt, tmp_path / "d", {"code2wav.decoder.0.conv.weight": torch.zeros(32, 32, 5)}))
    no_audio = {n: None for n in load_file(ckpt / "model.safetensors") if n.startswith("code2wav.")}
    with pytest.raises(ValueError, match=r"no code2wav\.\* tensors"):
        Code2Wav.from_pretrained(_rewrite_checkpoint(ckpt, tmp_path / "e", no_audio))


def test_bad_codes_raise(ours: Code2Wav) -> None:
    q, size = ours.cfg.num_quantizers, ours.cfg.codebook_size
    codes = random_codes(ours, 1, q, 5)
    codes[0, 2, 3] = size
    with pytest.raises(ValueError, match=rf"\[0, codebook_size={size}\).*{size}\]"):
        ours.decode(codes)
    with pytest.raises(ValueError, match="codebook_size"):
        ours.chunked_decode(-codes - 1, 2, 1)
    with pytest.raises(ValueError, match=f"num_quantizers={q}"):
        ours.decode(random_codes(ours, 1, q + 1, 5))
    with pytest.raises(ValueError, match="integer"):
        ours.decode(torch.zeros(1, q, 5))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ours.decode(torch.zeros(1, q, ours.cfg.max_position_embeddings + 1, dtype=torch.long))
    stream = Code2WavStream(ours, 4, 2)
    with pytest.raises(ValueError, match="codebook_size"):
        stream.push(codes[0])
    assert stream.num_frames == 0   # a rejected push leaves the stream as it was
    other = Code2WavStream(ours, 4, 2)
    with pytest.raises(ValueError, match="codebook_size"):
        push_streams([(other, codes[0, :, :2].clamp(max=size - 1)), (stream, codes[0])])
    assert other.num_frames == 0    # nor does one bad request in a batch touch the others
    with pytest.raises(ValueError, match="chunk_size 0"):
        Code2WavStream(ours, 0, 2)
    with pytest.raises(ValueError, match="left_context 0: streaming needs at least 1"):
        Code2WavStream(ours, 4, 0)
    stream.flush()
    with pytest.raises(ValueError, match="already finished"):
        stream.push(codes[0, :, :1].clamp(max=size - 1))


@torch.no_grad()
def test_padded_windows_equal_exact_ones(ours: Code2Wav) -> None:
    """Windows padded to a larger (windows, frames) shape: the kept samples of every window,
    a final one (to num_samples(n)) and one skipping its first samples, are the unpadded
    ones; a window of frames that padding did reach would differ (the check can fail)."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, ours.cfg.hidden_size, generator=g) for n in (5, 13, 9)]
    windows = [(rows[0], 0), (rows[1], 700), (rows[2], 0)]
    exact = ours.vocode_windows(windows)
    padded = ours.vocode_windows(windows, (6, 21))
    for a, b in zip(exact, padded):
        assert a.abs().max() > 0.1 and a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-5
    # the mutation: keep samples past num_samples(n) of a padded window: they saw padding
    n = rows[0].shape[0]
    longer = ours.vocode_windows([(rows[0], 0), (torch.cat([rows[0], rows[1][:3]]), 0)])
    assert (longer[1][:ours.cfg.num_samples(n)] - exact[0]).abs().max().item() <= 1e-5
    tail = longer[1][ours.cfg.num_samples(n):ours.cfg.num_samples(n) + ours.num_lost]
    assert tail.abs().max() > 0.01


def test_vocoder_shapes() -> None:
    """The shipped chunking (first 12, then 25 after 12 of context, 400 frames a forward):
    two lengths, windows 1 to 8 then every 4 up to the budget; every forward lands on one."""
    shapes = VocoderShapes.for_stream(12, 25, 12, 400)
    assert shapes.lengths == (12, 37)
    assert shapes.batch_sizes(37) == [*range(1, 9), 10]
    assert shapes.batch_sizes(12) == [*range(1, 9), 12, 16, 20, 24, 28, 32, 33]
    assert shapes.pad(1, 5) == (1, 12) and shapes.pad(3, 13) == (3, 37)
    assert shapes.pad(9, 30) == (10, 37) and shapes.pad(13, 12) == (16, 12)
    assert shapes.pad(2, 60) == (2, 60)      # longer than any window of the stream: as is
    assert len(shapes.all()) == 9 + 15
