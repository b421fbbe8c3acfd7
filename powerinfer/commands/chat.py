"""`powerinfer chat`: an interactive multi-turn conversation on stdin/stdout.

Type a message and press Enter; `/reset` starts over, `/exit` (or end of input) quits.
"""

from __future__ import annotations

import argparse
import sys

from ..engine.generate import stream_generate
from ..errors import BadArgumentError, ContextLengthError
from .common import add_engine_arguments, add_model_arguments, add_sampling_arguments, load_from_args, sampling_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--system", default=None, help="system message")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_params(args)
    lm = load_from_args(args)
    tok = lm.tokenizer
    if tok is None or not tok.has_chat_template:
        raise BadArgumentError(f"{lm.path}: the model has no chat template")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    print("chat ready: /reset to start over, /exit to quit", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            return 0
        try:  # a message that is not UTF-8 is refused and the session goes on
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            print(f"powerinfer: this message is not valid UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start}); "
                  "it was not sent", file=sys.stderr)
            continue
        if line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        try:
            for r in stream_generate(lm.model, tok, tok.encode_chat(messages), args.max_tokens, sampling, args.stop):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                reply.append(r.text)
        except ContextLengthError as e:
            # the conversation outgrew the context: say so and keep the session (and what
            # was said so far) instead of ending the program
            messages.pop()
            print(f"powerinfer: {e}; /reset starts a new conversation", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
