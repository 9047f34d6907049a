"""A tiny random VibeVoice (transformers' VibeVoiceForConditionalGeneration with random weights,
saved with save_pretrained) and an LM runner on our paged attention for `SpeechLoop`: what the
golden tests, the docs' example and the bench's --tiny path run."""

from __future__ import annotations

from pathlib import Path
from typing import Hashable

import torch
from torch import Tensor

from omnistage.layers.attention import forward_context
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.testing.tiny_models import PagedCache

AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN, EOS = 250, 251, 252, 253
VOCAB = 256
RATIOS = (2, 3)            # hop 6 samples per latent frame
LATENT = 8


def tokenizer_config(hidden_size: int, seed_depths: tuple[int, ...] = (1, 1, 2),
                     ratios: tuple[int, ...] = RATIOS) -> dict:
    return dict(channels=1, hidden_size=hidden_size, kernel_size=3, num_filters=4,
                downsampling_ratios=list(ratios), depths=list(seed_depths), ffn_expansion=2,
                layer_scale_init_value=0.5, rms_norm_eps=1e-5)


def build_tiny_vibevoice(root: Path, seed: int = 0, audio_gain: float = 1.0,
                         ratios: tuple[int, ...] = RATIOS, speak: float = 1.0) -> Path:
    """A VibeVoiceForConditionalGeneration with a 2-layer Qwen2 (hidden 32), a 2-layer
    diffusion head, 2-stage acoustic/semantic tokenizers (hop 6), saved to `root`. The
    LM head is scaled so greedy decoding speaks a few frames before it stops. `audio_gain`
    scales the acoustic decoder's last conv (its audio): a served test's 16-bit formats clip
    at 1.0, the ungained audio's mean |x| is 4-12. `ratios`: the tokenizers' downsampling (hop
    their product; a served test's clips are 0.5 s at least). `speak`: how strongly the LM head
    prefers the audio id to EOS (a long prompt needs more)."""
    depths = (1,) * len(ratios) + (2,)
    from transformers import VibeVoiceConfig
    from transformers import VibeVoiceForConditionalGeneration as Reference

    text = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config = VibeVoiceConfig(
        text_config=text,
        audio_config=dict(model_type="vibevoice_acoustic_tokenizer",
                          **tokenizer_config(LATENT, depths, ratios)),
        semantic_model_config=dict(model_type="vibevoice_acoustic_tokenizer_encoder",
                                   **tokenizer_config(6, depths, ratios)),
        diffusion_head_config=dict(num_hidden_layers=2, intermediate_size=48,
                                   frequency_embedding_size=16),
        pad_token_id=EOS, eos_token_id=EOS, audio_bos_token_id=AUDIO_BOS,
        audio_eos_token_id=AUDIO_EOS, audio_token_id=AUDIO_TOKEN)
    torch.manual_seed(seed)
    model = Reference(config).eval()
    with torch.no_grad():
        for p in model.parameters():       # _init_weights' tiny std would give silent audio
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            elif p.dim() == 1 and p.numel() > 1:
                p.add_(torch.randn_like(p) * 0.1)
        model.model.latent_scaling_factor.fill_(1.7)
        model.model.latent_bias_factor.fill_(0.1)
        # a constant direction in the residual stream that the audio token's and EOS's rows
        # read with opposite signs: the LM speaks for a while (a random head stops at once)
        model.model.language_model.embed_tokens.weight[:, 0] += 10
        model.model.multi_modal_projector.linear_2.bias[0] += 10
        model.model.semantic_connector.linear_2.bias[0] += 10
        head = model.lm_head.weight
        head[:, 0] = 0
        head[AUDIO_TOKEN, 0], head[EOS, 0] = speak, -speak
        out = model.model.audio_tower.decoder.head.conv
        out.weight.mul_(audio_gain)
        out.bias.mul_(audio_gain)
    model.generation_config.noise_scheduler_class = "DPMSolverMultistepScheduler"
    model.generation_config.noise_scheduler_config = {
        "beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}
    model.save_pretrained(root)
    return root


class PagedLM:
    """An `LMRunner` on our paged attention (omnistage.testing's PagedCache): each key is a
    sequence of its own block table; freed blocks go back to the pool."""

    def __init__(self, model: VibeVoiceForConditionalGeneration, num_blocks: int = 128) -> None:
        self.model = model
        self.cache = PagedCache(model, num_blocks=num_blocks, block_size=4)
        self.seq_ids: dict[Hashable, int] = {}
        self.num_seqs = 0

    def run(self, rows: list[tuple[Hashable, Tensor]]) -> list[Tensor]:
        for key, _ in rows:
            if key not in self.seq_ids:     # a new sequence: never reuse a freed one's id
                self.seq_ids[key] = self.num_seqs
                self.num_seqs += 1
        ids = [self.seq_ids[key] for key, _ in rows]
        md, positions = self.cache.step([(i, len(x)) for i, (_, x) in zip(ids, rows)])
        embeds = torch.cat([x for _, x in rows])
        dummy = torch.zeros(len(embeds), dtype=torch.long)
        with forward_context(md):
            hidden, _ = self.model(dummy, positions, embeds)
        return list(hidden.split([len(x) for _, x in rows]))

    def free(self, key: Hashable) -> None:
        seq = self.seq_ids.pop(key, None)
        if seq is not None:
            self.cache.free_blocks.extend(self.cache.block_tables.pop(seq, []))
            self.cache.num_tokens.pop(seq, None)


def write_tiny_tokenizer(root: Path) -> None:
    """A character-level tokenizer whose ids fit the tiny LM's vocabulary (printable ASCII at
    1..95, newline 96, unknown 0, EOS's text token at EOS), saved beside the checkpoint as
    `omnistage serve` reads it (tokenizer.json)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "\n": 96,
             "<|endoftext|>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(root)
