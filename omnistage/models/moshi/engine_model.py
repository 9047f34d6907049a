"""Moshi's per-frame step on the AR engine (a `CausalLM`): the temporal transformer on the
paged KV cache, the text head as the logits, the depth transformer in the feedback hook.

    prompt   `prompt_embeds(prompt)`: the unconditional frame and the delayed prompt (P rows)
    step j   the text token of frame P + j is sampled from the text head; the feedback hook runs
             the depth transformer on (last hidden, text token) -> K codes (the step's extra,
             greedy) and feeds back text emb + emb[0](code 0) + emb[k](code k), k >= 1; at
             j = 0 without the acoustic ones, which the prompt's last frame still owes
    user     the request's stream rows (`user_rows`): row 0 the prompt's owed acoustic codes
             (Moshi's and the user's) and the user's silence code 0; past it, the silence row

The delay needs no state in the hook: aligned frame f is codebook 0 of step f's codes with
codebooks 1.. of step f + 1's (`join_frames`). The temporal transformer is Qwen2's layers
without biases (models/qwen2.py), loaded from Moshi's checkpoint names by renaming.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig
from omnistage.models.loader import (checkpoint_names, component_tensor_files,
                                     iter_component_tensors, load_packed_weights)
from omnistage.models.moshi.config import MoshiConfig
from omnistage.models.moshi.depth import MoshiDepthDecoder
from omnistage.models.moshi.model import MoshiPrompt, delay_prompt
from omnistage.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from omnistage.models.qwen3_omni.talker import FRAME_CODES


AUDIO_TEMPERATURE, AUDIO_TOP_K = "audio_temperature", "audio_top_k"   # SamplingParams.extra


def audio_sampling(seqs: list, num_codebooks: int, vocab: int, device: torch.device
                   ) -> tuple[Tensor, Tensor, Tensor] | None:
    """The depth transformer's per-row sampling (temperature (B,), top_k (B,), noise
    (B, K, vocab)) from each request's SamplingParams.extra (AUDIO_TEMPERATURE, AUDIO_TOP_K),
    or None when every row is greedy. A seeded request's noise comes from its own generator
    (the one its text tokens are drawn from, after them), so its frames depend only on its
    seed; the others' from the global one."""
    temps = [float(s.sampling_params.extra.get(AUDIO_TEMPERATURE, 0.0)) for s in seqs]
    if not any(t > 0 for t in temps):
        return None
    noise = torch.ones(len(seqs), num_codebooks, vocab, device=device)
    for i, (seq, t) in enumerate(zip(seqs, temps)):
        if t > 0:
            noise[i].exponential_(generator=_generator(seq, device))
    top_k = [int(s.sampling_params.extra.get(AUDIO_TOP_K, 0)) for s in seqs]
    return (torch.tensor(temps, device=device), torch.tensor(top_k, device=device), noise)


def _generator(seq: object, device: torch.device) -> torch.Generator | None:
    """The request's own generator where it has a seed (made as the engine's sampler makes
    it, if its text was greedy), else None (the global one)."""
    seed = seq.sampling_params.seed                                  # type: ignore[attr-defined]
    if seed is None:
        return None
    if seq.generator is None:                                        # type: ignore[attr-defined]
        seq.generator = torch.Generator(device=device).manual_seed(seed)  # type: ignore
    return seq.generator                                             # type: ignore[attr-defined]


