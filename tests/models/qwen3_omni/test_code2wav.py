"""Our Qwen3-Omni code2wav against transformers' `Qwen3OmniMoeCode2Wav` on the tiny random
checkpoint in float32: whole decode, chunked decode, and the streaming decoder (frames pushed
in irregular pieces, several requests batched) equal to the chunked decode; strict loading
from single and sharded checkpoints; clear errors on bad codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.qwen3_omni.code2wav import (Code2Wav, Code2WavStream, decode_streams,
                                                  push_streams)
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
    # The random tiny decoder saturates most samples at the final clamp to [-1, 1]: compare
    # the last conv's output before the clamp too.
    unclamped: dict[str, torch.Tensor] = {}
    hooks = [m.decoder[-1].register_forward_hook(
        lambda _m, _i, out, key=key: unclamped.__setitem__(key, out))
        for key, m in (("ours", ours), ("ref", ref))]
    try:
        wav, expected = ours.decode(codes), ref(codes)
    finally:
        for hook in hooks:
            hook.remove()
    assert ours.total_upsample == int(ref.total_upsample) == 8
    assert wav.shape == (2, 1, num_frames * ours.total_upsample - ours.num_lost)
    assert wav.shape[-1] == ours.cfg.num_samples(num_frames)
    assert_close(wav, expected)
    scale = max(1.0, unclamped["ref"].abs().max().item())
    assert (unclamped["ours"] - unclamped["ref"]).abs().max().item() <= ATOL * scale
    assert (wav.abs() < 0.99).any()   # some samples not saturated, and not silent either
    assert wav.abs().max() > 1e-3


@pytest.mark.parametrize("chunk_size,left_context", [(300, 25), (10, 4), (7, 0), (16, 20)])
@torch.no_grad()
def test_chunked_decode_matches_hf(ref: torch.nn.Module, ours: Code2Wav, chunk_size: int,
                                   left_context: int) -> None:
    codes = random_codes(ours, 2, ours.cfg.num_quantizers, 53, seed=chunk_size)
    wav = ours.chunked_decode(codes, chunk_size, left_context)
    assert_close(wav, ref.chunked_decode(codes, chunk_size, left_context))
    if chunk_size < 53:   # windows really were cut: not the whole decode
        assert wav.shape != ours.decode(codes).shape


@torch.no_grad()
def test_stream_equals_chunked_decode(ref: torch.nn.Module, ours: Code2Wav) -> None:
    q, chunk, ctx = ours.cfg.num_quantizers, 25, 25
    pieces = [1, 3, 17, 5, 2, 9, 30, 1, 40, 4]                              # 112 frames
    codes = random_codes(ours, q, sum(pieces), seed=3)                      # (Q, T)
    stream = Code2WavStream(ours, chunk_frames=chunk, left_context=ctx)
    outs, start = [], 0
    for n in pieces:
        out = stream.push(codes[:, start:start + n])
        start += n
        assert out.dtype == torch.float32 and out.ndim == 1
        # audio comes out as soon as a chunk is complete, and only then
        decoded = start // chunk * chunk
        assert stream.num_decoded_frames == decoded and not stream.has_ready_chunk
        outs.append(out)
    assert sum(o.numel() for o in outs[:3]) == 0   # 21 frames: no chunk yet
    assert outs[3].numel() > 0                      # 26 frames: first chunk out
    outs.append(stream.flush())
    assert outs[-1].numel() > 0 and stream.num_decoded_frames == sum(pieces)
    wav = torch.cat(outs)
    expected = ref.chunked_decode(codes[None], chunk_size=chunk, left_context_size=ctx)[0, 0]
    assert_close(wav, expected)
    assert_close(wav, ours.chunked_decode(codes[None], chunk, ctx)[0, 0])


@torch.no_grad()
def test_short_first_chunk(ours: Code2Wav) -> None:
    """first_chunk_frames: the first audio leaves after that many frames; then chunk_frames
    chunks, each with its left context: the same as decoding those windows one by one."""
    q, first, chunk, ctx = ours.cfg.num_quantizers, 4, 10, 6
    codes = random_codes(ours, q, 27, seed=5)
    stream = Code2WavStream(ours, chunk_frames=chunk, left_context=ctx, first_chunk_frames=first)
    assert stream.push(codes[:, :3]).numel() == 0
    early = stream.push(codes[:, 3:5])                          # 5 frames: the first 4 decode
    assert early.numel() > 0 and stream.num_decoded_frames == first
    rest = [stream.push(codes[:, 5:27]), stream.flush()]        # then 10-frame chunks
    bounds = [(0, 4), (4, 14), (14, 24), (24, 27)]
    expected = [ours.decode_windows([(codes[:, max(0, a - ctx):b], min(ctx, a))])[0]
                for a, b in bounds]
    assert_close(torch.cat([early, *rest]), torch.cat(expected))


@torch.no_grad()
def test_streams_batched_in_one_forward(ours: Code2Wav, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """Requests at different points (first chunk without context, later ones with it, two
    chunks at once, a short final chunk) decode together and equal each one's own chunked
    decode."""
    q = ours.cfg.num_quantizers
    setups = [(10, 4, [3, 12, 9, 1, 20]), (6, 6, [14, 2, 7]), (25, 25, [30, 26, 5])]
    codes = [random_codes(ours, q, sum(p), seed=10 + i) for i, (_, _, p) in enumerate(setups)]
    streams = [Code2WavStream(ours, chunk, ctx) for chunk, ctx, _ in setups]
    outs: list[list[torch.Tensor]] = [[] for _ in setups]

    forwards: list[int] = []
    forward = ours.forward

    def counted(batch: torch.Tensor) -> torch.Tensor:
        forwards.append(batch.shape[0])
        return forward(batch)

    monkeypatch.setattr(ours, "forward", counted)
    starts, num_calls_with_audio = [0] * len(setups), 0
    for step in range(max(len(p) for _, _, p in setups)):
        items = []
        for i, (_, _, pieces) in enumerate(setups):
            if step < len(pieces):
                items.append((streams[i], codes[i][:, starts[i]:starts[i] + pieces[step]]))
                starts[i] += pieces[step]
        new = push_streams(items)
        num_calls_with_audio += any(out.numel() for out in new)
        for (stream, _), out in zip(items, new):
            outs[streams.index(stream)].append(out)
    for s in streams:
        s.finish()
    new = decode_streams(streams)
    num_calls_with_audio += any(out.numel() for out in new)
    for i, out in enumerate(new):
        outs[i].append(out)
    monkeypatch.undo()

    assert max(forwards) >= 3   # windows of several requests (and lengths) in one forward
    assert len(forwards) == num_calls_with_audio   # one forward per call, whatever was ready
    for (chunk, ctx, _), c, out in zip(setups, codes, outs):
        assert_close(torch.cat(out), ours.chunked_decode(c[None], chunk, ctx)[0, 0])


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
    stream.flush()
    with pytest.raises(ValueError, match="already finished"):
        stream.push(codes[0, :, :1].clamp(max=size - 1))
