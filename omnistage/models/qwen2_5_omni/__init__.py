"""Qwen2.5-Omni (`Qwen2_5OmniForConditionalGeneration`): thinker, talker and token2wav."""
