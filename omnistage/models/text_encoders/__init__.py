"""Prompt encoders of the diffusion pipelines, loaded from a pipeline's `text_encoder*/`
folders (transformers layout) into our own modules:

    CLIPTextEncoder   CLIPTextModel      (FLUX text_encoder)    -> last hidden, pooled
    T5Encoder         T5EncoderModel     (FLUX text_encoder_2)  -> last hidden
    UMT5Encoder       UMT5EncoderModel   (Wan text_encoder)     -> last hidden
                      (encode_wan_prompts: Wan's padded, zeroed-past-the-prompt embeddings)
    QwenTextEncoder   Qwen2 / Qwen3 / Qwen2.5-VL text decoder   -> chosen hidden states
                      (Z-Image: hidden_states[-2]; Qwen-Image: hidden_states[-1])
    Gemma3TextEncoder Gemma 3's language model (LTX-2 text_encoder) -> every hidden state
                      (encode_ltx2_prompts: + LTX-2's connectors, models/ltx2_connectors.py)
"""

from omnistage.models.text_encoders.clip import CLIPTextEncoder
from omnistage.models.text_encoders.gemma3 import Gemma3TextEncoder
from omnistage.models.text_encoders.hunyuan_video15 import encode_hunyuan_video15_prompts
from omnistage.models.text_encoders.ltx2 import LTX2PromptEmbeds, encode_ltx2_prompts
from omnistage.models.text_encoders.qwen import QwenTextEncoder
from omnistage.models.text_encoders.t5 import T5Encoder
from omnistage.models.text_encoders.umt5 import UMT5Encoder, encode_wan_prompts

__all__ = ["CLIPTextEncoder", "Gemma3TextEncoder", "LTX2PromptEmbeds", "QwenTextEncoder",
           "T5Encoder", "UMT5Encoder", "encode_hunyuan_video15_prompts", "encode_ltx2_prompts",
           "encode_wan_prompts"]
