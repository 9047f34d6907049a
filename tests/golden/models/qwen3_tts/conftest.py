"""Shared by the Qwen3-TTS tests: the cases, run once through the `qwen-tts` reference (in its
own environment) on the tiny checkpoints it builds, and our models loaded from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from omnistage.models.qwen3_tts.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest
from omnistage.models.qwen3_tts.speaker_encoder import Qwen3TTSSpeakerEncoder
from omnistage.models.qwen3_tts.speech_decoder import Qwen3TTSSpeechDecoder
from omnistage.models.qwen3_tts.speech_encoder import Qwen3TTSSpeechEncoder
from omnistage.models.qwen3_tts.talker import Qwen3TTSTalkerForCausalLM
from omnistage.testing.tiny_tts import CASES, CLIPS, MAX_TOKENS, greedy_speech


@pytest.fixture(scope="session")
def ref(qwen3_tts_ref: dict) -> dict:
    return qwen3_tts_ref


@pytest.fixture(scope="session")
def models(ref: dict) -> dict:
    root: Path = ref["root"]
    out = {}
    for mode in ("custom_voice", "voice_design", "base"):
        talker = Qwen3TTSTalkerForCausalLM.from_pretrained(root / mode)
        out[mode] = PromptBuilder(Qwen3TTSConfig.from_pretrained(root / mode), talker,
                                  AutoTokenizer.from_pretrained(root / mode))
    out["decoder"] = Qwen3TTSSpeechDecoder.from_pretrained(root / "base" / "speech_tokenizer")
    out["encoder"] = Qwen3TTSSpeechEncoder.from_pretrained(root / "base" / "speech_tokenizer")
    out["speaker"] = Qwen3TTSSpeakerEncoder.from_pretrained(root / "base")
    return out


def our_request(name: str, models: dict) -> SpeechRequest:
    _, fields = CASES[name]
    fields = dict(fields)
    fields["speaker"] = fields.get("speaker") or None
    if name in CLIPS:
        wav = torch.from_numpy(CLIPS[name])
        fields["speaker_embedding"] = models["speaker"].embed_speaker(wav)
        if "ref_text" in fields:
            fields["ref_code"] = models["encoder"].encode(wav)
    return SpeechRequest(**fields)


@pytest.fixture(scope="session")
def ours(models: dict) -> dict:
    """Our greedy frames of every case: one batch per model."""
    out = {}
    for mode in ("custom_voice", "voice_design", "base"):
        names = [n for n, (m, _) in CASES.items() if m == mode]
        builder = models[mode]
        prompts = [builder.build(our_request(n, models)) for n in names]
        assert len({p.embeds.shape[0] for p in prompts}) == len(prompts), "lengths must differ"
        out.update(zip(names, greedy_speech(builder.talker, prompts, MAX_TOKENS)))
    return out
