"""Decode speed as the context grows: ours vs llama.cpp on the same GGUF file, alternating.

    python benchmarks/decode_at_depth.py [--file F] [--depths 0,512,1024,2000] [--rounds 2]
        [--kv-dtypes fp32,fp16]

For each round and depth: llama-bench `-p 0 -n GEN -d DEPTH -t 2` (decode after DEPTH
prompt tokens; its KV cache is fp16 by default), then ours in a fresh process per KV cache
dtype (a DEPTH-token prompt prefilled, then GEN decode tokens timed after 4 warm-up
tokens); medians over the rounds. The default file is
the embedded default model. Decode at depth is where attention over the KV cache, not the
weights, takes the time (ops/cpu.py, `attend_chunk`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "shared", "tools", "llama-cpp.sh")


def llama_decode(path: str, depth: int, gen: int, threads: int) -> float:
    out = subprocess.run(["bash", TOOL, "bench", "-m", path, "-t", str(threads), "-p", "0", "-n", str(gen), "-d",
                          str(depth), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def ours_decode(path: str, depth: int, gen: int, threads: int, kv_dtype: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", path, "--depths", str(depth), "--gen", str(gen),
                          "-t", str(threads), "--kv-dtypes", kv_dtype], capture_output=True, text=True,
                         check=True).stdout
    return float(out.split()[-1])


def child(path: str, depth: int, gen: int, threads: int, kv_dtype: str) -> None:
    import torch

    import powerinfer

    lm = powerinfer.load(path, dtype="native", threads=threads, with_tokenizer=False, kv_dtype=kv_dtype)
    m = lm.model
    cache = m.new_cache(depth + gen + 8)
    if depth:
        m.forward(torch.randint(100, 20000, (depth,)), cache)
    tok = torch.tensor([5])
    for _ in range(4):
        m.forward(tok, cache)
    t0 = time.perf_counter()
    for _ in range(gen):
        m.forward(tok, cache)
    print(gen / (time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file")
    ap.add_argument("--depths", default="0,512,1024,2000")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--kv-dtypes", default="fp32,fp16", help="our KV cache dtypes, each measured")
    ap.add_argument("--child")
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    kvs = a.kv_dtypes.split(",")
    if a.child:
        child(a.child, depths[0], a.gen, a.threads, kvs[0])
        return
    from powerinfer.paths import default_model_path

    path = a.file or default_model_path()
    peer: dict[int, list[float]] = {d: [] for d in depths}
    ours: dict[tuple[str, int], list[float]] = {(k, d): [] for k in kvs for d in depths}
    for r in range(a.rounds):
        for d in depths:
            peer[d].append(llama_decode(path, d, a.gen, a.threads))
            for k in kvs:
                ours[k, d].append(ours_decode(path, d, a.gen, a.threads, k))
            print(f"round {r + 1}, depth {d}: llama.cpp {peer[d][-1]:.1f}, ours "
                  + ", ".join(f"{ours[k, d][-1]:.1f} (KV {k})" for k in kvs) + " tok/s", flush=True)
    print(f"\n{os.path.basename(path)}, {a.threads} threads, {a.gen} decode tokens, {a.rounds} rounds (medians)\n")
    print("| depth | llama.cpp decode tok/s | " + " | ".join(f"ours, KV {k}: tok/s, ratio (per round)" for k in kvs)
          + " |\n|---|---|" + "---|" * len(kvs))
    for d in depths:
        cells = []
        for k in kvs:
            ratios = " / ".join(f"{o / p:.2f}x" for o, p in zip(ours[k, d], peer[d]))
            med = statistics.median(ours[k, d])
            cells.append(f"{med:.1f}, **{med / statistics.median(peer[d]):.2f}x** ({ratios})")
        print(f"| {d} | {statistics.median(peer[d]):.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
