"""Qwen3-Omni talker: an MoE decoder that speaks in codec frames, and its code predictor
(code_predictor.py).

One talker step produces one frame of `num_code_groups` (G) codes:

    inputs_embeds (T, H) --talker MoE decoder (paged KV cache)--> hidden (T, H)
    codec_head(hidden[last]) --sample--> code 0                  (the engine samples it)
    code predictor, a small dense decoder run per frame, outside the paged cache:

        position:   0            1                 2                     G-1
        input:      hidden[last] emb_talker(c0)    emb_cp[0](c1)   ...   emb_cp[G-3](c_{G-2})
        predicts:                c1 = head[0]      c2 = head[1]    ...   c_{G-1} = head[G-2]

    next talker input = emb_talker(c0) + sum_g emb_cp[g-1](c_g)   (+ the thinker's text part,
                                                                   added by the caller)

The talker decoder is the thinker's (thinker.py) with a gated shared expert in every layer,
`model.codec_embedding` as input embedding and `codec_head` as head. `text_projection` and
`hidden_projection` map thinker embeddings / hidden states (thinker_hidden_size) into the
talker's width. Parameter names follow the checkpoint's `talker.*` one-to-one (after the
fused q/k/v, gate/up and expert weights).

Tensor parallelism splits the MoE decoder (thinker.py, moe.py) and the codec head. What the
stage runs on rank 0 alone, outside the engine's steps, stays whole on every rank and never
communicates: the codec embedding (its assistant opening rows, the feedback's code 0), the
text and hidden projections, and the code predictor (the feedback hook, run by rank 0 only;
its next-step embeddings reach the other ranks with the step's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from omnistage.layers.linear import Linear
from omnistage.layers.parallel import ParallelLMHead, replicated
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig
from omnistage.models.loader import checkpoint_names
from omnistage.models.qwen3_omni.code_predictor import CodePredictor
from omnistage.models.qwen3_omni.moe import expand_expert_names
from omnistage.models.loader import build_and_load
from omnistage.models.qwen3_omni.thinker import (PACKED_MODULES, Qwen3OmniMoeDecoder,
                                                 Qwen3OmniTextConfig, _model_config,
                                                 load_moe_model_weights)
from omnistage.utils import device_wait
from omnistage.utils.host import to_device


@dataclass(frozen=True, slots=True)
class Qwen3OmniTalkerConfig:
    text: Qwen3OmniTextConfig        # the MoE decoder
    code_predictor: ModelConfig      # the small dense decoder
    num_code_groups: int
    thinker_hidden_size: int

    @property
    def model(self) -> ModelConfig:
        return self.text.model

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> Qwen3OmniTalkerConfig:
        text = Qwen3OmniTextConfig.talker(hf_config)
        talker = hf_config.talker_config
        cp = talker.code_predictor_config
        num_groups = talker.num_code_groups
        if cp.num_code_groups != num_groups:
            raise ValueError(f"talker_config.code_predictor_config.num_code_groups "
                             f"{cp.num_code_groups} != talker_config.num_code_groups {num_groups}")
        if cp.hidden_size != text.model.hidden_size:
            raise ValueError(f"talker_config.code_predictor_config.hidden_size {cp.hidden_size}"
                             f" != talker text hidden_size {text.model.hidden_size}")
        if getattr(cp, "tie_word_embeddings", False):
            raise NotImplementedError("code_predictor_config.tie_word_embeddings is not supported")
        window = getattr(cp, "sliding_window", None)
        if "sliding_attention" in (getattr(cp, "layer_types", None) or ()) and window is not None \
                and window < num_groups + 1:
            raise NotImplementedError(f"code predictor sliding_window {window} < a frame's "
                                      f"{num_groups + 1} positions is not supported")
        return cls(text=text, code_predictor=_model_config(hf_config, cp, (), False),
                   num_code_groups=num_groups, thinker_hidden_size=talker.thinker_hidden_size)


# -- the talker --------------------------------------------------------------------------------

class Qwen3OmniTalkerModel(Qwen3OmniMoeDecoder):
    def __init__(self, cfg: Qwen3OmniTextConfig) -> None:
        super().__init__(cfg)
        mc = cfg.model
        self.codec_embedding = nn.Embedding(mc.vocab_size, mc.hidden_size,
                                            _weight=torch.empty(mc.vocab_size, mc.hidden_size))
        self.codec_embedding.weight.requires_grad_(False)


FRAME_CODES = "codes"     # a feedback row's extra: the frame's codes (G,)


def codec_feedback(talker: nn.Module, last_hidden: Tensor, code0: Tensor, seqs: list,
                   **sampling: object) -> tuple[Tensor, list]:
    """A talker's feedback hook (Qwen3-Omni's and Qwen3-TTS's): each sampled code 0 and its
    position's hidden state run the code predictor (`talker.predict_codes`) for the frame's
    other groups; the sum of the frame's codebook embeddings is what the next step feeds back.
    Greedy rows (temperature 0) predict greedily; sampling rows draw from the request's own
    generator (`sampling`: the predictor's top_k / top_p). -> next_input_embeds (B, H),
    [{"codes": (G,)}] per row."""
    temps = [max(s.sampling_params.temperature, 0.0) for s in seqs]
    greedy = all(t < 1e-5 for t in temps)     # decided on the host: no wait for the device
    temperature = 1.0 if greedy else to_device(temps, last_hidden.device)   # greedy: unused
    codes, embeds = talker.predict_codes(last_hidden, code0, greedy=greedy,
                                         temperature=temperature,
                                         generators=[s.generator for s in seqs], **sampling)
    # the frames leave the process at once: one copy to the host for all rows, once the
    # stage has used the wait (the thinker's chunks that came meanwhile; device_wait.py)
    device_wait.record_and_wait(codes.device)
    return embeds, [{FRAME_CODES: c} for c in codes.cpu().unbind(0)]


def codec_suppression(vocab_size: int, eos_token_ids: tuple[int, ...]) -> Tensor:
    """(vocab,) bool: the codec ids a talker never samples. The references (Qwen3-Omni's and
    Qwen3-TTS's) suppress the top 1024 ids, where the specials, speakers and languages live,
    all but EOS."""
    suppressed = torch.zeros(vocab_size, dtype=torch.bool)
    suppressed[max(0, vocab_size - 1024):] = True
    suppressed[list(eos_token_ids)] = False
    return suppressed


class ResizeMLP(nn.Module):
    """thinker width -> talker width: fc2(silu(fc1(x))), both with bias."""

    def __init__(self, in_features: int, intermediate_size: int, out_features: int) -> None:
        super().__init__()
        self.linear_fc1 = Linear(in_features, intermediate_size, bias=True)
        self.linear_fc2 = Linear(intermediate_size, out_features, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Qwen3OmniTalkerForCausalLM(CausalLM):
    packed_modules = PACKED_MODULES
    checkpoint_prefix = "talker."   # all of it: decoder, heads, projections, code predictor
    checkpoint_exclude: tuple[str, ...] = ()
    uses_mrope = True               # the runner passes (3, T) positions

    def __init__(self, config: Qwen3OmniTalkerConfig) -> None:
        super().__init__()
        self.config = config
        mc = config.model
        self.model = Qwen3OmniTalkerModel(config.text)
        if mc.tie_word_embeddings:       # the head is the (whole) codec embedding
            self.codec_head = Linear(mc.hidden_size, mc.vocab_size)
            self.codec_head.weight = self.model.codec_embedding.weight
        else:
            self.codec_head = ParallelLMHead(mc.vocab_size, mc.hidden_size)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, mc.intermediate_size,
                                         mc.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, mc.intermediate_size,
                                           mc.hidden_size)
        with replicated():
            self.code_predictor = CodePredictor(config.code_predictor, config.num_code_groups)
        self.register_buffer("suppressed", codec_suppression(mc.vocab_size, mc.eos_token_ids),
                             persistent=False)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen3OmniTalkerForCausalLM:
        """Build from config.json (talker_config) and load every `talker.*` tensor strictly;
        dtype None: the checkpoint's."""
        path = Path(path)
        config = Qwen3OmniTalkerConfig.from_hf(AutoConfig.from_pretrained(path))
        return build_and_load(cls, config, config.model, path, device, dtype)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.codec_embedding(input_ids)                # (T,) -> (T, hidden)

    def project_text(self, thinker_embeds: Tensor) -> Tensor:
        """Thinker token embeddings (N, thinker_hidden) -> (N, hidden)."""
        return self.text_projection(thinker_embeds)

    def project_hidden(self, thinker_hidden: Tensor) -> Tensor:
        """Thinker hidden states (N, thinker_hidden) -> (N, hidden)."""
        return self.hidden_projection(thinker_hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids (T,) codec ids (ignored where inputs_embeds (T, hidden) is given);
        positions (T,) or (3, T). Returns the final normed hidden (T, hidden)."""
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model.decode(h, positions, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, hidden) -> (N, vocab), suppressed ids at -inf (the reference's suppress_tokens
        of `generate(return_audio=True)`)."""
        logits = self.codec_head(hidden).float()
        return logits.masked_fill(self.suppressed, float("-inf"))

    def feedback(self, last_hidden: Tensor, code0: Tensor, seqs: list) -> tuple[Tensor, list]:
        """The AR runner's hook after sampling (`codec_feedback`), the code predictor drawing
        with the reference's top_k=50, top_p=0.8."""
        return codec_feedback(self, last_hidden, code0, seqs)

    def predict_codes(self, past_hidden: Tensor, code0: Tensor, **sampling: object
                      ) -> tuple[Tensor, Tensor]:
        """`CodePredictor.predict` with code 0 embedded by the talker: -> codes (B, G),
        next_input_embeds (B, hidden)."""
        return self.code_predictor.predict(past_hidden, code0, self.embed_input_ids(code0),
                                           **sampling)  # type: ignore[arg-type]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_moe_model_weights(self, weights, self.packed_modules)

    def checkpoint_names(self) -> set[str]:
        return expand_expert_names(checkpoint_names(self, self.packed_modules),
                                   self.config.text.moe.num_experts)
