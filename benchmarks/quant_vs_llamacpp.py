"""Ours vs llama.cpp on the same GGUF files: prefill and decode tok/s, peak RSS, and our
decode's share of the bandwidth bound (weight bytes per token / bus bandwidth, measured in
the same run).

    python benchmarks/quant_vs_llamacpp.py [--files A.gguf,B.gguf] [--rounds 3] [--dtype native]

Decode is measured as llama-bench measures it (tg: `--gen` tokens from an empty context),
prefill as its pp (`--prompt` tokens). Without --files it makes Q4_0, Q8_0 and F16 files from the embedded Q4_1 model with
llama.cpp's own `llama-quantize --allow-requantize` (../shared/tools/llama-cpp.sh builds it)
into --dir, and runs those and the Q4_1 file itself. Each round runs llama-bench
(`-p 128 -n 64 -t 2 -r 1`) and then ours in a fresh process (so that its peak RSS is its
own), file after file: the machine's drift weighs on both. Reported: medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "shared", "tools", "llama-cpp.sh")


def ours(path: str, dtype: str, threads: int, prompt: int, gen: int) -> dict:
    """One run of our engine in this process: prefill `prompt` tokens, decode `gen`."""
    import torch

    import powerinfer
    from powerinfer.timing import decode_round

    torch.set_num_threads(threads)
    lm = powerinfer.load(path, dtype=dtype, threads=threads, with_tokenizer=False)
    ids = [int(i) % lm.args.vocab_size for i in range(100, 100 + prompt)]
    decode_round(lm.model, ids[:8], 4)  # compile and warm up: short prompts (batched GEMV)
    decode_round(lm.model, ids, 4)  # and the measured prompt's path (tiled GEMM past 16 tokens)
    pp, _ = decode_round(lm.model, ids, 1)
    # decode as llama-bench's tg test runs it: `gen` tokens from an empty context (here after
    # a one-token prompt), not after the prompt (its pp and tg are separate tests)
    _, tg = decode_round(lm.model, ids[:1], gen)
    # bytes read per token: every matrix once; the embedding table only where it is the LM head
    # (a tied head re-laid as lanes is its own copy, and lookups read a row)
    m = lm.model
    head = {id(t) for t in m.lm_head.tensors()}
    read = {id(t): t for t in m.tensors() if t is not m.embed or id(t) in head}
    weight_bytes = sum(t.numel() * t.element_size() for t in read.values())
    return {"prefill": pp, "decode": tg, "rss": peak_rss(), "weight_bytes": weight_bytes}


def one_generation(path: str, dtype: str, threads: int, prompt: int, gen: int) -> dict:
    """Peak RSS of what `powerinfer generate` does, in this (fresh) process: load, one KV
    cache for the prompt and the generation, the prompt, then `gen` tokens. (The timing
    child runs several rounds, each with its own cache; the allocator keeps some of the
    freed ones, which a user's one generation never pays.)"""
    import torch

    import powerinfer

    torch.set_num_threads(threads)
    lm = powerinfer.load(path, dtype=dtype, threads=threads, with_tokenizer=False)
    cache = lm.model.new_cache(prompt + gen)
    ids = torch.tensor([int(i) % lm.args.vocab_size for i in range(100, 100 + prompt)])
    logits = lm.model.forward(ids, cache)
    for _ in range(gen - 1):
        logits = lm.model.forward(logits.argmax(-1).reshape(1), cache)
    kv = sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v] if t is not None)
    return {"rss": peak_rss(), "kv_bytes": kv}


