"""HunyuanImage-3.0 (Tencent): an autoregressive mixture-of-experts LLM that also generates images.
Text-to-image runs inside the transformer: the prompt's tokens, then a timestep token and the
noisy image latents as tokens (a UNet-style patch embedding in, another out), denoised by
flow matching with CFG; a Conv3D VAE decodes the latents. See docs/models/hunyuan-image3.md."""

from omnistage.models.hunyuan_image3.config import HunyuanImage3Config
from omnistage.models.hunyuan_image3.generate import GenerationRequest, generate_image
from omnistage.models.hunyuan_image3.model import HunyuanImage3

__all__ = ["HunyuanImage3", "HunyuanImage3Config", "GenerationRequest", "generate_image"]
