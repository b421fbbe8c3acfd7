"""Building a GGUF file's tokenizer (a cache miss of `load_tokenizer`): transformers'
AutoTokenizer against `powerinfer.tokenizer._tokenizer_from_gguf` (the class AutoTokenizer
picks, built from the file's tokenizer fields only), alternating, on the same file.

    python benchmarks/tokenizer_build.py [GGUF ...] [--rounds 3]
"""
import argparse
import os
import time

from transformers import AutoTokenizer

from powerinfer.formats.gguf_check import read_header
from powerinfer.paths import default_model_path
from powerinfer.tokenizer import _quiet_transformers, _tokenizer_from_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=[default_model_path()])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    _quiet_transformers()
    for path in args.files:
        times = {"AutoTokenizer": [], "ours": []}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            auto = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
            t1 = time.perf_counter()
            ours = _tokenizer_from_gguf(path, read_header(path, os.path.getsize(path)).metadata)
            t2 = time.perf_counter()
            times["AutoTokenizer"].append(t1 - t0)
            times["ours"].append(t2 - t1)
        assert type(auto) is type(ours)
        a, o = (sorted(v) for v in times.values())
        print(f"{os.path.basename(path)} ({len(ours)} tokens, {type(ours).__name__}): AutoTokenizer "
              f"{a[0]:.2f}-{a[-1]:.2f} s, ours {o[0]:.2f}-{o[-1]:.2f} s (header read included), "
              f"median ratio {a[len(a) // 2] / o[len(o) // 2]:.1f}x")


if __name__ == "__main__":
    main()
