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
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from perplexity_vs_llamacpp import ours, peer  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3_longrope"]


def build(name: str, root: Path) -> Path:
    """The converter's F32 GGUF of tiny model `name` (tokenizers as in tests/test_converter_gguf.py)."""
    from converter import convert, spm_tokenizer
    from test_converter_gguf import SPM_FAMILIES
    from tiny_models import build_tiny

    if name in SPM_FAMILIES:
        spm_dir = root / f"spm-{name}"
        build_tiny(name, root, spm_tokenizer(spm_dir, dummy_prefix=not name.startswith("gemma")))
        shutil.copy(spm_dir / "tokenizer.model", root / name)
    else:
        from powerinfer.paths import default_model_path
        from powerinfer.tokenizer import load_tokenizer

        build_tiny(name, root, load_tokenizer(default_model_path()).hf)
    return convert(root / name, root / f"{name}.gguf")


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
            path = str(build(name, Path(tmp)))
            ctx = min(a.ctx, 64) if name == "phi3_longrope" else a.ctx
            ref = peer(path, a.file, ctx, a.chunks, a.threads)
            got = ours(path, text, ctx, a.chunks, "fp32")
            print(f"| {name} | {ctx} | {ref:.3f} | {got:.3f} | {got / ref - 1:+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
