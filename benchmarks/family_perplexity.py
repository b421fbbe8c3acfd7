"""Perplexity of every GGUF family against llama.cpp's `llama-perplexity`, on files made by
llama.cpp's own converter (convert_hf_to_gguf.py) from the tiny random-weight checkpoints of
tests/tiny_models.py, scored the same way (chunks of -c tokens, BOS first, second halves).

    python benchmarks/family_perplexity.py [-f TEXT] [-c 128] [--chunks 8] [--families a,b]

Random weights give perplexities near the vocabulary size; what the table checks is that both
engines compute the same model (windows, soft-caps, norms, RoPE variants) from the same file.
The tiny models know 128 positions (phi3_longrope 64, its original context), hence -c 128.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from converter import convert_tiny  # noqa: E402
from perplexity_vs_llamacpp import ours, peer  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3_longrope"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("-c", "--ctx", type=int, default=128)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("-t", "--threads", type=int, default=2)
    a = p.parse_args()
    text = open(a.file, encoding="utf-8").read()
    print(f"{os.path.basename(a.file)}, {a.chunks} chunks, second halves scored, F32 files from convert_hf_to_gguf.py\n")
    print("| family | c | llama-perplexity | ours | difference |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.families.split(","):
            path = str(convert_tiny(name, Path(tmp))[1])
            ctx = min(a.ctx, 64) if name == "phi3_longrope" else a.ctx
            got = ours(path, text, ctx, a.chunks, "fp32")
            try:
                ref = peer(path, a.file, ctx, a.chunks, a.threads)
            except RuntimeError as e:  # a row that says so, and the other families still run
                print(f"| {name} | {ctx} | ({e}) | {got:.3f} | — |", flush=True)
                continue
            print(f"| {name} | {ctx} | {ref:.3f} | {got:.3f} | {got / ref - 1:+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
