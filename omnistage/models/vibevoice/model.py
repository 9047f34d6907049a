"""VibeVoice (Microsoft; transformers' VibeVoiceForConditionalGeneration) on our layers.

    prompt embeds (text, voice clips' latents through the acoustic connector)
      --Qwen2 LM (paged KV cache)--> hidden --lm_head, 4 ids allowed, argmax--> next id
    next id == audio token:
      v-prediction diffusion head (DPM-Solver++, CFG against a negative context) -> latent
      acoustic decoder (streamed) -> 3200 samples; semantic encoder (streamed) -> features
      next input = acoustic_connector(latent) + semantic_connector(features)
    else: next input = embed(next id)

The negative (unconditional) context is the LM run on [audio_bos, the current segment's
speech inputs]: it restarts whenever the LM emits audio_bos (speech.py).

Checkpoint names: `model.language_model.*` and `lm_head.*` go to `model.*` / `lm_head.*`
(Qwen2's fused q/k/v and gate/up); the rest to `speech.*` one-to-one (`speech_names`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from omnistage.layers.parallel import ParallelLMHead
from omnistage.models.causal_lm import CausalLM
from omnistage.models.loader import (_default_dtype, check_tensor_names, checkpoint_names,
                                     component_tensor_files, iter_component_tensors,
                                     load_packed_weights)
from omnistage.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from omnistage.models.vibevoice.config import VibeVoiceConfig
from omnistage.models.vibevoice.head import SpeechConnector, VibeVoiceDiffusionHead
from omnistage.models.vibevoice.tokenizer import (VibeVoiceTokenizerDecoder,
                                                  VibeVoiceTokenizerEncoder)

# checkpoint prefix -> our module path (the speech parts)
SPEECH_NAMES = {
    "model.diffusion_head.": "diffusion_head.",
    "model.multi_modal_projector.": "acoustic_connector.",
    "model.semantic_connector.": "semantic_connector.",
    "model.audio_tower.encoder.": "acoustic_encoder.",
    "model.audio_tower.decoder.": "acoustic_decoder.",
    "model.semantic_tokenizer_encoder.": "semantic_encoder.",
    "model.latent_scaling_factor": "latent_scaling_factor",
    "model.latent_bias_factor": "latent_bias_factor",
}


class VibeVoiceSpeech(nn.Module):
    """Everything but the LM: the diffusion head, both connectors and the tokenizers."""

    def __init__(self, config: VibeVoiceConfig) -> None:
        super().__init__()
        self.diffusion_head = VibeVoiceDiffusionHead(config.head)
        self.acoustic_connector = SpeechConnector(config.acoustic.hidden_size,
                                                  config.text.hidden_size)
        self.semantic_connector = SpeechConnector(config.semantic.hidden_size,
                                                  config.text.hidden_size)
        self.acoustic_encoder = VibeVoiceTokenizerEncoder(config.acoustic)
        self.acoustic_decoder = VibeVoiceTokenizerDecoder(config.acoustic)
        self.semantic_encoder = VibeVoiceTokenizerEncoder(config.semantic)
        self.latent_scaling_factor = nn.Parameter(torch.tensor(1.0))
        self.latent_bias_factor = nn.Parameter(torch.tensor(0.0))

    def encode_voice(self, audio: Tensor) -> Tensor:
        """A voice clip (B, 1, N) at 24 kHz -> its prompt embeddings (B, N / hop, H): the
        encoder's latents (the mean, as the reference's `sample=False`), scaled, through
        the acoustic connector."""
        latents = self.acoustic_encoder(audio)
        latents = (latents + self.latent_bias_factor) * self.latent_scaling_factor
        return self.acoustic_connector(latents)

    def unscale(self, latent: Tensor) -> Tensor:
        """The diffusion head's latent -> the decoder's input."""
        return latent / self.latent_scaling_factor - self.latent_bias_factor


class VibeVoiceForConditionalGeneration(CausalLM):
    packed_modules = Qwen2ForCausalLM.packed_modules
    stops_at_tokenizer_eos = False

    def __init__(self, config: VibeVoiceConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config.text)
        self.lm_head = ParallelLMHead(config.text.vocab_size, config.text.hidden_size)
        self.speech = VibeVoiceSpeech(config)
        allowed = torch.full((config.text.vocab_size,), float("-inf"))
        allowed[list(config.tokens.allowed)] = 0.0
        self.register_buffer("logits_mask", allowed, persistent=False)

    @property
    def model_config(self):  # -> ModelConfig, what the AR engine reads
        return self.config.text

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> VibeVoiceForConditionalGeneration:
        """Build from config.json and load every tensor of model.safetensors strictly (a
        missing, unexpected or mis-shaped one raises ValueError naming it)."""
        path = Path(path)
        config = VibeVoiceConfig.from_pretrained(path)
        dtype = dtype or getattr(torch, config.text.torch_dtype)
        with _default_dtype(dtype), torch.device(device):
            model = cls(config)
        found = {n for names in component_tensor_files(path, "").values() for n in names}
        with torch.no_grad():
            lm = load_packed_weights(model, _lm_tensors(path), cls.packed_modules)
            sp = load_packed_weights(model.speech, _speech_tensors(path), {})
        expected = {_lm_checkpoint_name(n) for n in checkpoint_names(model, cls.packed_modules)
                    if not n.startswith("speech.")}
        expected |= {_speech_checkpoint_name(n) for n, _ in model.speech.named_parameters()}
        if config.text.tie_word_embeddings:
            found.discard("lm_head.weight")
            expected.discard("lm_head.weight")
        check_tensor_names(path, cls.__name__, expected, found)
        params = {n for n, _ in model.named_parameters()}
        missing = params - lm - {"speech." + n for n in sp}
        if config.text.tie_word_embeddings and "lm_head.weight" in missing:
            model.lm_head.weight.data.copy_(model.model.embed_tokens.weight)
            missing.discard("lm_head.weight")
        assert not missing, f"parameters not loaded: {sorted(missing)[:10]}"
        return model.eval()

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)                    # (T,) -> (T, hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(input_ids, positions, h, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, hidden) -> (N, vocab) float32, every id but the four speech ids at -inf."""
        return self.lm_head(hidden).float() + self.logits_mask

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.packed_modules)


def _lm_tensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in iter_component_tensors(path, "", ()):
        if name.startswith("model.language_model."):
            yield "model." + name[len("model.language_model."):], tensor
        elif name.startswith("lm_head."):
            yield name, tensor


def _speech_tensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in iter_component_tensors(path, "model.", ()):
        full = "model." + name
        for src, dst in SPEECH_NAMES.items():
            if full.startswith(src):
                yield dst + full[len(src):], tensor
                break


def _lm_checkpoint_name(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def _speech_checkpoint_name(name: str) -> str:
    for src, dst in SPEECH_NAMES.items():
        if name.startswith(dst):
            return src + name[len(dst):]
    raise AssertionError(name)
