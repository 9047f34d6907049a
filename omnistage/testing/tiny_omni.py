"""A tiny random Qwen3-Omni checkpoint (`Qwen3OmniMoeForConditionalGeneration`) built with
transformers' own classes, for golden tests of the thinker, talker and code2wav stages.

    path = build_tiny_qwen3_omni(tmp_path / "omni")     # config.json, safetensors, tokenizer,
                                                        # processor (audio / image / video)

The tokenizer is the tiny byte-level BPE of tiny_tokenizer.py plus the Qwen-Omni special
tokens; the config's token ids (im_start, audio_pad, tts_bos, ...) point at them, so chat
templates and the processor's placeholder expansion work as with the real model. Sizes are
chosen so that every code path runs (MoE routing with top-k < experts, shared expert in the
talker, several codebook groups, two upsampling stages, deepstack layers) in milliseconds.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerFast

from omnistage.testing.tiny_tokenizer import CHAT_TEMPLATE, _train

# special tokens appended after the tiny vocabulary, in this order
OMNI_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
)
ROLE_TOKENS: tuple[str, ...] = ("system", "user", "assistant")  # single tokens, as in Qwen's vocab
# The talker's codec vocabulary: codes 0..63, then 1024 ids the reference suppresses at sampling
# (vocab - 1024 .. vocab, EOS excepted) where the specials and speakers live, as in the real one.
NUM_CODES = 64
CODEC_VOCAB = NUM_CODES + 1024
SPEAKERS = {"ethan": 1070, "chelsie": 1071}


def build_tiny_omni_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *OMNI_SPECIAL_TOKENS],
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens(list(ROLE_TOKENS))
    # the processor looks these names up on the tokenizer
    for attr, token in (("audio_token", "<|audio_pad|>"), ("image_token", "<|image_pad|>"),
                        ("video_token", "<|video_pad|>"), ("vision_bos_token", "<|vision_start|>"),
                        ("vision_eos_token", "<|vision_end|>"),
                        ("audio_bos_token", "<|audio_start|>"),
                        ("audio_eos_token", "<|audio_end|>")):
        setattr(tokenizer, attr, token)
    tokenizer.save_pretrained(str(path))
    return tokenizer


# the real upsampling (1920 samples a frame, 555 lost at a window's end: chunk seams show);
# sliding window 6: receptive field 22 frames, inside the shipped context of 25
TINY_CODE2WAV: dict[str, Any] = dict(
    codebook_size=NUM_CODES, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
    intermediate_size=64, num_hidden_layers=2, num_quantizers=4, sliding_window=6,
    upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
    max_position_embeddings=512)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
         "interleaved": True}


def _media_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The placeholder and start token ids that the thinker's and talker's configs both carry."""
    tid = tokenizer.convert_tokens_to_ids
    return {"audio_token_id": tid("<|audio_pad|>"), "image_token_id": tid("<|image_pad|>"),
            "video_token_id": tid("<|video_pad|>"),
            "audio_start_token_id": tid("<|audio_start|>"),
            "vision_start_token_id": tid("<|vision_start|>"), "position_id_per_seconds": 25}


def _thinker_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "audio_config": dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                             encoder_ffn_dim=64, d_model=32, output_dim=64, n_window=50,
                             n_window_infer=200, conv_chunksize=500, downsample_hidden_size=8,
                             max_source_positions=1500),
        "vision_config": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                              in_channels=3, patch_size=4, spatial_merge_size=2,
                              temporal_patch_size=2, out_hidden_size=64,
                              num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        "text_config": dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                            max_position_embeddings=4096, rope_parameters=dict(_ROPE),
                            rms_norm_eps=1e-6),
        **_media_token_ids(tokenizer),
        "user_token_id": tokenizer.convert_tokens_to_ids("user"),
    }


def _talker_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "text_config": dict(vocab_size=CODEC_VOCAB, hidden_size=48, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=12, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                            max_position_embeddings=4096, rope_parameters=dict(_ROPE),
                            rms_norm_eps=1e-6),
        "code_predictor_config": dict(vocab_size=NUM_CODES, hidden_size=48,
                                      intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      num_code_groups=4, max_position_embeddings=64,
                                      rms_norm_eps=1e-6),
        "num_code_groups": 4, "thinker_hidden_size": 64, "accept_hidden_layer": 2,
        # codec specials in the top of the codec vocab; EOS must not be suppressed
        "codec_pad_id": 1080, "codec_bos_id": 1081, "codec_eos_token_id": 1082,
        "codec_nothink_id": 1076, "codec_think_bos_id": 1077, "codec_think_eos_id": 1078,
        "speaker_id": dict(SPEAKERS), **_media_token_ids(tokenizer), "spatial_merge_size": 2,
    }


