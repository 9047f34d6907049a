"""The `qwen-tts` reference, run in its own environment (.venv-ref: transformers 4.57.3 and
qwen-tts, see scripts/setup.sh --test) by tests/models/qwen3_tts through `run_reference` in
tiny_tts.py. Standalone on purpose: it imports nothing from omnistage, whose dependencies
(transformers 5) that environment does not have.

    python qwen3_tts_reference.py DIR

DIR holds `tokenizer/` (the tiny tokenizer, built by tiny_tts.py) and `job.json`
(`{"seed": .., "requests": [..]}`). The script builds the three tiny checkpoints with the
reference's own classes (`DIR/custom_voice`, `DIR/voice_design`, `DIR/base`, each with its
`speech_tokenizer/` as published), loads them back with `Qwen3TTSModel.from_pretrained` and
writes every request's outputs to `DIR/reference.npz` (`{i}.codes`, `{i}.wav`, ...).

The 25 Hz tokenizer's module imports `sox`, `onnxruntime` and `torchaudio`, which the 12 Hz
models never use; empty stand-ins take their place so that the environment stays small
(torchaudio has no build for the local torch).
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import torch
import transformers  # noqa: F401  (first: it probes for torchaudio, which must look absent)

for _name in ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance",
              "torchaudio.compliance.kaldi"):
    _stub = sys.modules.setdefault(_name, types.ModuleType(_name))
    _stub.__spec__ = importlib.machinery.ModuleSpec(_name, None)

MODES = ("custom_voice", "voice_design", "base")
CODEBOOK = 64            # codes 0..63; the talker's ids 64.. are specials, speakers, languages
CODEC_VOCAB = CODEBOOK + 1024
NUM_GROUPS = 4
CODEC_IDS = {"codec_pad_id": 1000, "codec_bos_id": 1001, "codec_eos_token_id": 1002,
             "codec_think_id": 1003, "codec_nothink_id": 1004, "codec_think_bos_id": 1005,
             "codec_think_eos_id": 1006}
LANGUAGES = {"english": 1010, "chinese": 1011, "beijing_dialect": 1012}
SPEAKERS = {"vivian": 1020, "dylan": 1021}
DIALECTS = {"vivian": False, "dylan": "beijing_dialect"}


def talker_config(text_vocab: int, tts_ids: dict) -> dict:
    return {
        "vocab_size": CODEC_VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 512, "rope_theta": 10000,
        "rope_scaling": {"interleaved": True, "mrope_section": [1, 1, 2], "rope_type": "default",
                         "type": "default"},
        "num_code_groups": NUM_GROUPS, "text_hidden_size": 48, "text_vocab_size": text_vocab,
        "pad_token_id": 0,
        **CODEC_IDS, "codec_language_id": LANGUAGES, "spk_id": SPEAKERS,
        "spk_is_dialect": DIALECTS,
        "code_predictor_config": {
            "vocab_size": CODEBOOK, "hidden_size": 24, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 6, "max_position_embeddings": 64, "num_code_groups": NUM_GROUPS},
    }


def speech_tokenizer_config() -> dict:
    mimi = {"hidden_size": 32, "num_filters": 4, "num_residual_layers": 1,
            "upsampling_ratios": [8, 6, 5, 4], "codebook_size": CODEBOOK, "codebook_dim": 16,
            "num_quantizers": NUM_GROUPS, "num_semantic_quantizers": 1,
            "vector_quantization_hidden_dimension": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 64, "sliding_window": 64, "max_position_embeddings": 256,
            "frame_rate": 12.5, "sampling_rate": 24000, "use_cache": False,
            "upsample_groups": 32}
    decoder = {"codebook_size": CODEBOOK, "codebook_dim": 16, "hidden_size": 32,
               "latent_dim": 24, "num_attention_heads": 2, "num_key_value_heads": 2,
               "head_dim": 16, "intermediate_size": 64, "num_hidden_layers": 2,
               "sliding_window": 6, "max_position_embeddings": 512, "num_quantizers": NUM_GROUPS,
               "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32}
    return {"encoder_config": mimi, "decoder_config": decoder,
            "encoder_valid_num_quantizers": NUM_GROUPS}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Everything drawn (norms near 1, biases small, fan-in scaled weights) so that a wrong
    wire cannot hide behind an init of ones and zeros; codebook usages stay positive."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        last = name.split(".")[-1]
        if last == "cluster_usage":
            p.copy_(1.0 + 0.5 * noise.abs())
        elif "norm" in name or last in ("scale", "gamma"):
            p.copy_(1.0 + 0.1 * noise)
        elif last == "bias" or p.ndim == 1:
            p.copy_(0.1 * noise)
        elif "embed" in name or "codebook" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / math.sqrt(p[0].numel()))


@torch.no_grad()
def make_audible(decoder: torch.nn.Module, peak: float = 0.5) -> None:
    """Scale the decoder's last conv so that random codes decode to a waveform peaking near
    `peak` (before the clamp): neither faint nor clamped flat."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, CODEBOOK, (2, NUM_GROUPS, 20), generator=gen)
    last = decoder.decoder[-1].conv
    seen: list[torch.Tensor] = []
    hook = last.register_forward_hook(lambda _m, _i, out: seen.append(out))
    decoder(codes)
    hook.remove()
    scale = peak / seen[0].abs().max().item()
    last.weight.mul_(scale)
    last.bias.mul_(scale)


