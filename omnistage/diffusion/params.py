"""Moved to omnistage/diffusion_params.py (the bottom floor, beside sampling_params.py); these
names stay importable from here until the imports are rewritten."""

from omnistage.diffusion_params import (DEFAULT_STRENGTH, MAX_FRAMES, MAX_GUIDANCE,
                                        MAX_IMAGES, MAX_INPUT_IMAGES, MAX_SIDE, MAX_STEPS,
                                        DiffusionParams, ImageRef, check_size)

__all__ = ["DEFAULT_STRENGTH", "MAX_FRAMES", "MAX_GUIDANCE", "MAX_IMAGES", "MAX_INPUT_IMAGES",
           "MAX_SIDE", "MAX_STEPS", "DiffusionParams", "ImageRef", "check_size"]
