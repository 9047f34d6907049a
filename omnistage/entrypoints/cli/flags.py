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
from typing import NoReturn

from omnistage.configs.parse import ConfigError, load_yaml

# the file's `model` travels under this hidden flag: the command line's MODEL wins over it
FILE_MODEL_FLAG = "--model-from-config"


# flags of vLLM / vLLM-Omni with no counterpart here: what to do instead
PP_HINT = ("not supported: pipeline parallelism; a model runs as a graph of stages (split it "
           "with --stage-config), or use -tp")
FOREIGN_FLAGS: dict[str, str] = {
    "--pipeline-parallel-size": PP_HINT,
    "-pp": PP_HINT,
    "--kv-cache-dtype": "not supported: the KV cache takes the stage's dtype (--dtype)",
    "--reasoning-parser": "not supported: a model's reasoning stays in the answer's content",
    "--tool-call-parser": "not supported: tool calling",
    "--enable-auto-tool-choice": "not supported: tool calling",
    "--swap-space": "not needed: preempted requests are recomputed, never swapped",
    "--cpu-offload-gb": "not supported: weights are not offloaded; lower memory use with "
                        "--gpu-memory-utilization or --dtype",
    "--download-dir": "not needed: nothing is downloaded; pass a local folder or a cached HF id "
                      "as MODEL",
    "--revision": "not supported: pass the folder of the revision as MODEL",
    "--load-format": "not needed: weights are read from the checkpoint's safetensors files",
    "--limit-mm-per-prompt": "not supported per modality: use --max-media-parts N (media parts "
                             "of one chat request, all modalities together)",
    "--speculative-config": "not supported: speculative decoding",
}
# flags of vLLM with a counterpart of the same meaning here under another name
VLLM_ALIASES: dict[str, str] = {"--allowed-local-media-path": "--allowed-media-dirs"}
HINT_CUTOFF = 0.75   # difflib ratio of the names without dashes; below it a hint misleads


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: the 40-line usage of `serve` would hide
    the message it comes with; --help still shows it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def suggest(token: str, parser: argparse.ArgumentParser) -> str:
    """'unrecognized argument --x', with what to do instead for a flag of vLLM / vLLM-Omni we
    do not have, else the closest flag of `parser` if it is close enough to be meant."""
    name = token.split("=", 1)[0]
    if name in FOREIGN_FLAGS:
        return f"{name}: {FOREIGN_FLAGS[name]}"
    hint = closest_flag(name, parser)
    return f"unrecognized argument {name}" + (f" (did you mean {hint}?)" if hint else "")


def closest_flag(name: str, parser: argparse.ArgumentParser) -> str | None:
    """The flag of `parser` closest to `name`, compared without leading dashes; None when
    nothing is close."""
    flags = {f.lstrip("-"): f for f in parser._option_string_actions if f.startswith("--")}
    hint = difflib.get_close_matches(name.lstrip("-"), list(flags), n=1, cutoff=HINT_CUTOFF)
    return flags[hint[0]] if hint else None


def rename_aliases(argv: list[str]) -> list[str]:
    """argv with vLLM's names of our flags (VLLM_ALIASES) as ours, `--x=v` too; not after
    `--`."""
    out: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":
            return out + argv[i:]
        name, eq, value = token.partition("=")
        out.append(VLLM_ALIASES[name] + eq + value if name in VLLM_ALIASES else token)
    return out


DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                 "fp32": "float32"}


def dtype_name(text: str) -> str:
    """--dtype's value as vLLM takes it: half / fp16, bf16, float / fp32 are aliases."""
    return DTYPE_ALIASES.get(text.lower(), text.lower())


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
    flag = VLLM_ALIASES.get("--" + name, "--" + name)
    action = parser._option_string_actions.get(flag)
    if name in ("config", "help", "version") or flag == FILE_MODEL_FLAG:
        raise ConfigError(f"{path}: {key}: not a flag a --config file can set")
    if action is None and flag in FOREIGN_FLAGS:
        raise ConfigError(f"{path}: {key}: {FOREIGN_FLAGS[flag]}")
    if action is None:
        hint = closest_flag(flag, parser)
        raise ConfigError(f"{path}: {key}: not a flag of this command"
                          + (f" (did you mean {hint.removeprefix('--')}?)" if hint else ""))
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