def peak_rss(pid: int | str = "self") -> int:
    """A live process's peak RSS in bytes (this one by default): VmHWM, which starts afresh at
    exec (getrusage's ru_maxrss keeps the parent's high-water mark across fork and exec)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def llama_bench(path: str, threads: int, prompt: int, gen: int) -> dict:
    out = subprocess.run(["bash", TOOL, "bench", "-m", path, "-t", str(threads), "-p", str(prompt), "-n", str(gen),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return speed


def make_files(src: str, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    files = [src]
    for kind in ("Q4_0", "Q8_0", "F16"):
        dst = os.path.join(out_dir, f"smollm2-{kind.lower()}.gguf")
        if not os.path.isfile(dst):
            subprocess.run(["bash", TOOL, "quantize", "--allow-requantize", src, dst + ".tmp", kind], check=True,
                           capture_output=True)
            os.replace(dst + ".tmp", dst)
        files.append(dst)
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", default=None, help="comma-separated GGUF files (default: made from the default model)")
    p.add_argument("--dir", default="/tmp/quant-bench", help="where the made files go")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="native")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-rss", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(ours(a.child, a.dtype, a.threads, a.prompt, a.gen)))
        return 0
    if a.child_rss:
        print(json.dumps(one_generation(a.child_rss, a.dtype, a.threads, a.prompt, a.gen)))
        return 0
    from powerinfer.paths import default_model_path
    from powerinfer.timing import memory_read_bandwidth

    files = a.files.split(",") if a.files else make_files(default_model_path(), a.dir)
    runs: dict[str, dict[str, list]] = {f: {"peer": [], "ours": []} for f in files}
    buses = []
    for r in range(a.rounds):
        buses.append(memory_read_bandwidth(statistic="median"))
        for f in files:
            runs[f]["peer"].append(llama_bench(f, a.threads, a.prompt, a.gen))
            child = subprocess.run([sys.executable, __file__, "--child", f, "--dtype", a.dtype, "-t", str(a.threads),
                                    "--prompt", str(a.prompt), "--gen", str(a.gen)], capture_output=True, text=True)
            if child.returncode:
                sys.exit(f"ours failed on {f}: {child.stderr.strip().splitlines()[-1]}")
            runs[f]["ours"].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}, {os.path.basename(f)}: peer {runs[f]['peer'][-1]}, ours {runs[f]['ours'][-1]}",
                  file=sys.stderr, flush=True)
    generation = {}
    for f in files:  # one generation per file, in its own process: the memory a user sees
        child = subprocess.run([sys.executable, __file__, "--child-rss", f, "--dtype", a.dtype, "-t", str(a.threads),
                                "--prompt", str(a.prompt), "--gen", str(a.gen)], capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"ours failed on {f}: {child.stderr.strip().splitlines()[-1]}")
        generation[f] = json.loads(child.stdout.strip().splitlines()[-1])
    bus = statistics.median(buses)
    print(f"\n{a.threads} threads, prompt {a.prompt}, {a.gen} decode tokens, {a.rounds} rounds (medians); "
          f"our dtype {a.dtype}; bus {bus / 1e9:.1f} GB/s (median probe)\n")
    print("| file | MiB | llama.cpp prefill | llama.cpp decode | ours prefill | ours decode | prefill ratio "
          "| decode ratio | ours peak RSS (timing runs) | one generation's peak RSS / budget | our decode / bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f, r in runs.items():
        med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
        pp, tg = med(r["peer"], "prefill"), med(r["peer"], "decode")
        opp, otg = med(r["ours"], "prefill"), med(r["ours"], "decode")
        rss = max(x["rss"] for x in r["ours"])
        bound = bus / r["ours"][0]["weight_bytes"]
        # issue 19's budget: the file + 0.6 GB, plus the KV cache
        g = generation[f]
        budget = os.path.getsize(f) + 0.6e9 + g["kv_bytes"]
        print(f"| {os.path.basename(f)} | {os.path.getsize(f) / 2**20:.0f} | {pp:.1f} | {tg:.1f} | {opp:.1f} | {otg:.1f} "
              f"| {opp / pp:.2f}x | {otg / tg:.2f}x | {rss / 2**30:.2f} GiB | {g['rss'] / 2**30:.2f} / "
              f"{budget / 2**30:.2f} GiB | {otg / bound:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
