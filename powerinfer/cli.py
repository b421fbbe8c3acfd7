"""`powerinfer SUBCOMMAND ...`: each subcommand is a module with add_arguments() and run().

User errors (PowerInferError) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from .errors import PowerInferError

SUBCOMMANDS = {
    "generate": ("powerinfer.commands.generate", "generate text from a prompt"),
    "chat": ("powerinfer.commands.chat", "interactive multi-turn chat"),
    "profile": ("powerinfer.commands.profile", "activation statistics, thresholds, training samples"),
    "train": ("powerinfer.commands.train", "per-layer activation predictors from a profile"),
    "solve": ("powerinfer.commands.solve", "place neurons on GPU/CPU under a VRAM budget (ILP)"),
    "pack": ("powerinfer.commands.pack", "write the packed model the hybrid engine loads"),
    "prepare": ("powerinfer.commands.prepare", "the whole offline pipeline (profile, train, solve, pack), cached"),
    "hardware": ("powerinfer.commands.hardware", "hardware profiles: list, show, measure"),
    "serve": ("powerinfer.commands.serve", "OpenAI-compatible HTTP server"),
    "bench": ("powerinfer.commands.bench", "speed benchmarks"),
}


class UsageError(Exception):
    """A flag argparse could not read (raised instead of argparse's exit)."""

    def __init__(self, message: str, prog: str):
        super().__init__(message)
        self.prog = prog


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors as one `powerinfer: error:` line (and a one-line hint) instead
    of the usage block, and values such as `-5GiB` read as values, not as unknown options."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes only plain negative numbers (-5, -.5) as values; a size such as -5GiB
        # would otherwise be "expected one argument". None of our options starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        raise UsageError(message, self.prog)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="powerinfer", description="PowerInfer-style LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND", parser_class=OneLineParser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"powerinfer: error: {e}", file=sys.stderr)
        print(f"(see `{e.prog} --help`)", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except PowerInferError as e:
        print(f"powerinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
