"""MiMo-Audio's tokenizer decoder as a generation stage model (generation/mimo_audio.py): the
LLM's spoken patches arriving chunk by chunk decode (`chunk_frames: 0`), when the input
closes, to the waveform of
models/mimo_audio/speech.py on the whole (golden against upstream decode in
test_mimo_audio_tokenizer.py; the patches golden against upstream generate). Streamed:
test_mimo_audio_stream.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.generation.mimo_audio import MiMoAudioDecoderOptions, MiMoAudioGenerator
from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.speech import codes_to_wave, patches_to_codes
from omnistage.payloads import AudioChunk, CodecFrames

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"


@pytest.fixture(scope="module")
def fx() -> dict:
    return json.loads((FIXTURES / "tokens.json").read_text())


def test_whole_decodes_the_chunked_patches_to_the_whole_waveform(fx: dict) -> None:
    cfg = MiMoAudioConfig.from_folder(FIXTURES / "tiny", fx["args"]["empty_idx"])
    gen = MiMoAudioGenerator.from_pretrained(
        None, "mimo_audio_decoder", torch.device("cpu"), None,
        MiMoAudioDecoderOptions(tokenizer=str(FIXTURES / "tokenizer"), empty_id=cfg.empty_ids[0],
                                chunk_frames=0))
    patches = torch.tensor(fx["speak"]).view(-1, 4, 9)[:, :, 1:]          # (steps, 4, 8)
    silent = torch.tensor(cfg.empty_ids).expand(4, -1)
    chunks = [patches[0], silent, *patches[1:]]                           # a silent patch too
    state: dict = {}
    for i, c in enumerate(chunks):
        out = gen.generate([CodecFrames(c).pack()], [state], [i == len(chunks) - 1])[0]
        if i < len(chunks) - 1:
            assert out == {}
    wav = AudioChunk.unpack(out).samples
    a = fx["args"]
    want = codes_to_wave(gen.model, patches_to_codes(torch.tensor(fx["speak"]), cfg,
                                                     a["sostm_idx"], a["eostm_idx"]))
    assert want.std() > 0.01 and wav.shape == want.shape
    torch.testing.assert_close(wav, want, rtol=0, atol=1e-6)


def test_a_folder_without_the_audio_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((FIXTURES / "tiny" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="audio_tokenizer"):
        MiMoAudioGenerator.from_pretrained(tmp_path, "mimo_audio_decoder", torch.device("cpu"),
                                           None)


def _wider_tokenizer(folder: Path, quantizers: int) -> Path:
    """The fixture tokenizer with `quantizers` RVQ layers (the release's has 20 for the LLM's 8
    channels): the extra layers copies of the last, which decoding 8 channels never reads."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    cfg = json.loads((FIXTURES / "tokenizer" / "config.json").read_text())
    have = cfg["num_quantizers"]
    cfg["num_quantizers"] = quantizers
    cfg["codebook_size"] = cfg["codebook_size"] + [cfg["codebook_size"][-1]] * (quantizers - have)
    (folder / "config.json").write_text(json.dumps(cfg))
    state = load_file(FIXTURES / "tokenizer" / "model.safetensors")
    last = f"quantizer.vq.layers.{have - 1}."
    for name in [n for n in state if last in n]:
        for i in range(have, quantizers):
            state[name.replace(last, f"quantizer.vq.layers.{i}.")] = state[name].clone()
    save_file(state, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("chunk_frames", [0, 4])
def test_a_tokenizer_of_more_quantizers_than_channels(fx: dict, tmp_path: Path,
                                                      chunk_frames: int) -> None:
    """The released tokenizer has 20 quantizers, the LLM speaks 8 channels: whole and streamed,
    the 8 channels decode as with the 8-quantizer tokenizer (a stream sized by the tokenizer
    failed: "Expected size 20 but got size 8")."""
    cfg = MiMoAudioConfig.from_folder(FIXTURES / "tiny", fx["args"]["empty_idx"])
    patches = torch.tensor(fx["speak"]).view(-1, 4, 9)[:, :, 1:]          # (steps, 4, 8)
    waves = []
    for tokenizer in (FIXTURES / "tokenizer", _wider_tokenizer(tmp_path / "wide", 10)):
        gen = MiMoAudioGenerator.from_pretrained(
            None, "mimo_audio_decoder", torch.device("cpu"), None,
            MiMoAudioDecoderOptions(tokenizer=str(tokenizer), empty_id=cfg.empty_ids[0],
                                    chunk_frames=chunk_frames))
        assert len(gen.model.codebooks) == (8 if tokenizer.name == "tokenizer" else 10)
        state: dict = {}
        pieces = []
        for i, c in enumerate(patches):
            out = gen.generate([CodecFrames(c).pack()], [state], [i == len(patches) - 1])[0]
            chunk = AudioChunk.unpack(out)
            if chunk is not None and chunk.samples is not None:
                pieces.append(chunk.samples)
        waves.append(torch.cat(pieces))
    assert waves[0].std() > 0.01
    torch.testing.assert_close(waves[1], waves[0], rtol=0, atol=1e-6)
