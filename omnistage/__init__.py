"""omnistage: an inference and serving engine for omni-modality models."""

from omnistage.sampling_params import SamplingParams

__all__ = ["AsyncOmni", "DiffusionParams", "Omni", "OmniOutput", "SamplingParams"]


def __getattr__(name: str):  # lazy: importing the package must not import torch-heavy modules
    if name == "Omni":
        from omnistage.entrypoints.omni import Omni

        return Omni
    if name == "AsyncOmni":
        from omnistage.engine.async_omni import AsyncOmni

        return AsyncOmni
    if name == "DiffusionParams":
        from omnistage.diffusion.params import DiffusionParams

        return DiffusionParams
    if name == "OmniOutput":
        from omnistage.outputs import OmniOutput

        return OmniOutput
    raise AttributeError(name)
