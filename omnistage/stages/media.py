"""The media half of a Qwen-Omni thinker stage (Qwen3-Omni's and Qwen2.5-Omni's): a request's
audio / image / video features (what the input processor made at the front door) run through
the family's encoders, their outputs replace the placeholder embeddings, and the multimodal
rotary positions ride with the prompt.

    ThinkerMedia(engine, path, tokens, AudioEncoder, VisionEncoder)
    prompt_embeds, mm_input, cache_ids = media.request_inputs(prompt_token_ids, mm, embeds)

A vision encoder returns its merged tokens, or (tokens, deepstack features) where the thinker
adds inner-layer features to its visual rows (Qwen3-Omni).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import MultimodalInput
from omnistage.models.qwen3_omni.multimodal import SpecialTokens, merge_multimodal_embeddings
from omnistage.payloads import MM_POSITIONS, ROPE_DELTA

FEATURES = ("input_features", "pixel_values", "pixel_values_videos")


class ThinkerMedia:
    """A thinker's encoders, each loaded (in the engine's device and dtype) when a request
    first needs it, and the prompt inputs of a request that brings media."""

    def __init__(self, engine: AREngine, path: Path, tokens: SpecialTokens,
                 audio: type[nn.Module], vision: type[nn.Module]) -> None:
        self.engine, self.path, self.tokens = engine, path, tokens
        self.encoder_classes = dict(audio=audio, vision=vision)   # name -> from_pretrained
        self._encoders: dict[str, nn.Module] = {}

    def encoder(self, name: str) -> nn.Module:
        if name not in self._encoders:
            self._encoders[name] = self.encoder_classes[name].from_pretrained(  # type: ignore
                self.path, self.engine.device, self.engine.dtype).eval()
        return self._encoders[name]

    def request_inputs(self, prompt_token_ids: list[int] | None, mm: dict[str, Tensor] | None,
                       prompt_embeds: Tensor | None
                       ) -> tuple[Tensor | None, MultimodalInput | None, list[int] | None]:
        """(prompt embeddings, rotary positions and deepstack, prefix-cache ids) of a request:
        unchanged without media; the encoders' outputs merged in when it brings features."""
        if prompt_token_ids is None or not mm:
            return prompt_embeds, None, None
        mm_input, cache_ids = MultimodalInput(), None
        if MM_POSITIONS in mm:
            mm_input.positions = mm[MM_POSITIONS].long()
            mm_input.rope_delta = int(mm[ROPE_DELTA])
        if any(k in mm for k in FEATURES):
            ids = torch.tensor(prompt_token_ids, dtype=torch.long)
            prompt_embeds, mm_input.deepstack = self.embed(ids, mm)
            cache_ids = media_cache_ids(prompt_token_ids, mm, self.tokens)
        return prompt_embeds, mm_input, cache_ids

    @torch.inference_mode()
    def embed(self, ids: Tensor, mm: dict[str, Tensor]
              ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        dev, dtype = self.engine.device, self.engine.dtype
        text = self.engine.embed_input_ids(ids)             # (L, H); the other ranks join
        kw: dict[str, object] = {}
        if "input_features" in mm:
            kw["audio_embeds"] = self.encoder("audio")(
                mm["input_features"].to(dev, dtype), mm["audio_feature_lens"].to(dev))
        for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                                   ("video", "pixel_values_videos", "video_grid_thw")):
            if pixels in mm:
                out = self.encoder("vision")(mm[pixels].to(dev, dtype), mm[grid].to(dev))
                kw[f"{kind}_embeds"], kw[f"{kind}_deepstack"] = \
                    out if isinstance(out, tuple) else (out, ())
        merged = merge_multimodal_embeddings(ids.to(dev), text, self.tokens, **kw)
        rows = merged.deepstack_rows(0)
        deepstack = None if rows is None else (rows[0].cpu(), rows[1])
        return merged.inputs_embeds, deepstack


def media_cache_ids(ids: list[int], mm: dict[str, Tensor], tokens: SpecialTokens
                    ) -> list[int] | None:
    """The prompt's ids with each media item's placeholder run replaced by a digest of that
    item's features (negative: never a token id), for the prefix cache: an earlier turn's
    audio hits in the next turn's prompt, a different audio of the same length does not.
    None (not cached) when the runs do not match the items one to one."""
    items: dict[int, list[Tensor]] = {}
    if "input_features" in mm:                     # (mel, frames of every audio back to back)
        items[tokens.audio_pad] = list(mm["input_features"].split(
            mm["audio_feature_lens"].tolist(), dim=1))
    for pad, pixels, grid in ((tokens.image_pad, "pixel_values", "image_grid_thw"),
                              (tokens.video_pad, "pixel_values_videos", "video_grid_thw")):
        if pixels in mm:                           # (patches of every item back to back, dim)
            items[pad] = list(mm[pixels].split(mm[grid].prod(-1).tolist()))
    digests = {pad: [_digest(c) for c in chunks] for pad, chunks in items.items()}
    out, run_idx, prev = list(ids), {pad: -1 for pad in items}, None
    for j, tok in enumerate(ids):
        if tok in digests:
            if tok != prev:
                run_idx[tok] += 1
                if run_idx[tok] >= len(digests[tok]):
                    return None
            out[j] = digests[tok][run_idx[tok]]
        prev = tok
    if any(run_idx[pad] + 1 != len(d) for pad, d in digests.items()):
        return None
    return out


def _digest(t: Tensor) -> int:
    data = t.detach().float().cpu().contiguous().numpy().tobytes()
    return -1 - int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") // 2
