"""Perplexity of our engine against llama.cpp's `llama-perplexity` on the same GGUF file and
text, scored the way llama-perplexity scores it: the text tokenized once, cut into chunks of
`-c` tokens, each chunk's first token replaced by BOS, and only the second half of each
chunk scored (the first half is context).

    python benchmarks/perplexity_vs_llamacpp.py [-m FILE.gguf] [-f TEXT] [-c 512] [--chunks 8]
        [--dtypes native,fp32]

Default text: /usr/share/common-licenses/GPL-3 (English prose, not ShareGPT, on every
Debian machine).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "shared", "tools", "llama-cpp.sh")


def ours(path: str, text: str, ctx: int, chunks: int, dtype: str) -> float:
    """`powerinfer perplexity`'s scoring (engine/perplexity.py) on `path` in `dtype`."""
    import powerinfer
    from powerinfer.engine.perplexity import perplexity

    return perplexity(powerinfer.load(path, dtype=dtype), text, ctx, chunks).perplexity


def peer(path: str, text_file: str, ctx: int, chunks: int, threads: int) -> float:
    r = subprocess.run(["bash", TOOL, "ppl", "-m", path, "-f", text_file, "-c", str(ctx), "--chunks", str(chunks),
                        "-t", str(threads)], capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if not m:
        errors = [line for line in (r.stderr + r.stdout).splitlines() if " E " in line or "error" in line]
        raise RuntimeError(f"llama-perplexity gave no estimate: {(errors or (r.stderr or r.stdout).splitlines())[:1]}")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("-c", "--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--dtypes", default="native,fp32")
    p.add_argument("-t", "--threads", type=int, default=2)
    a = p.parse_args()
    from powerinfer.paths import default_model_path

    path = a.model or default_model_path()
    text = open(a.file, encoding="utf-8").read()
    try:
        ref = peer(path, a.file, a.ctx, a.chunks, a.threads)
    except RuntimeError as e:
        sys.exit(str(e))
    print(f"{os.path.basename(path)}, {os.path.basename(a.file)}, c={a.ctx}, {a.chunks} chunks, second halves scored\n")
    print("| engine | perplexity | vs llama-perplexity |\n|---|---|---|")
    print(f"| llama-perplexity | {ref:.4f} | — |")
    for dtype in a.dtypes.split(","):
        ppl = ours(path, text, a.ctx, a.chunks, dtype)
        print(f"| ours, {dtype} | {ppl:.4f} | {ppl / ref - 1:+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
