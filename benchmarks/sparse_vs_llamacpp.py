"""The packed sparse engine vs llama.cpp's dense decode on the same GGUF, side by side.

Rounds alternate: llama-bench (`-p 0 -n TOKENS -r 2 -t THREADS`) on the GGUF, then two of our
sparse decode rounds on its packed copy (as `bench relu7b --dir DIR` leaves them), each
round's ratio printed with the bus probe, the median at the end.

    python benchmarks/sparse_vs_llamacpp.py --dir /tmp/relu7b16 --rounds 6
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess


def llama_bench(binary: str, gguf: str, tokens: int, threads: int) -> float:
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "2", "-o", "csv"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1].split(",")[-2].strip('"'))  # avg_ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="bench relu7b's --dir: one *.gguf and packed/")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--active", type=float, default=0.1, help="share of FFN neurons computed (default 0.1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from powerinfer.bench.relu7b import calibrate_active_share, decode_speed
    from powerinfer.engine.packed import load_packed
    from powerinfer.timing import memory_read_bandwidth

    here = os.path.dirname(os.path.abspath(__file__))
    binary = os.path.join(subprocess.run(["bash", os.path.join(here, "..", "..", "shared", "tools", "llama-cpp.sh")],
                                         capture_output=True, text=True, check=True).stdout.strip(), "llama-bench")
    (gguf,) = glob.glob(os.path.join(args.dir, "*.gguf"))
    torch.set_num_threads(args.threads)
    lm = load_packed(os.path.join(args.dir, "packed"), mode="sparse", dtype="native", threads=args.threads,
                     with_tokenizer=False, predictor_bypass=None)
    calibrate_active_share(lm.model, args.active, n=32)
    decode_speed(lm.model, 4)
    ratios = []
    for _ in range(args.rounds):
        theirs = llama_bench(binary, gguf, args.tokens, args.threads)
        ours = statistics.median(decode_speed(lm.model, args.tokens) for _ in range(2))
        ratios.append(ours / theirs)
        print(f"llama.cpp {theirs:.2f}  ours sparse {ours:.2f}  ratio {ratios[-1]:.2f}  "
              f"active {lm.ffn_stats.active_fraction:.3f}  probe {memory_read_bandwidth(1 << 28, 3) / 1e9:.1f} GB/s",
              flush=True)
    print(f"median ratio {statistics.median(ratios):.2f}x over {args.rounds} rounds")


if __name__ == "__main__":
    main()
