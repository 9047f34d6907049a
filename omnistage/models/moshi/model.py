"""Moshi (transformers' `MoshiForConditionalGeneration`): a full-duplex speech model. At every
12.5 Hz frame it reads the user's Mimi codes and its own, writes one text token (its inner
monologue) and K codes of its own speech:

    frame s input  = text_emb[text s] + sum_k emb[k][moshi code k] + sum_k emb[K + k][user code k]
      ─ temporal transformer (temporal.py) ─> h_s ─ lm_head ─> text token s + 1 (greedy)
      ─ depth transformer (depth.py) on (h_s, text s + 1) ─> K codes of frame s + 1

Acoustic codebooks run one frame late (the delay pattern): at input frame s codebook 0 is
frame s's and codebooks 1.. are frame s - 1's (the BOS id, audio_vocab_size, at s = 0). The
first frame is the unconditional one (text id vocab_size, every code audio_vocab_size), then
the prompt's frames; after the prompt the user is heard as silence (Mimi's codes of a frame of
zeros), as transformers' `generate` does. `generate` is that loop, greedy, over a batch of
prompts of different lengths (left-padded, each at its own positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.models.loader import load_component
from omnistage.models.moshi.config import MoshiConfig
from omnistage.models.moshi.depth import MoshiDepthDecoder
from omnistage.models.moshi.mimi import MimiModel
from omnistage.models.moshi.temporal import KVCache, MoshiForCausalLM


@dataclass(frozen=True, slots=True)
class MoshiPrompt:
    """One conversation's opening, T frames: text ids (T,), user and Moshi codes (K, T)."""
    text_ids: Tensor
    user_codes: Tensor
    moshi_codes: Tensor


@dataclass(frozen=True, slots=True)
class MoshiGeneration:
    text_ids: Tensor        # (B, N): the inner monologue, one token a frame
    audio_codes: Tensor     # (B, K, N - 1): Moshi's speech, aligned (the delay undone)


def delay_prompt(cfg: MoshiConfig, prompt: MoshiPrompt) -> tuple[Tensor, Tensor, Tensor]:
    """The unconditional frame and the prompt, as fed: text (P,), moshi / user (K, P),
    P = T + 1; acoustic codebooks one frame late."""
    t = prompt.text_ids.shape[0]
    for name in ("user_codes", "moshi_codes"):
        shape = tuple(getattr(prompt, name).shape)
        if shape != (cfg.num_codebooks, t):
            raise ValueError(f"{name}: shape {shape}, want ({cfg.num_codebooks}, {t})")
    text = torch.cat([prompt.text_ids.new_tensor([cfg.vocab_size]), prompt.text_ids])
    pad = prompt.user_codes.new_full((cfg.num_codebooks, 1), cfg.audio_vocab_size)
    out = []
    for codes in (prompt.moshi_codes, prompt.user_codes):
        aligned = torch.cat([pad, codes], 1)                         # (K, P)
        out.append(torch.cat([aligned[:1], torch.cat([pad[1:], aligned[1:, :-1]], 1)]))
    return text, out[0], out[1]