def tiny_omni_config(tokenizer: PreTrainedTokenizerFast,
                     code2wav_overrides: dict[str, Any] | None = None,
                     thinker_text_overrides: dict[str, Any] | None = None, **overrides: Any):
    from transformers import Qwen3OmniMoeConfig

    tid = tokenizer.convert_tokens_to_ids
    thinker = _thinker_config(tokenizer)
    thinker["text_config"].update(thinker_text_overrides or {})
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=_talker_config(tokenizer),
        code2wav_config={**copy.deepcopy(TINY_CODE2WAV), **(code2wav_overrides or {})},
        enable_audio_output=True,
        im_start_token_id=tid("<|im_start|>"), im_end_token_id=tid("<|im_end|>"),
        tts_pad_token_id=tid("<|tts_pad|>"), tts_bos_token_id=tid("<|tts_bos|>"),
        tts_eos_token_id=tid("<|tts_eos|>"), system_token_id=tid("system"),
        user_token_id=tid("user"), assistant_token_id=tid("assistant"))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@torch.no_grad()
def _randomize(model: nn.Module, seed: int) -> None:
    """Everything drawn (norms near 1, biases small), scaled by fan-in so activations stay
    O(1); HF's init would leave norms at 1 and biases at 0 and hide mistakes."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight") or name.endswith("ln.weight") or "layer_norm" in name \
                or name.endswith(".scale") or "norm" in name.split(".")[-2:][0]:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif p.ndim == 1:
            p.copy_(0.1 * noise)
        elif "embed" in name or "codebook" in name:
            p.copy_(noise)
        else:
            fan_in = p[0].numel() if p.ndim != 3 or "experts" not in name else p.shape[-1]
            p.copy_(noise / math.sqrt(fan_in))


def build_tiny_qwen3_omni(path: str | Path, *, seed: int = 0, with_processor: bool = True,
                          code2wav_overrides: dict[str, Any] | None = None,
                          thinker_text_overrides: dict[str, Any] | None = None,
                          **config_overrides: Any) -> Path:
    """Save a tiny random Qwen3-Omni checkpoint (float32) with tokenizer and processor files
    into `path`. Deterministic for a given seed. Code2wav's waveform peaks near 0.5 (see
    `make_audible`). thinker_text_overrides: into thinker_config.text_config (e.g. an even
    vocab_size for tensor parallelism)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_omni_tokenizer(path)
    config = tiny_omni_config(tokenizer, code2wav_overrides, thinker_text_overrides,
                              **config_overrides)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
    _randomize(model, seed)
    make_audible(model.code2wav, seed=seed)
    model.save_pretrained(str(path), safe_serialization=True)
    if with_processor:
        save_tiny_omni_processor(path, tokenizer)
    return path


@torch.no_grad()
def make_audible(code2wav: nn.Module, peak: float = 0.5, seed: int = 0) -> float:
    """Scale code2wav's last conv (a linear map before the final clamp) so that random codes
    decode to a waveform peaking near `peak`: random weights otherwise give either ~1e-6
    (transformers' init), which any wrong output matches, or a waveform clamped flat at +-1,
    which hides errors too. Returns the scale applied."""
    cfg = code2wav.config
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cfg.codebook_size, (2, cfg.num_quantizers, 30), generator=gen)
    last = code2wav.decoder[-1].conv
    seen: list[torch.Tensor] = []
    hook = last.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        code2wav(codes.to(last.weight.device))
    finally:
        hook.remove()
    scale = peak / seen[0].abs().max().item()
    last.weight.mul_(scale)
    if last.bias is not None:
        last.bias.mul_(scale)
    return scale


def save_tiny_omni_processor(path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """One `preprocessor_config.json` holding both the Whisper feature extractor's settings
    (128 mel bins, 16 kHz) and the Qwen2-VL image processor's, sized for the tiny vision
    encoder (patch 4, merge 2, temporal 2), as the real checkpoint ships them. (transformers'
    Qwen3OmniMoeProcessor itself needs torchvision for its video part, which we do not
    install.)"""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    features = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    image = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                     min_pixels=8 * 8, max_pixels=64 * 64)
    doc = {**json.loads(image.to_json_string()), **json.loads(features.to_json_string()),
           "image_processor_type": "Qwen2VLImageProcessor",
           "feature_extractor_type": "WhisperFeatureExtractor",
           "processor_class": "Qwen3OmniMoeProcessor"}
    doc.pop("mel_filters", None)
    (path / "preprocessor_config.json").write_text(json.dumps(doc, indent=2))
