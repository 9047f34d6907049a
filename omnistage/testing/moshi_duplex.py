"""The duplex tests' tiny Moshi and their reference: a tiny random Moshi with the released
codec's framing (1920 samples a frame at 24 kHz: 12.5 Hz) and a context of 128 frames, and
Moshi's step-by-step output for a user's stream of codes, run on our golden-checked
`MoshiForConditionalGeneration` (models/moshi/model.py, equal to transformers' `generate`):

    path, ref = build_duplex_moshi(tmp_path / "moshi")      # ref: transformers' model
    text_ids, step_codes = duplex_reference(ours, user_codes)   # user_codes (K, N)

A session opens on the unconditional frame alone, then hears user frame r at position r + 1
(codebook 0 of frame r, codebooks 1.. of frame r - 1: the delay; BOS before frame 0), and
feeds back its own codes as `generate` does. text_ids (N + 1,) and step_codes (N + 1, K) are
the text token and the depth transformer's codes of each step; Moshi's aligned frame f
(f = 1 .. N) is [step_codes[f - 1][0], step_codes[f][1:]] (`aligned_frames`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.models.moshi.model import MoshiForConditionalGeneration, MoshiPrompt
from omnistage.testing.tiny_moshi import build_tiny_moshi

DUPLEX_MIMI = dict(upsampling_ratios=[8, 6, 5, 4], max_position_embeddings=8000)


def build_duplex_moshi(path: Path, seed: int = 0) -> tuple[Path, nn.Module]:
    return build_tiny_moshi(path, seed, mimi=DUPLEX_MIMI, max_position_embeddings=128)


@torch.inference_mode()
def duplex_reference(model: MoshiForConditionalGeneration, user_codes: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """Greedy text ids (N + 1,) and step codes (N + 1, K) for the user's codes (K, N)."""
    k, n = user_codes.shape
    bos = model.cfg.audio_vocab_size
    empty = torch.zeros((k, 0), dtype=torch.long)
    cache = model.decoder.new_cache()
    hidden, positions, valid = model.prefill(
        [MoshiPrompt(torch.zeros(0, dtype=torch.long), empty, empty)], cache)
    prev_user = torch.full((k,), bos, dtype=torch.long)
    texts, codes = [], []
    for r in range(n + 1):
        text = model.decoder.lm_head(hidden).argmax(-1)               # (1,)
        step = model.depth_decoder.generate(hidden, text)              # (1, K)
        texts.append(text[0])
        codes.append(step[0])
        if r == n:
            break
        moshi = step.clone()
        if r == 0:                 # the unconditional frame's acoustic codes are BOS
            moshi[:, 1:] = bos
        user = torch.cat([user_codes[:1, r], prev_user[1:]])[None]
        prev_user = user_codes[:, r]
        hidden, valid = model.step(hidden, text, moshi, user, positions, valid, cache)
        positions = positions + 1
    return torch.stack(texts), torch.stack(codes)


def aligned_frames(step_codes: Tensor) -> Tensor:
    """Step codes (S, K) -> Moshi's aligned frames (S - 1, K)."""
    return torch.cat([step_codes[:-1, :1], step_codes[1:, 1:]], 1)
