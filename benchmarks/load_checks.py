"""What reading a GGUF's header and checking its weights for NaN/Inf cost at load.

    .venv/bin/python benchmarks/load_checks.py [FILE.gguf ...]   (default: the embedded model)

Per file: our header reader (formats/gguf_check.py) against `gguf.GGUFReader` on the same
file, then the finite check (formats/finite.py) over every tensor with the file's pages
resident (the load has just read them: this is the check's own cost).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    import gguf

    from powerinfer.formats.finite import is_finite
    from powerinfer.formats.gguf import open_gguf
    from powerinfer.loader import open_model
    from powerinfer.paths import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*")
    files = p.parse_args().files or [default_model_path()]
    print("| file | size | our header read | gguf.GGUFReader | finite check |")
    print("|---|---|---|---|---|")
    for path in files:
        t = time.perf_counter()
        open_gguf(path)
        ours = time.perf_counter() - t
        t = time.perf_counter()
        gguf.GGUFReader(path)
        theirs = time.perf_counter() - t
        _, state, _ = open_model(path, native=True)
        t = time.perf_counter()
        assert all(is_finite(v) for v in state.values() if v is not None)
        check = time.perf_counter() - t
        del state
        print(f"| {os.path.basename(path)} | {os.path.getsize(path) / 2**30:.2f} GiB | {ours:.3f} s | {theirs:.2f} s "
              f"| {check:.2f} s |")


if __name__ == "__main__":
    main()
