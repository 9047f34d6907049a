"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): thinker, talker and code2wav, each a
stage of the served pipeline, each loading its part of the one checkpoint."""
