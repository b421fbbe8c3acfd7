"""Perplexity of every GGUF family against llama.cpp's `llama-perplexity`, on files made by
llama.cpp's own tools from the tiny random-weight checkpoints of tests/tiny_models.py
(convert_hf_to_gguf.py for F32 and Q8_0, then llama-quantize for Q4_K_M), scored the same way
(chunks of -c tokens, BOS first, second halves).

    python benchmarks/family_perplexity.py [-f TEXT] [-c 128] [--chunks 8] [--families a,b]
        [--types f32,q8_0,q4_k_m] [--hidden 256]

Random weights give perplexities near the vocabulary size; what the table checks is that both
engines compute the same model (windows, soft-caps, norms, RoPE variants, block formats) from
the same file. Quantized files are read in their own formats (our default dtype); F32 files
in fp32. The models are widened to --hidden (256: K-quant blocks span every weight row) and
know 128 positions, hence -c 128.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from converter import convert_tiny  # noqa: E402
from perplexity_vs_llamacpp import TOOL, ours, peer  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3_longrope", "falcon_mq_parallel",
            "falcon_new_arch", "falcon_new_arch_1ln"]


def make_file(name: str, kind: str, root: Path, hidden: int) -> Path:
    """The GGUF file of family `name` in `kind` (f32 / q8_0 from the converter, q4_k_m from
    llama-quantize on the f32 file)."""
    if kind in ("f32", "q8_0"):
        return convert_tiny(name, root, kind, hidden)[1]
    f32 = convert_tiny(name, root, "f32", hidden)[1]
    out = root / f"{name}.{kind}.gguf"
    done = subprocess.run(["bash", TOOL, "quantize", str(f32), str(out), kind.upper()], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return out


def without_window(path: Path, arch: str) -> Path:
    """A copy of `path` whose sliding window reads 0: how llama.cpp runs Phi-3 (it ignores the
    window, ggml-org/llama.cpp#13676), so that the two engines compute the same model."""
    out = path.with_name(path.stem + ".nowindow.gguf")
    shutil.copy(path, out)
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_set_metadata", "--force", str(out),
                    f"{arch}.attention.sliding_window", "0"], check=True, capture_output=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("-c", "--ctx", type=int, default=128)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--types", default="f32,q8_0,q4_k_m")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("-t", "--threads", type=int, default=2)
    a = p.parse_args()
    text = open(a.file, encoding="utf-8").read()
    print(f"{os.path.basename(a.file)}, {a.chunks} chunks, second halves scored, models {a.hidden} wide\n")
    print("| family | file | c | llama-perplexity | ours | difference |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.families.split(","):
            ctx = a.ctx
            for kind in a.types.split(","):
                rows = [(kind.upper(), make_file(name, kind, Path(tmp), a.hidden))]
                if name == "phi3":
                    rows.append((f"{kind.upper()}, window 0", without_window(rows[0][1], "phi3")))
                for label, path in rows:
                    got = ours(str(path), text, ctx, a.chunks, "fp32" if kind == "f32" else "native")
                    try:
                        ref = peer(str(path), a.file, ctx, a.chunks, a.threads)
                    except RuntimeError as e:  # a row that says so, and the other families still run
                        print(f"| {name} | {label} | {ctx} | ({e}) | {got:.3f} | — |", flush=True)
                        continue
                    print(f"| {name} | {label} | {ctx} | {ref:.3f} | {got:.3f} | {got / ref - 1:+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
