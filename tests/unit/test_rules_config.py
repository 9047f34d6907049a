"""Issue 39.4's rules for the stage configuration: StageConfig holds sub-records, not the flat
knobs they own, and an old flat key is refused with its new path."""

from __future__ import annotations

import dataclasses

import pytest

from omnistage.configs.engine_flags import engine_flags, fields_of
from omnistage.configs.parse import ConfigError, load_graph_yaml
from omnistage.configs.schema import MOVED, StageConfig

# what a stage itself says: what it runs, what it reads and where its output goes, its dtype,
# and one field per sub-record
STAGE_FIELDS = {"name", "kind", "component", "model", "inputs", "final", "dtype",
                "placement", "parallel", "timeouts", "ar", "diffusion", "generation"}


def flat_fields(cls: type) -> set[str]:
    """The fields of `cls` that a sub-record owns (an old flat key)."""
    return {f.name for f in dataclasses.fields(cls)} & set(MOVED)


def test_stage_config_has_no_flat_field_of_a_sub_record() -> None:
    names = {f.name for f in dataclasses.fields(StageConfig)}
    assert names == STAGE_FIELDS
    assert not flat_fields(StageConfig)


def test_the_checker_is_not_vacuous() -> None:
    @dataclasses.dataclass
    class Flat:
        name: str
        max_num_seqs: int = 64
        memory_fraction: float = 0.9

    assert flat_fields(Flat) == {"max_num_seqs", "memory_fraction"}
    assert len(MOVED) >= 30          # every old key of the flat StageConfig has a new place


@pytest.mark.parametrize("key", sorted(MOVED))
def test_every_old_flat_key_is_refused_with_its_new_path(key: str) -> None:
    kind = "diffusion" if key == "quantization" else "ar"
    with pytest.raises(ConfigError) as info:
        load_graph_yaml(f"stages: [{{name: s, kind: {kind}, {key}: 1}}]")
    new = MOVED[key].format(kind=kind)
    assert str(info.value) == f"stages[0].{key}: moved to stages[0].{new}"
    paths = {row.path for row in fields_of()}
    assert new in paths, new          # the new path exists in the tree


def test_every_flag_sets_a_field_of_the_tree() -> None:
    paths = {row.path for row in fields_of()}
    for flag in engine_flags():
        assert set(flag.paths.values()) <= paths, flag.name
