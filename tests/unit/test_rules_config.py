"""Issue 39.4's rules for the configuration: StageConfig holds sub-records, not the flat knobs
they own, and an old flat key is refused with its new path; every flag of `serve` is read off
the config tree (the server's off ServerSettings), none written by hand for a config field."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from omnistage.configs.engine_flags import engine_flags, fields_of
from omnistage.configs.parse import ConfigError, load_graph_yaml
from omnistage.configs.schema import MOVED, StageConfig
from omnistage.configs.server import ServerSettings, server_flags

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


# ---- the server flags: read off ServerSettings' fields, none written by hand in cli/ -------

CLI = Path(__file__).resolve().parents[2] / "omnistage" / "entrypoints" / "cli"
# flags of the server process that set no settings field (serve.py reads them)
PROCESS_FLAGS = {"--api-key-file", "--ssl-certfile", "--ssl-keyfile", "--uvicorn-log-level"}
# the flags of `omnistage bench` are a client's (the server it calls, that server's key)
CLIENT_MODULES = {"bench_args.py", "bench.py"}


def server_group_flags() -> dict[str, str]:
    """flag -> dest of every flag in the "server" group of `omnistage serve`."""
    import argparse

    from omnistage.entrypoints.cli.serve_args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    group = next(g for g in parser._action_groups if g.title == "server")
    return {a.option_strings[0]: a.dest for a in group._group_actions}


def test_every_server_flag_comes_from_a_server_settings_field() -> None:
    fields = {f.name for f in dataclasses.fields(ServerSettings)}
    derived = {f.flag: f.field for f in server_flags()}
    flags = server_group_flags()
    assert set(flags) == set(derived) | PROCESS_FLAGS
    for flag, dest in flags.items():
        if flag not in PROCESS_FLAGS:
            assert dest in fields and derived[flag] == dest, flag
    assert not {d for f, d in flags.items() if f in PROCESS_FLAGS} & fields


def hand_written_config_flags(source: str) -> list[str]:
    """The `add_argument` calls of `source` whose flag or dest names a ServerSettings field
    with a flag (`model` is the positional MODEL, not a flag)."""
    fields = {f.field for f in server_flags()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value.lstrip("-").replace("-", "_") for a in node.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        names += [k.value.value for k in node.keywords if k.arg == "dest"
                  and isinstance(k.value, ast.Constant)]
        found += [n for n in names if n in fields]
    return found


def test_no_cli_module_writes_a_server_flag_by_hand() -> None:
    for path in sorted(CLI.glob("*.py")):
        if path.name in CLIENT_MODULES:
            continue
        assert not hand_written_config_flags(path.read_text()), path.name


def test_the_hand_written_check_is_not_vacuous() -> None:
    src = 'g.add_argument("--max-queue", type=int)\ng.add_argument("--x", dest="port")\n'
    assert hand_written_config_flags(src) == ["max_queue", "port"]
