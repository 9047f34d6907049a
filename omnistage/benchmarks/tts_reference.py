"""The `qwen-tts` side of `omnistage bench tts`, run in the reference environment (transformers
4.57.3 + qwen-tts; see tts.py for how that interpreter is chosen). Standalone, as
omnistage/testing/qwen3_tts_reference.py (whose stand-ins, tiny sizes and init it reuses): it
imports nothing from omnistage.

    python tts_reference.py DIR

DIR holds `tokenizer/` (the tiny test tokenizer, written by tts.py) and `job.json`
(`{"sizes", "device", "seed", "frames", "requests", "texts", "speaker", "language"}`). The
script builds a random CustomVoice checkpoint with qwen-tts's own classes in DIR/custom_voice
(on `device`; bfloat16 on CUDA, where transformers' init takes seconds, float32 on the CPU),
then, if `requests` > 0, loads it back with `Qwen3TTSModel.from_pretrained` and times
`generate_custom_voice` (greedy talker and code predictor, `frames` talker steps: the EOS row
of the codec head is zero in the checkpoint, so greedy decoding never stops early) one request
at a time, after one warm-up. Per request: seconds (device synchronized), samples of audio,
codec frames; written to DIR/reference.json.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))

import qwen3_tts_reference as tiny  # (first: it stubs sox, onnxruntime, torchaudio)
import torch


def librosa_stand_in() -> None:
    """qwen-tts imports librosa at import (mel filters for the speaker encoder, resampling of
    a clone's audio), which CustomVoice never calls. Where it cannot be imported (the device:
    numba's 60 MB llvmlite does not travel, and numba refuses a newer numpy), a stand-in that
    fails when called takes its place."""
    try:
        import librosa.filters
    except ImportError:
        def unavailable(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError("librosa is not installed in the reference environment")

        librosa = types.ModuleType("librosa")
        librosa.filters = types.ModuleType("librosa.filters")
        librosa.filters.mel = librosa.resample = unavailable
        sys.modules.update({"librosa": librosa, "librosa.filters": librosa.filters})


librosa_stand_in()

# Qwen3-TTS-12Hz-1.7B-CustomVoice's talker: Qwen3-1.7B's body (28 layers of 2048, 16 query and
# 8 KV heads of 128, MLP 6144), interleaved M-RoPE; its code predictor (5 layers of 1024, 16
# code groups of 2048 codes); the codec ids and a few speakers and languages of the release
CODEC_IDS = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
             "codec_think_id": 2154, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
             "codec_think_eos_id": 2157}
TALKER_1P7B = {
    "vocab_size": 3072, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 32768, "rope_theta": 1000000,
    "rope_scaling": {"interleaved": True, "mrope_section": [24, 20, 20],
                     "rope_type": "default", "type": "default"},
    "num_code_groups": 16, "text_hidden_size": 2048, "text_vocab_size": 151936,
    "pad_token_id": 0, **CODEC_IDS,
    "codec_language_id": {"english": 2050, "german": 2052, "chinese": 2055, "french": 2061},
    "spk_id": {"ryan": 3061, "aiden": 2861, "vivian": 3065},
    "spk_is_dialect": {"ryan": False, "aiden": False, "vivian": False},
    "code_predictor_config": {
        "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 65536, "rope_theta": 1000000,
        "num_code_groups": 16},
}
# x-vectors as wide as the talker (CustomVoice builds no speaker encoder; the config keeps it)
SPEAKER_ENCODER_1P7B = {"enc_dim": 2048, "sample_rate": 24000}
# the 12 Hz speech tokenizer at qwen-tts's defaults (the release's: 16 quantizers of 2048
# codes, an 8-layer decoder transformer, 1536-wide decoder upsampling 1920x to 24 kHz)
SPEECH_1P7B = {"encoder_config": {"num_quantizers": 32, "codebook_size": 2048,
                                  "frame_rate": 12.5, "sampling_rate": 24000},
               "decoder_config": {"codebook_dim": 512}, "encoder_valid_num_quantizers": 16}


def build(root: Path, job: dict) -> Path:
    """The checkpoint, saved as published; its folder."""
    if job["sizes"] == "tiny":
        tiny.build(root, job["seed"], modes=("custom_voice",))
        return root / "custom_voice"
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import (Qwen3TTSConfig, Qwen3TTSForConditionalGeneration,
                                      Qwen3TTSProcessor)
    from transformers import EncodecFeatureExtractor

    tokenizer = tiny.load_tokenizer(root)
    tts_ids = tiny.tts_token_ids(tokenizer)
    device = torch.device(job["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(job["seed"])
    config = Qwen3TTSConfig(
        talker_config=TALKER_1P7B, speaker_encoder_config=SPEAKER_ENCODER_1P7B,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="1b7", tts_model_type="custom_voice",
        im_start_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        im_end_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **tts_ids)
    config.architectures = ["Qwen3TTSForConditionalGeneration"]
    with torch.device(device):       # transformers' init where the weights will live
        model = Qwen3TTSForConditionalGeneration(config).to(dtype).eval()
        speech = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**SPEECH_1P7B)).eval()
    with torch.no_grad():            # greedy decoding never picks EOS: fixed lengths
        model.talker.codec_head.weight[CODEC_IDS["codec_eos_token_id"]] = 0.0
    path = root / "custom_voice"
    tiny.save_model(model, path, SPEAKER_ENCODER_1P7B)
    Qwen3TTSProcessor(tokenizer=tokenizer).save_pretrained(path)
    tiny.write_generation_config(path)
    speech.save_pretrained(path / "speech_tokenizer", safe_serialization=True)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0,
                            return_attention_mask=True).save_pretrained(path / "speech_tokenizer")
    del model, speech
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_requests(path: Path, job: dict) -> dict:
    """Warm-up, then `requests` greedy requests one after another."""
    from qwen_tts import Qwen3TTSModel

    device = torch.device(job["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(2)
    tts = Qwen3TTSModel.from_pretrained(str(path), dtype=dtype, device_map=str(device))
    frames: list[int] = []
    generate = tts.model.generate

    def spy(*args: object, **kwargs: object):  # the talker's frames, before decoding
        codes, hidden = generate(*args, **kwargs)
        frames.append(int(codes[0].shape[0]))
        return codes, hidden

    tts.model.generate = spy
    greedy = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": job["frames"],
              "repetition_penalty": 1.05}

    def one(text: str) -> tuple[float, int, int]:
        sync(device)
        t0 = time.perf_counter()
        wavs, sr = tts.generate_custom_voice(text, job["speaker"], job["language"], **greedy)
        sync(device)
        return time.perf_counter() - t0, int(wavs[0].shape[0]), int(sr)

    one(job["texts"][0])                                   # warm-up, at full length
    runs = [one(job["texts"][i % len(job["texts"])]) for i in range(job["requests"])]
    return {"seconds": [r[0] for r in runs], "audio_samples": [r[1] for r in runs],
            "frames": frames[1:], "sample_rate": runs[0][2] if runs else None,
            "attn_implementation": tts.model.config._attn_implementation,
            "versions": versions()}


def versions() -> dict[str, str]:
    from importlib import metadata

    return {name: metadata.version(name) for name in ("transformers", "qwen-tts", "torch")}


def main(root: Path) -> None:
    job = json.loads((root / "job.json").read_text())
    path = build(root, job)
    result = time_requests(path, job) if job["requests"] > 0 else None
    (root / "reference.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