def load_tokenizer(root: Path):
    """The tiny tokenizer from `root/tokenizer/tokenizer.json` alone: transformers 5 saved the
    rest in a layout 4.57 cannot read."""
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast(tokenizer_file=str(root / "tokenizer" / "tokenizer.json"),
                              eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, bos_token=None)


def tts_token_ids(tokenizer) -> dict[str, int]:
    return {f"tts_{k}_token_id": tokenizer.convert_tokens_to_ids(f"<|tts_{k}|>")
            for k in ("pad", "bos", "eos")}


def write_generation_config(path: Path) -> None:
    """The release's sampling defaults, as its checkpoints carry them."""
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0,
         "top_k": 50, "subtalker_dosample": True, "subtalker_temperature": 0.9,
         "subtalker_top_p": 1.0, "subtalker_top_k": 50, "max_new_tokens": 8192}))


def save_model(model: torch.nn.Module, path: Path, speaker_encoder: dict) -> None:
    """save_pretrained, with the speaker encoder's config as published: its config class
    takes its own keys only (not the `model_type` that to_dict adds)."""
    model.save_pretrained(path, safe_serialization=True)
    doc = json.loads((path / "config.json").read_text())
    doc["speaker_encoder_config"] = speaker_encoder
    (path / "config.json").write_text(json.dumps(doc, indent=2))


def build(root: Path, seed: int, modes: tuple[str, ...] = MODES) -> None:
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import (Qwen3TTSConfig, Qwen3TTSForConditionalGeneration,
                                      Qwen3TTSProcessor)
    from transformers import EncodecFeatureExtractor

    tokenizer = load_tokenizer(root)
    tts_ids = tts_token_ids(tokenizer)
    torch.manual_seed(seed)
    speech = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**speech_tokenizer_config()))
    speech = speech.float().eval()
    randomize(speech, seed + 10)
    make_audible(speech.decoder)
    speaker_encoder = {"mel_dim": 128, "enc_dim": 32, "enc_channels": [16, 16, 16, 16, 48],
                       "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
                       "enc_attention_channels": 8, "enc_res2net_scale": 4,
                       "enc_se_channels": 8, "sample_rate": 24000}
    for mode in modes:
        config = Qwen3TTSConfig(
            talker_config=talker_config(len(tokenizer), tts_ids),
            speaker_encoder_config=speaker_encoder,
            tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="1b7",
            tts_model_type=mode, im_start_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
            im_end_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **tts_ids)
        config.architectures = ["Qwen3TTSForConditionalGeneration"]
        model = Qwen3TTSForConditionalGeneration(config).float().eval()
        randomize(model, seed + MODES.index(mode))
        # EOS must not win greedy decoding by chance in a few steps: its head row is zero
        with torch.no_grad():
            model.talker.codec_head.weight[CODEC_IDS["codec_eos_token_id"]] = 0.0
        path = root / mode
        save_model(model, path, speaker_encoder)
        Qwen3TTSProcessor(tokenizer=tokenizer).save_pretrained(path)
        write_generation_config(path)
        speech.save_pretrained(path / "speech_tokenizer", safe_serialization=True)
        features = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000,
                                           padding_value=0.0, return_attention_mask=True)
        features.save_pretrained(path / "speech_tokenizer")
    shutil.rmtree(root / "tokenizer")


