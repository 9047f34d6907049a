"""The thinker's inputs as the processor makes them (`ThinkerInputs`), its special tokens, and
the encoders' outputs merged into the token embeddings at their placeholders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    audio_start: int
    audio_pad: int
    audio_end: int
    vision_start: int
    image_pad: int
    video_pad: int
    vision_end: int

    @classmethod
    def from_hf(cls, thinker_config, tokenizer) -> SpecialTokens:
        """Placeholder ids from the thinker config; the end tokens (not in the config) by name."""
        def by_name(token: str) -> int:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise ValueError(f"tokenizer has no {token} token")
            return token_id
        return cls(audio_start=thinker_config.audio_start_token_id,
                   audio_pad=thinker_config.audio_token_id, audio_end=by_name("<|audio_end|>"),
                   vision_start=thinker_config.vision_start_token_id,
                   image_pad=thinker_config.image_token_id,
                   video_pad=thinker_config.video_token_id, vision_end=by_name("<|vision_end|>"))


@dataclass(slots=True)
class ThinkerInputs:
    """One request's thinker inputs, placeholders expanded."""
    input_ids: Tensor                              # (L,) int64
    positions: Tensor                              # (3, L) int64: mrope t / h / w
    rope_delta: int                                # decode positions: L + n + rope_delta
    prompt: str                                    # templated text, one placeholder per item
    input_features: Tensor | None = None           # (num_mel, total_frames) f32, back to back
    audio_feature_lens: Tensor | None = None       # (num_audios,) int64 mel frames
    pixel_values: Tensor | None = None             # (num_patches, C*tp*p*p) f32
    image_grid_thw: Tensor | None = None           # (num_images, 3) int64
    pixel_values_videos: Tensor | None = None      # (num_video_patches, C*tp*p*p) f32
    video_grid_thw: Tensor | None = None           # (num_videos, 3) int64
    video_second_per_grid: Tensor | None = None    # (num_videos,) f32

    def hf_kwargs(self) -> dict[str, Tensor]:
        """The same inputs as HF's thinker `forward` takes them (a batch of one; audio padded
        to (num_audios, num_mel, max_frames) with `feature_attention_mask`)."""
        out: dict[str, Tensor] = {"input_ids": self.input_ids[None],
                                  "attention_mask": torch.ones_like(self.input_ids)[None]}
        if self.input_features is not None:
            lens = self.audio_feature_lens.tolist()
            chunks = self.input_features.split(lens, dim=1)
            out["input_features"] = torch.nn.utils.rnn.pad_sequence(
                [c.T for c in chunks], batch_first=True).transpose(1, 2)
            out["feature_attention_mask"] = (torch.arange(max(lens))[None, :]
                                             < self.audio_feature_lens[:, None]).long()
        for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                     "video_second_per_grid"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(slots=True)
class MultimodalEmbeddings:
    inputs_embeds: Tensor                # (L, hidden): encoder outputs at their placeholders
    visual_mask: Tensor | None           # (L,) bool: image and video placeholder positions
    # per deepstack layer (num_visual, hidden), visual tokens in sequence order; the thinker
    # adds layer i's to the visual rows after its decoder layer i
    deepstack: list[Tensor] = field(default_factory=list)

    def deepstack_rows(self, offset: int = 0) -> tuple[Tensor, Tensor] | None:
        """(rows (K,), features (num_deepstack, K, hidden)), the thinker's `deepstack`
        argument; `offset` is this request's first row in the flattened batch."""
        if self.visual_mask is None or not self.deepstack:
            return None
        rows = self.visual_mask.nonzero().squeeze(1) + offset
        return rows, torch.stack(self.deepstack)


def merge_multimodal_embeddings(input_ids: Tensor, inputs_embeds: Tensor, tokens: SpecialTokens,
                                audio_embeds: Tensor | None = None,
                                image_embeds: Tensor | None = None,
                                video_embeds: Tensor | None = None,
                                image_deepstack: Sequence[Tensor] = (),
                                video_deepstack: Sequence[Tensor] = ()) -> MultimodalEmbeddings:
    """Scatter encoder outputs into the text embeddings (L, hidden) at their placeholder tokens,
    in order, and gather the deepstack features of all visual tokens in sequence order."""
    out = inputs_embeds.clone()
    masks: dict[str, Tensor] = {}
    for kind, token, embeds in (("audio", tokens.audio_pad, audio_embeds),
                                ("image", tokens.image_pad, image_embeds),
                                ("video", tokens.video_pad, video_embeds)):
        mask = input_ids == token
        if embeds is None:
            if mask.any():
                raise ValueError(f"input_ids have {int(mask.sum())} {kind} placeholders but no "
                                 f"{kind} embeddings were given")
            continue
        if int(mask.sum()) != embeds.shape[0]:
            raise ValueError(f"{kind}: {int(mask.sum())} placeholder tokens but "
                             f"{embeds.shape[0]} embeddings")
        out[mask] = embeds.to(out.dtype)
        masks[kind] = mask
    if "image" not in masks and "video" not in masks:
        return MultimodalEmbeddings(out, None)
    visual = masks.get("image", torch.zeros_like(input_ids, dtype=torch.bool)) | \
        masks.get("video", torch.zeros_like(input_ids, dtype=torch.bool))
    num_layers = max(len(image_deepstack), len(video_deepstack))
    deepstack = []
    for layer in range(num_layers):
        joint = out.new_zeros(int(visual.sum()), out.shape[-1])
        for kind, features in (("image", image_deepstack), ("video", video_deepstack)):
            if kind in masks:
                if len(features) != num_layers:
                    raise ValueError(f"{kind}_deepstack has {len(features)} layers, expected "
                                     f"{num_layers}")
                joint[masks[kind][visual]] = features[layer].to(out.dtype)
        deepstack.append(joint)
    return MultimodalEmbeddings(out, visual, deepstack)
