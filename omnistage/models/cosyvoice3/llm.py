"""CosyVoice3's speech-token LM: a Qwen2 decoder fed embeddings, speaking speech tokens.

    prompt rows: [sos | text embeddings (prompt text ... <|endofprompt|> ... text) | task_id |
                  prompt speech-token embeddings]
    decode t:    speech_embedding(token sampled at t)
    -> Qwen2 (its own final norm) -> llm_decoder -> logits over speech_token_size + 200 ids;
       ids from speech_token_size on stop (the first is EOS, suppressed for min_len steps)

sos, eos and task_id are rows of `speech_embedding` (speech_token_size + 0, + 1, + 2); the text
rows come from Qwen2's own `embed_tokens`, whose `lm_head` is never used. Parameter names follow
the released llm.pt (`llm.model.model.*`, `llm.model.lm_head.weight`, `llm_decoder.weight`,
`speech_embedding.weight`); the decoder's config is the folder's CosyVoice-BlankEN/config.json.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoConfig

from omnistage.layers.linear import Linear
from omnistage.layers.parallel import VocabParallelEmbedding
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig
from omnistage.models.loader import load_packed_weights
from omnistage.models.qwen2 import Qwen2ForCausalLM

ENDOFPROMPT = 151646          # <|endofprompt|>: upstream asserts it is in the text
NUM_STOP_IDS = 200


class _Encoder(nn.Module):
    """Upstream's Qwen2Encoder: only its name (`llm.model`) survives."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(config)


class CosyVoice3LM(CausalLM):
    packed_modules = Qwen2ForCausalLM.packed_modules
    stops_at_tokenizer_eos = False        # its outputs are speech tokens, not text ids

    def __init__(self, config: ModelConfig, speech_token_size: int) -> None:
        super().__init__()
        self.config, self.speech_token_size = config, speech_token_size
        self.llm = _Encoder(config)
        self.llm_decoder = Linear(config.hidden_size, speech_token_size + NUM_STOP_IDS, bias=False)
        self.speech_embedding = VocabParallelEmbedding(speech_token_size + NUM_STOP_IDS,
                                                       config.hidden_size)

    @property
    def model_config(self) -> ModelConfig:
        return self.config

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.speech_token_size + NUM_STOP_IDS))

    @classmethod
    def from_pretrained(cls, path: str | Path, speech_token_size: int,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                        ) -> CosyVoice3LM:
        path = Path(path)
        hf = AutoConfig.from_pretrained(path / "CosyVoice-BlankEN")
        config = ModelConfig.from_hf(hf)
        with torch.device(device):
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = cls(config, speech_token_size)
            finally:
                torch.set_default_dtype(default)
        state = torch.load(path / "llm.pt", map_location=device, weights_only=True)
        with torch.no_grad():
            loaded = model.load_weights((n, t.to(dtype)) for n, t in state.items())
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"{path / 'llm.pt'}: missing {sorted(missing)[:8]}")
        return model.eval()

    def prompt_embeds(self, text_ids: Tensor, prompt_speech: Tensor) -> Tensor:
        """text_ids (N,) = prompt text then text (with <|endofprompt|>), prompt_speech (P,) ->
        the prefill's rows (N + P + 2, hidden)."""
        if not bool((text_ids == ENDOFPROMPT).any()):
            raise ValueError("text: no <|endofprompt|> (151646) in the prompt text or text")
        s = self.speech_token_size
        special = self.speech_embedding(torch.tensor([s, s + 2], device=text_ids.device))
        text = self.llm.model.embed_input_ids(text_ids)
        return torch.cat([special[:1], text, special[1:], self.speech_embedding(prompt_speech)])

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.speech_embedding(input_ids)                      # (T,) -> (T, hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.llm.model(input_ids, positions, h, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.llm_decoder(hidden).float()                      # (N, hidden) -> (N, V)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.packed_modules)
