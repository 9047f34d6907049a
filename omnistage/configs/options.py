"""A component's own options, typed: each stage class, generation model and diffusion pipeline
declares `Options`, a frozen record of what its stage's `options:` mapping may hold, and reads
that mapping through `read_options` when the stage is built, before anything loads. A misspelt
key fails with a did-you-mean, a wrong type with the expected one:

    stage 'talker': ar.options.code_predictor_cuda_graph: unknown key (did you mean
    code_predictor_cuda_graphs?)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from omnistage.configs.strict import from_dict

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NoOptions:
    """The options of a component that takes none."""


def read_options(record: type[T], data: Mapping[str, object], where: str) -> T:
    """`data` (a stage's `options:` mapping) as `record`, checked strictly; `where` starts the
    message of a bad key or value ("stage 'talker': ar.options")."""
    return from_dict(record, dict(data), where)
