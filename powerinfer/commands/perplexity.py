"""`powerinfer perplexity`: a text's perplexity, scored as llama.cpp's llama-perplexity does."""

from __future__ import annotations

import argparse
import sys

from ..errors import BadArgumentError
from .common import add_engine_arguments, add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("-f", "--file", required=True, help="the text to score (UTF-8)")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (default 512; second half scored)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..engine.perplexity import perplexity

    if args.chunks is not None and args.chunks < 1:
        raise BadArgumentError("--chunks must be >= 1")
    if args.ctx < 4:
        raise BadArgumentError("-c must be >= 4")
    try:
        with open(args.file, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as e:
        raise BadArgumentError(f"-f {args.file}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise BadArgumentError(f"-f {args.file}: not UTF-8 text (byte {e.start})") from None
    lm = load_from_args(args)
    bars = []

    def progress(chunk: int, chunks: int, running: float) -> None:
        if not bars:  # made at the first chunk: the total is known once the text is tokenized
            bars.append(tqdm(desc="perplexity", unit="chunk", total=chunks, file=sys.stderr))
        bars[0].update(1)
        bars[0].set_postfix(ppl=f"{running:.4f}")

    r = perplexity(lm, text, args.ctx, args.chunks, progress)
    for bar in bars:
        bar.close()
    print(f"{r.chunks} chunks of {args.ctx} tokens ({r.text_tokens} in the text), {r.tokens_scored} scored")
    print(f"Final estimate: PPL = {r.perplexity:.4f} +/- {r.stderr:.5f}")
    return 0
