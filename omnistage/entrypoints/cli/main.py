"""`omnistage` command line: parse argv, build the config, run.

A wrong argument ends in one line on stderr and exit code 2, never a traceback: an unknown flag
names the closest real one (or, for a flag of vLLM / vLLM-Omni we do not have, what to do
instead), and the errors of start-up (a missing model, a YAML mistake, a port
in use) are their message alone.

Help and argument errors come before any heavy import (torch, transformers): the subcommands
import their engines only when they run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

import yaml

from omnistage.entrypoints.cli import bench, generate, serve
from omnistage.entrypoints.cli.flags import Parser, expand_config, rename_aliases, suggest


def version() -> str:
    try:
        return importlib.metadata.version("omnistage")
    except importlib.metadata.PackageNotFoundError:   # a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser, by name."""
    parser = Parser(prog="omnistage", description="Serve and run omni-modality models.")
    parser.add_argument("--version", action="version", version=f"omnistage {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    return parser, dict(sub.choices)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """argv (without the program name) as a namespace: `--config FILE` expanded, an unknown
    flag refused with the closest real one (SystemExit 2, as argparse does)."""
    parser, commands = build_parser()
    argv = rename_aliases(argv)   # vLLM's names of our flags
    if argv and argv[0] in commands:
        argv = expand_config(argv, commands[argv[0]])
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = commands[args.command]
        command.error(suggest(unknown[0], command) if unknown[0].startswith("-")
                      else f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:   # bare `omnistage`: what it can do, not an error
        build_parser()[0].print_help()
        return 0
    try:
        args = parse_args(argv)
    except ValueError as exc:   # --config: the file's own mistakes
        return _fail(argv[0], exc)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, yaml.YAMLError) as exc:
        return _fail(args.command, exc)
    except KeyboardInterrupt:
        return 130


def _fail(command: str | None, exc: BaseException) -> int:
    """One line on stderr (a message's own line breaks folded), exit code 2."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"omnistage {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
