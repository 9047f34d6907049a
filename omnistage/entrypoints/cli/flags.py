"""Flag handling shared by the subcommands: `--config FILE` (flags from YAML, as vLLM's) and a
did-you-mean for a flag that does not exist.

    # serve.yaml: keys are flag names, with dashes or underscores
    model: ./qwen3-0.6b
    max-num-seqs: 32
    enable_prefix_caching: false
    allowed-media-dirs: [/data/images, /data/audio]

`omnistage serve --config serve.yaml --max-num-seqs 8` serves with 8: the file's flags go before
the command line's, whose value wins; repeatable flags collect both.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from omnistage.configs.parse import ConfigError, load_yaml

# the file's `model` travels under this hidden flag: the command line's MODEL wins over it
FILE_MODEL_FLAG = "--model-from-config"


def suggest(token: str, parser: argparse.ArgumentParser) -> str:
    """'unrecognized argument --x' plus the closest flag of `parser`, if one is close."""
    name = token.split("=", 1)[0]
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    hint = difflib.get_close_matches(name, flags, n=1)
    return f"unrecognized argument {name}" + (f" (did you mean {hint[0]}?)" if hint else "")


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with the flags of `--config FILE` inserted after the subcommand (argv[0])."""
    path = _config_path(argv) if "--config" in parser._option_string_actions else None
    if path is None:
        return argv
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read ({e.strerror or e})") from None
    data = load_yaml(text, path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values")
    tokens: list[str] = []
    for key, value in data.items():
        tokens += _tokens(path, str(key), value, parser)
    return [argv[0], *tokens, *argv[1:]]


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--":
            return None
        if token == "--config":
            if i + 1 == len(argv):
                return None   # argparse says "expected one argument"
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def _tokens(path: str, key: str, value: object, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line tokens of one `key: value` of the file."""
    name = key.replace("_", "-")
    if name == "model":
        return [f"{FILE_MODEL_FLAG}={value}"]
    flag = "--" + name
    action = parser._option_string_actions.get(flag)
    if name in ("config", "help", "version") or flag == FILE_MODEL_FLAG:
        raise ConfigError(f"{path}: {key}: not a flag a --config file can set")
    if action is None:
        hint = difflib.get_close_matches(flag, [f for f in parser._option_string_actions
                                                if f.startswith("--")], n=1)
        raise ConfigError(f"{path}: {key}: not a flag of this command"
                          + (f" (did you mean {hint[0].removeprefix('--')}?)" if hint else ""))
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if _boolean(path, key, value) else f"--no-{name}"]
    if action.nargs == 0:   # store_true
        return [flag] if _boolean(path, key, value) else []
    values = value if isinstance(value, list) else [value]
    if len(values) != 1 and not isinstance(action, argparse._AppendAction):
        raise ConfigError(f"{path}: {key}: expected one value, got a list of {len(values)}")
    return [f"{flag}={_text(v)}" for v in values]


def _boolean(path: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: {key}: expected true or false, got {value!r}")
    return value


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)
