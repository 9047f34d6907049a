"""`omnistage` command line: parse argv, build the config, run."""

from __future__ import annotations

import argparse
import sys

from omnistage.entrypoints.cli import bench, generate, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnistage",
                                     description="Serve and run omni-modality models.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"omnistage {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