def run_request(models: dict, req: dict) -> dict[str, np.ndarray]:
    """One request through the wrapper's public API (`generate_custom_voice`, ...), greedy;
    a clone's reference audio is a list of 24 kHz samples."""
    from qwen_tts import Qwen3TTSModel

    tts: Qwen3TTSModel = models[req["mode"]]
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=req["max_new_tokens"],
                  repetition_penalty=req.get("repetition_penalty", 1.05))
    if "non_streaming_mode" in req:          # else the wrapper's default for the mode
        greedy["non_streaming_mode"] = req["non_streaming_mode"]
    captured: dict[str, list] = {}
    generate = tts.model.generate

    def spy(*args: object, **kwargs: object):  # the talker's codes, before decoding
        codes, hidden = generate(*args, **kwargs)
        captured["codes"] = codes
        return codes, hidden

    tts.model.generate = spy
    try:
        if req["mode"] == "custom_voice":
            wavs, sr = tts.generate_custom_voice(req["text"], req["speaker"], req["language"],
                                                 instruct=req.get("instruct"), **greedy)
        elif req["mode"] == "voice_design":
            wavs, sr = tts.generate_voice_design(req["text"], req["instruct"], req["language"],
                                                 **greedy)
        else:
            ref = (np.asarray(req["ref_audio"], dtype=np.float32), 24000)
            prompt = tts.create_voice_clone_prompt(ref, req.get("ref_text"),
                                                   x_vector_only_mode=req["x_vector_only"])
            wavs, sr = tts.generate_voice_clone(req["text"], req["language"],
                                                voice_clone_prompt=prompt, **greedy)
            item = prompt[0]
            captured["spk"] = [item.ref_spk_embedding]
            if item.ref_code is not None:
                captured["ref_code"] = [item.ref_code]
    finally:
        tts.model.generate = generate
    out = {"sr": np.asarray(sr)}
    for j, (codes, wav) in enumerate(zip(captured["codes"], wavs)):
        out[f"codes{j}"] = codes.numpy()
        out[f"wav{j}"] = np.asarray(wav, dtype=np.float32)
    if "spk" in captured:
        out["spk"] = captured["spk"][0].float().numpy()
    if "ref_code" in captured:
        out["ref_code"] = captured["ref_code"][0].numpy()
    return out


def main(root: Path) -> None:
    from qwen_tts import Qwen3TTSModel

    job = json.loads((root / "job.json").read_text())
    build(root, job["seed"])
    torch.set_num_threads(2)
    models = {m: Qwen3TTSModel.from_pretrained(str(root / m), dtype=torch.float32,
                                               attn_implementation="eager") for m in MODES}
    arrays: dict[str, np.ndarray] = {}
    for i, req in enumerate(job["requests"]):
        for key, value in run_request(models, req).items():
            arrays[f"{i}.{key}"] = value
    np.savez(root / "reference.npz", **arrays)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