def temporal_config(cfg: MoshiConfig) -> ModelConfig:
    return ModelConfig(
        architecture="MoshiForConditionalGeneration", model_type="moshi",
        vocab_size=cfg.vocab_size + 1, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_dim // 2, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope["rope_theta"], max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=cfg.rope)


def _renamed(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Moshi's names -> Qwen2's (before packing): `decoder.model.*` -> `model.*`, the
    projections' `.linear` nesting dropped, `fc1` = [gate; up] split, `fc2` -> `down_proj`."""
    for name, tensor in weights:
        if name.startswith("decoder."):
            name = name[len("decoder."):].replace("_proj.linear.", "_proj.")
            if name.endswith("mlp.fc1.weight"):
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace("fc1", "gate_proj"), gate
                yield name.replace("fc1", "up_proj"), up
                continue
            name = name.replace("mlp.fc2.", "mlp.down_proj.")
        yield name, tensor


class MoshiStepLM(CausalLM):
    packed_modules = Qwen2ForCausalLM.packed_modules
    keeps_last_extras = True          # a request's last step's codes are real output too
    stops_at_tokenizer_eos = False    # its text has no end: the request's max_tokens ends it

    def __init__(self, cfg: MoshiConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model_config = temporal_config(cfg)
        self.model = Qwen2Model(self.model_config)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.embed_tokens = nn.ModuleList(nn.Embedding(cfg.audio_vocab_size + 1, cfg.hidden_size)
                                          for _ in range(2 * cfg.num_codebooks))
        self.depth_decoder = MoshiDepthDecoder(cfg.depth)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)                   # text ids (T,) -> (T, H)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        return self.model(input_ids, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()                         # (N, H) -> (N, vocab)

    def codes_embeds(self, codes: Tensor, first: int, last: int) -> Tensor:
        """(B, K) codes -> sum of embed_tokens[first + k](code k) for k in [0, last - first)."""
        return sum(self.embed_tokens[first + k](codes[:, k]) for k in range(last - first))

    @torch.no_grad()
    def feedback(self, last: Tensor, ids: Tensor, seqs: list) -> tuple[Tensor, list]:
        """-> the next inputs (B, H) and per row {FRAME_CODES: (K,)} (codes greedy, or sampled
        where a request asks (`audio_sampling`), left on the model's device: the duplex stage
        reads every session's back in one copy a tick)."""
        codes = self.depth_decoder.generate(last, ids, audio_sampling(
            seqs, self.cfg.num_codebooks, self.depth_decoder.cfg.audio_vocab_size,
            last.device))                                            # (B, K)
        # the hook runs before the step's embedding is recorded: none yet = the first frame
        later = torch.tensor([len(s.output_embeds) > 0 for s in seqs], device=last.device)
        acoustic = sum(self.embed_tokens[k](codes[:, k]) for k in range(1, codes.shape[1]))
        embeds = (self.model.embed_tokens(ids) + self.embed_tokens[0](codes[:, 0])
                  + acoustic * later[:, None].to(last.dtype))
        return embeds.to(last.dtype), [{FRAME_CODES: c} for c in codes.unbind(0)]

    @torch.no_grad()
    def prompt_embeds(self, prompt: MoshiPrompt) -> Tensor:
        text, moshi, user = delay_prompt(self.cfg, prompt)          # (P,), (K, P), (K, P)
        h = self.model.embed_tokens(text)
        return h + self.codes_embeds(moshi.T, 0, self.cfg.num_codebooks) + sum(
            self.embed_tokens[self.cfg.num_codebooks + k](user[k]) for k in range(user.shape[0]))

    @torch.no_grad()
    def user_rows(self, prompt: MoshiPrompt, silence: Tensor) -> tuple[Tensor, Tensor]:
        """A request's stream: row 0 (1, H) and the row past it (H,), from the prompt and the
        user's silence codes (K,) (`MoshiForConditionalGeneration.silence_codes`)."""
        k = self.cfg.num_codebooks
        owed_moshi, owed_user = prompt.moshi_codes[:, -1], prompt.user_codes[:, -1]
        first_user = torch.cat([silence[:1], owed_user[1:]])
        row0 = (sum(self.embed_tokens[i](owed_moshi[i:i + 1]) for i in range(1, k))
                + sum(self.embed_tokens[k + i](first_user[i:i + 1]) for i in range(k)))
        pad = sum(self.embed_tokens[k + i](silence[i:i + 1]) for i in range(k))
        return row0, pad[0]

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> MoshiStepLM:
        """Every tensor of the Moshi folder but the codec's, strictly."""
        cfg = MoshiConfig.from_pretrained(path)
        with torch.device(device):
            model = cls(cfg)
        if dtype is not None:
            model = model.to(dtype)
        files = component_tensor_files(Path(path), "", ("audio_encoder.",))
        seen: list[str] = []

        def recorded() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in _renamed(iter_component_tensors(files, "")):
                seen.append(name)
                yield name, tensor

        tensors = list(recorded())
        # q/k/v packing only for the temporal transformer (the depth one keeps its names)
        loaded = load_packed_weights(model, [t for t in tensors if t[0].startswith("model.")],
                                     model.packed_modules)
        loaded |= load_packed_weights(model, [t for t in tensors
                                              if not t[0].startswith("model.")], {})
        expected = ({n for n in checkpoint_names(model, model.packed_modules)
                     if n.startswith("model.")}
                    | {n for n in checkpoint_names(model, {}) if not n.startswith("model.")})
        if set(seen) != expected:
            raise ValueError(f"{path}: tensors missing {sorted(expected - set(seen))[:5]}, "
                             f"unexpected {sorted(set(seen) - expected)[:5]}")
        assert loaded == {n for n, _ in model.named_parameters()}, "parameters not loaded"
        return model.eval().requires_grad_(False)


def join_frames(codes: list[Tensor]) -> Tensor:
    """A request's per-step codes (K,) each -> its aligned frames (K, steps - 1)."""
    return torch.stack([torch.cat([a[:1], b[1:]]) for a, b in zip(codes, codes[1:])], 1)
