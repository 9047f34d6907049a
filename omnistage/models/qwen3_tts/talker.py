"""Qwen3-TTS talker: a dense Qwen3 decoder that speaks in codec frames, with Qwen3-Omni's code
predictor (qwen3_omni/code_predictor.py) filling each frame's other code groups.

One step produces one frame of `num_code_groups` (G) codes, as Qwen3-Omni's talker does:

    inputs_embeds (T, H) --Qwen3 decoder (paged KV cache)--> hidden (T, H)
    codec_head(hidden[last]) --sample--> code 0
    code predictor (G-1 rounds) --> codes 1 .. G-1
    next input = sum of the frame's G embeddings + the next text embedding (prompt.py)

Unlike Qwen3-Omni's, the decoder is dense (Qwen2's layers with q/k norm) and it reads the text
itself: `model.text_embedding` (the text vocabulary, text_hidden_size wide) and
`text_projection` into the talker's width. Parameter names follow the checkpoint's `talker.*`
one-to-one (after the fused q/k/v and gate/up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor, nn

from omnistage.layers.parallel import ParallelLMHead, replicated
from omnistage.models.causal_lm import CausalLM
from omnistage.models.loader import build_and_load, checkpoint_names, load_packed_weights
from omnistage.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from omnistage.models.qwen3_omni.code_predictor import CodePredictor
from omnistage.models.qwen3_omni.talker import ResizeMLP, codec_feedback, codec_suppression
from omnistage.models.qwen3_tts.config import Qwen3TTSConfig


class Qwen3TTSTalkerModel(Qwen2Model):
    """Qwen3's decoder, fed embeddings only: the codec and the text embedding tables take the
    place of `embed_tokens`."""

    def __init__(self, config: Qwen3TTSConfig) -> None:
        super().__init__(config.talker)
        del self.embed_tokens
        mc = config.talker
        self.codec_embedding = nn.Embedding(mc.vocab_size, mc.hidden_size,
                                            _weight=torch.empty(mc.vocab_size, mc.hidden_size))
        self.text_embedding = nn.Embedding(
            config.text_vocab_size, config.text_hidden_size,
            _weight=torch.empty(config.text_vocab_size, config.text_hidden_size))
        for emb in (self.codec_embedding, self.text_embedding):
            emb.weight.requires_grad_(False)


class Qwen3TTSTalkerForCausalLM(CausalLM):
    packed_modules = Qwen2ForCausalLM.packed_modules
    checkpoint_prefix = "talker."   # decoder, head, text projection and code predictor
    checkpoint_exclude: tuple[str, ...] = ()
    stops_at_tokenizer_eos = False  # its outputs are codec ids; the text tokenizer's EOS is not

    def __init__(self, config: Qwen3TTSConfig) -> None:
        super().__init__()
        self.config = config
        mc = config.talker
        self.model = Qwen3TTSTalkerModel(config)
        self.codec_head = ParallelLMHead(mc.vocab_size, mc.hidden_size)
        self.text_projection = ResizeMLP(config.text_hidden_size, config.text_hidden_size,
                                         mc.hidden_size)
        with replicated():
            self.code_predictor = CodePredictor(config.code_predictor, config.num_code_groups,
                                                embedding_dim=mc.hidden_size)
        self.register_buffer("suppressed", codec_suppression(mc.vocab_size, mc.eos_token_ids),
                             persistent=False)

    @property
    def model_config(self):  # -> ModelConfig, what the AR engine reads
        return self.config.talker

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen3TTSTalkerForCausalLM:
        """Build from config.json and load every `talker.*` tensor strictly; dtype None: the
        checkpoint's."""
        config = Qwen3TTSConfig.from_pretrained(path)
        return build_and_load(cls, config, config.talker, Path(path), device, dtype)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.codec_embedding(input_ids)                # (T,) -> (T, hidden)

    def embed_text(self, text_ids: Tensor) -> Tensor:
        """Text token ids (N,) -> (N, hidden): the text embedding, projected."""
        return self.text_projection(self.model.text_embedding(text_ids))

    def embed_frames(self, codes: Tensor) -> Tensor:
        """Codec frames (T, G) -> (T, hidden): the sum of each frame's G embeddings (the
        talker's for code 0, the code predictor's for the others), as a step feeds back."""
        embeds = [self.embed_input_ids(codes[:, 0])]
        for g, emb in enumerate(self.code_predictor.model.codec_embedding, start=1):
            embeds.append(emb(codes[:, g]))
        return torch.stack(embeds).sum(0)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids (T,) codec ids (ignored where inputs_embeds (T, hidden) is given);
        positions (T,). Returns the final normed hidden (T, hidden)."""
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(input_ids, positions, h, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, hidden) -> (N, vocab), the reference's suppressed ids at -inf."""
        return self.codec_head(hidden).float().masked_fill(self.suppressed, float("-inf"))

    def feedback(self, last_hidden: Tensor, code0: Tensor, seqs: list) -> tuple[Tensor, list]:
        """The AR runner's hook after sampling (`codec_feedback`), the code predictor drawing
        with the reference's subtalker defaults top_k=50, top_p=1.0 (temperature: the
        request's)."""
        return codec_feedback(self, last_hidden, code0, seqs, top_k=50, top_p=1.0)

    def predict_codes(self, past_hidden: Tensor, code0: Tensor, **sampling: object
                      ) -> tuple[Tensor, Tensor]:
        """`CodePredictor.predict` with code 0 embedded by the talker: -> codes (B, G) and the
        sum of their embeddings (B, hidden)."""
        return self.code_predictor.predict(past_hidden, code0, self.embed_input_ids(code0),
                                           **sampling)  # type: ignore[arg-type]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.packed_modules)

    def checkpoint_names(self) -> set[str]:
        return checkpoint_names(self, self.packed_modules)
