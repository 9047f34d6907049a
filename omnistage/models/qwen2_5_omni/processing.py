"""Chat request -> Qwen2.5-Omni thinker inputs: Qwen3-Omni's input processor
(qwen3_omni/processing.py: chat template, WhisperFeatureExtractor, the PIL Qwen2-VL image
processor, frames -> video patches, placeholder expansion, M-RoPE positions) with what
`Qwen2_5OmniProcessor` and `get_rope_index` do differently:

    audio features   padded to the feature extractor's 30 s window before the real frames are
                     kept (the reference's `padding="max_length"`: the last frames of an audio
                     see zeros, not its reflection)
    audio tokens     output_lengths: ceil(frames / 2), then halved by the encoder's pooling
    video positions  t * seconds_per_grid * position_id_per_seconds rounded down (float32)
    special tokens   from the thinker config (the released tokenizer names them
                     <|audio_bos|> / <|AUDIO|> / <|vision_eos|>, not Qwen3-Omni's names)

    audio in video   a video's track (`use_audio_in_video`) interleaved with it by chunks of
                     seconds_per_chunk (2 s), not token by token; <|vision_start|> and
                     <|audio_start|> share a position, and so do the two end tokens
"""

from __future__ import annotations

from torch import Tensor

from omnistage.models.qwen2_5_omni.audio_encoder import output_lengths
from omnistage.models.qwen3_omni.audio_in_video import by_chunks, tokens_per_chunk
from omnistage.models.qwen3_omni.multimodal import SpecialTokens
from omnistage.models.qwen3_omni.processing import InputProcessor


class Qwen2_5OmniInputProcessor(InputProcessor):
    """`processor(messages) -> ThinkerInputs` for chat messages with text, audio, image and
    video parts (the parts of InputProcessor)."""

    audio_padding = "max_length"
    truncate_time = True
    shared_brackets = True
    seconds_per_chunk = 2.0     # the reference processor's and the released config's

    @staticmethod
    def special_tokens(thinker_config, tokenizer) -> SpecialTokens:
        """Placeholder ids from the thinker config, end tokens included (the released
        tokenizer names them differently from Qwen3-Omni's)."""
        names = {"audio_start": "audio_start_token_id", "audio_pad": "audio_token_id",
                 "audio_end": "audio_end_token_id", "vision_start": "vision_start_token_id",
                 "image_pad": "image_token_id", "video_pad": "video_token_id",
                 "vision_end": "vision_end_token_id"}
        missing = [v for v in names.values() if getattr(thinker_config, v, None) is None]
        if missing:
            raise ValueError(f"config.json thinker_config has no {', '.join(missing)}")
        return SpecialTokens(**{k: int(getattr(thinker_config, v)) for k, v in names.items()})

    def audio_tokens(self, feature_lens: Tensor) -> Tensor:
        return output_lengths(feature_lens)

    def interleave(self, video_times: list[float], num_audio: int) -> list[tuple[bool, int]]:
        return by_chunks(video_times, num_audio,
                         tokens_per_chunk(self.position_id_per_seconds, self.seconds_per_chunk))
