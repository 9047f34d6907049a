"""omnistage: an inference and serving engine for omni-modality models."""

from omnistage.sampling_params import SamplingParams

__all__ = ["AsyncOmni", "DiffusionParams", "Omni", "OmniOutput", "SamplingParams", "__version__"]


def _version() -> str:
    """The installed distribution's version; from a source tree that is not installed (or
    installed as another copy's editable link, whose metadata may lag), pyproject.toml's."""
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "omnistage" and "version" in project:
            return str(project["version"])
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omnistage")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()


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
