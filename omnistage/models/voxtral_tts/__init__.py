"""Voxtral-TTS (Mistral, issue 43): the codec decoder, the flow-matching generation head and the
packed audio embedding, read from the release's params.json + consolidated.safetensors."""

from omnistage.models.voxtral_tts.codec import VoxtralCodecDecoder
from omnistage.models.voxtral_tts.config import CodecConfig, HeadConfig, read_params
from omnistage.models.voxtral_tts.head import VoxtralAudioEmbedding, VoxtralFlowHead

__all__ = ["CodecConfig", "HeadConfig", "VoxtralAudioEmbedding", "VoxtralCodecDecoder",
           "VoxtralFlowHead", "read_params"]
