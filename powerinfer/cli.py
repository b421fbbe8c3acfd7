"""`powerinfer SUBCOMMAND ...`: each subcommand is a module with add_arguments() and run().

User errors (PowerInferError) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .errors import PowerInferError

SUBCOMMANDS = {
    "generate": ("powerinfer.commands.generate", "generate text from a prompt"),
    "chat": ("powerinfer.commands.chat", "interactive multi-turn chat"),
    "perplexity": ("powerinfer.commands.perplexity", "a text's perplexity, scored as llama-perplexity scores it"),
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

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(args) if args is not None else sys.argv[1:]
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        # argparse reports missing required flags before unknown ones: a typo in a flag name
        # would read as "-p is required"; name the unknown flag instead
        unknown = [a for a in getattr(self, "_given", []) if a.startswith("-") and len(a) > 1
                   and not self._negative_number_matcher.match(a)
                   and not any(o.startswith(a.split("=", 1)[0]) for o in self._option_string_actions)]
        if message.startswith("the following arguments are required") and unknown:
            message = f"unrecognized arguments: {' '.join(unknown)}"
        raise UsageError(message, self.prog)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. Only the subcommand `command` gets its flags (None: every one): a
    subcommand's module imports torch and numba's kernels (~4.5 s), which `powerinfer --help`
    or a mistyped subcommand should not wait for."""
    parser = OneLineParser(prog="powerinfer", description="PowerInfer-style LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND", parser_class=OneLineParser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def subcommand(argv: list[str]) -> str:
    """The subcommand `argv` names: its first word that is not a flag ('' when none; the
    top level has no flag that takes a value)."""
    return next((a for a in argv if not a.startswith("-")), "")


def model_flag(argv: list[str]) -> str | None:
    """The value of -m/--model in `argv`, if any (read before the full parser is built)."""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--model") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model = model_flag(argv)
    if model is not None:
        from .models.detect import check_supported
        from .paths import looks_like_hub_id

        if not os.path.exists(model) and not looks_like_hub_id(model):  # as loader.resolve_model_path says it
            print(f"powerinfer: error: {model}: no such file or directory", file=sys.stderr)
            return 2
        try:  # before the subcommands (and torch) load: an unsupported model is refused at once
            check_supported(model)
        except PowerInferError as e:
            print(f"powerinfer: error: {model}: {e}", file=sys.stderr)
            return 2
    try:
        args = build_parser(subcommand(argv)).parse_args(argv)
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
