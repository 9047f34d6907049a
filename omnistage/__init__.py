"""omnistage: an inference and serving engine for omni-modality models."""

from omnistage.sampling_params import SamplingParams

__all__ = ["Omni", "SamplingParams", "OmniOutput"]


def __getattr__(name: str):  # lazy: importing the package must not import torch-heavy modules
    if name in ("Omni", "OmniOutput"):
        from omnistage.entrypoints import omni

        return getattr(omni, name)
    raise AttributeError(name)