class MoshiForConditionalGeneration(nn.Module):
    def __init__(self, cfg: MoshiConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.ModuleList(nn.Embedding(cfg.audio_vocab_size + 1, cfg.hidden_size)
                                          for _ in range(2 * cfg.num_codebooks))
        self.audio_encoder = MimiModel(cfg.mimi)
        self.decoder = MoshiForCausalLM(cfg)
        self.depth_decoder = MoshiDepthDecoder(cfg.depth)

    def embed(self, text: Tensor, moshi: Tensor, user: Tensor) -> Tensor:
        """text (B, S), moshi / user codes as fed (delayed) (B, K, S) -> (B, S, hidden)."""
        k = self.cfg.num_codebooks
        h = self.decoder.model.embed_tokens(text)
        for i in range(k):
            h = h + self.embed_tokens[i](moshi[:, i]) + self.embed_tokens[k + i](user[:, i])
        return h

    def delayed(self, prompt: MoshiPrompt) -> tuple[Tensor, Tensor, Tensor]:
        return delay_prompt(self.cfg, prompt)

    def last_frames(self, prompt: MoshiPrompt) -> tuple[Tensor, Tensor]:
        """The prompt's last aligned Moshi and user frames (K,), whose acoustic codes are fed
        at the first generated frame."""
        return prompt.moshi_codes[:, -1], prompt.user_codes[:, -1]

    def prefill(self, prompts: list[MoshiPrompt], cache: KVCache
                ) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded prompts through the temporal transformer: (last hidden (B, hidden),
        next positions (B,), valid keys (B, P_max))."""
        rows = [self.delayed(p) for p in prompts]
        width = max(r[0].shape[0] for r in rows)
        k, a = self.cfg.num_codebooks, self.cfg.audio_vocab_size
        b = len(rows)
        dev = rows[0][0].device
        text = torch.full((b, width), self.cfg.vocab_size, dtype=torch.long, device=dev)
        moshi = torch.full((b, k, width), a, dtype=torch.long, device=dev)
        user = moshi.clone()
        lengths = torch.tensor([r[0].shape[0] for r in rows], device=dev)
        for i, (t, m, u) in enumerate(rows):
            text[i, width - t.shape[0]:], moshi[i, :, width - t.shape[0]:] = t, m
            user[i, :, width - t.shape[0]:] = u
        idx = torch.arange(width, device=dev)[None]
        start = (width - lengths)[:, None]
        valid = idx >= start                                              # (B, P)
        positions = (idx - start).clamp(min=0)
        causal = idx[0][None, :] <= idx[0][:, None]                       # (P, P)
        mask = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool,
                                                              device=dev)[None]
        h = self.decoder.model(self.embed(text, moshi, user), positions, mask, cache)
        return h[:, -1], lengths, valid

    def step(self, hidden: Tensor, text: Tensor, moshi: Tensor, user: Tensor,
             positions: Tensor, valid: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """One frame through the temporal transformer: text (B,), codes as fed (B, K) ->
        (hidden (B, hidden), valid keys (B, L + 1))."""
        valid = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], 1)
        emb = self.embed(text[:, None], moshi[..., None], user[..., None])
        h = self.decoder.model(emb, positions[:, None], valid[:, None, :], cache)
        return h[:, -1], valid

    def silence_codes(self) -> Tensor:
        """Mimi's codes (K,) of one frame of zeros: the user after the prompt."""
        mimi = self.audio_encoder
        w = mimi.downsample.conv.weight
        zeros = torch.zeros(1, 1, mimi.cfg.frame_size, device=w.device, dtype=w.dtype)
        return mimi.encode(zeros, self.cfg.num_codebooks)[0, :, 0]

    @torch.inference_mode()
    def generate(self, prompts: list[MoshiPrompt], num_frames: int) -> MoshiGeneration:
        """Greedy: N = num_frames text tokens per prompt and the N - 1 complete audio frames."""
        if num_frames < 1:
            raise ValueError(f"num_frames {num_frames}: at least 1")
        cache = self.decoder.new_cache()
        hidden, positions, valid = self.prefill(prompts, cache)
        last = [self.last_frames(p) for p in prompts]
        prompt_moshi = torch.stack([m for m, _ in last])                  # (B, K)
        prompt_user = torch.stack([u for _, u in last])
        silence = self.silence_codes().expand_as(prompt_user)
        texts, frames, prev = [], [], None
        for j in range(num_frames):
            text = self.decoder.lm_head(hidden).argmax(-1)                # (B,)
            codes = self.depth_decoder.generate(hidden, text)             # (B, K)
            texts.append(text)
            if prev is not None:       # codebook 0 of the frame before, the rest of this one
                frames.append(torch.cat([prev[:, :1], codes[:, 1:]], 1))
            if j == num_frames - 1:
                break
            moshi, user = codes.clone(), silence.clone()
            if j == 0:                 # acoustic codes still owed by the prompt's last frame
                moshi[:, 1:], user[:, 1:] = prompt_moshi[:, 1:], prompt_user[:, 1:]
            hidden, valid = self.step(hidden, text, moshi, user, positions, valid, cache)
            positions, prev = positions + 1, codes
        k = self.cfg.num_codebooks
        audio = (torch.stack(frames, 2) if frames
                 else prompt_moshi.new_zeros(len(prompts), k, 0))
        return MoshiGeneration(text_ids=torch.stack(texts, 1), audio_codes=audio)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> MoshiForConditionalGeneration:
        """A MoshiForConditionalGeneration folder as saved, strictly (the codebooks'
        `initialized` flags aside)."""
        cfg = MoshiConfig.from_pretrained(path)
        model = load_component(lambda: cls(cfg), Path(path), "", device, dtype, {},
                               ignore_suffixes=(".initialized",))
        return model.requires_grad_(False)
