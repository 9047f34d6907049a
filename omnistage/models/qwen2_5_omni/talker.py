"""Qwen2.5-Omni talker: the thinker's decoder (thinker.py) again, speaking in codec tokens, one
per step, fed the thinker's states.

    talker-space input = thinker_to_talker_proj(x), x in thinker space (its hidden width):

    prompt rows  p < P  (the thinker's prompt):  thinker embedding (media rows zeroed)
                                                 + thinker last hidden state
                 P                               embedding of the speaker's text bos + codec pad
                 P + 1                           the first reply token's row + codec bos
    decode t     codec embedding of the code sampled at step t + reply row t + 1
                 (reply row j = thinker embedding + last hidden state at the position of
                 the j-th generated text token; after the last: text eos once, then text pad)

    -> Qwen2 decoder with contiguous M-RoPE -> codec_head (codec bos suppressed)

Since the projection is linear, decode t = proj(codec emb) + W reply row: the engine embeds
the sampled code with the projection (`embed_input_ids`) and adds the stream row projected
without bias (`project_stream`), so the stage hands the engine talker-width rows only.
Parameter names follow the checkpoint's `talker.*` one-to-one (after the fused q/k/v, gate/up).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig

from omnistage.layers.linear import Linear
from omnistage.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig
from omnistage.models.loader import build_and_load, checkpoint_names, load_packed_weights
from omnistage.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniDecoderConfig


@dataclass(frozen=True, slots=True)
class Qwen2_5OmniTalkerConfig:
    decoder: Qwen2_5OmniDecoderConfig
    embedding_size: int              # the codec embedding's width: the thinker's hidden size
    codec_bos_id: int
    codec_pad_id: int
    codec_mask_id: int               # the ids beside the prompt rows (repetition penalty)
    text_eos_id: int                 # thinker-vocabulary ids the talker's input uses
    text_pad_id: int

    @property
    def model(self) -> ModelConfig:
        return self.decoder.model

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> Qwen2_5OmniTalkerConfig:
        """From the whole checkpoint's config (its talker_config). EOS: codec pad and codec end,
        the reference's `talker_eos_token_id` of generate()."""
        t = hf_config.talker_config
        eos = (t.tts_codec_pad_token_id, t.tts_codec_end_token_id)
        return cls(decoder=Qwen2_5OmniDecoderConfig.from_hf(hf_config, t, eos),
                   embedding_size=t.embedding_size, codec_bos_id=t.tts_codec_start_token_id,
                   codec_pad_id=t.tts_codec_pad_token_id,
                   codec_mask_id=t.tts_codec_mask_token_id,
                   text_eos_id=t.tts_text_end_token_id, text_pad_id=t.tts_text_pad_token_id)


class Qwen2_5OmniTalkerModel(Qwen2Model):
    """Qwen2's decoder with M-RoPE, fed embeddings only; its codec table `embed_tokens` is the
    thinker's width, embedding_size, not the decoder's."""

    def __init__(self, config: Qwen2_5OmniTalkerConfig) -> None:
        super().__init__(config.model, config.decoder.rotary_embedding())
        self.embed_tokens = VocabParallelEmbedding(config.model.vocab_size,
                                                   config.embedding_size)


class Qwen2_5OmniTalkerForCausalLM(CausalLM):
    packed_modules = Qwen2ForCausalLM.packed_modules
    checkpoint_prefix = "talker."   # all of it: codec embedding, projection, decoder, head
    checkpoint_exclude: tuple[str, ...] = ()
    uses_mrope = True               # the runner passes (3, T) positions
    stops_at_tokenizer_eos = False  # its outputs are codec ids, not text

    def __init__(self, config: Qwen2_5OmniTalkerConfig) -> None:
        super().__init__()
        self.config = config
        mc = config.model
        self.model = Qwen2_5OmniTalkerModel(config)
        self.thinker_to_talker_proj = Linear(config.embedding_size, mc.hidden_size, bias=True)
        self.codec_head = ParallelLMHead(mc.vocab_size, mc.hidden_size)
        suppressed = torch.zeros(mc.vocab_size, dtype=torch.bool)
        suppressed[config.codec_bos_id] = True       # the reference's suppress_tokens
        self.register_buffer("suppressed", suppressed, persistent=False)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen2_5OmniTalkerForCausalLM:
        """Build from config.json (talker_config) and load every `talker.*` tensor strictly;
        dtype None: the checkpoint's."""
        path = Path(path)
        config = Qwen2_5OmniTalkerConfig.from_hf(AutoConfig.from_pretrained(path))
        return build_and_load(cls, config, config.model, path, device, dtype)

    def embed_codes(self, codes: Tensor) -> Tensor:
        """Codec ids (T,) -> (T, embedding_size), in thinker space."""
        return self.model.embed_tokens(codes)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """Codec ids (T,) -> (T, hidden): embedded and projected into the decoder's width."""
        return self.project(self.embed_codes(input_ids))

    def project(self, x: Tensor) -> Tensor:
        """Thinker-space rows (N, embedding_size) -> the decoder's input (N, hidden)."""
        return self.thinker_to_talker_proj(x)

    def prompt_embeds(self, prompt_rows: Tensor, text_bos: Tensor, first_reply: Tensor
                      ) -> Tensor:
        """The prefill's input (P + 2, hidden) from thinker-space rows: the prompt's (P,
        embedding_size), the speaker's text bos embedding and the first reply row (each
        (embedding_size,)); the last two carry the codec pad and bos."""
        codec = self.embed_codes(torch.tensor([self.config.codec_pad_id,
                                               self.config.codec_bos_id],
                                              device=prompt_rows.device))
        tail = torch.stack([text_bos, first_reply]) + codec
        return self.project(torch.cat([prompt_rows, tail]))

    def project_stream(self, x: Tensor) -> Tensor:
        """Thinker-space rows added to a decode's codec embedding (N, embedding_size) ->
        (N, hidden): the projection without its bias, which `embed_input_ids` adds once."""
        return F.linear(x, self.thinker_to_talker_proj.weight)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids (T,) codec ids (ignored where inputs_embeds (T, hidden) is given);
        positions (T,) or (3, T). Returns the final normed hidden (T, hidden)."""
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(input_ids, positions, h, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, hidden) -> (N, vocab), the codec bos at -inf."""
        return self.codec_head(hidden).float().masked_fill(self.suppressed, float("-inf"))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.packed_modules)

    def checkpoint_names(self) -> set[str]:
        return checkpoint_names(self, self.packed_modules)
