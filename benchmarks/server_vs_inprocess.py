"""Server vs in-process: time to first token and decode tok/s for one client, and aggregate
throughput with 1, 4 and 8 concurrent streaming clients (embedded SmolLM2 by default).

    python benchmarks/server_vs_inprocess.py [--model PATH] [--tokens 64] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

import powerinfer

PROMPTS = ["Explain why the sky is blue.", "Write a haiku about autumn.", "What is a binary search tree?",
           "Give three tips for learning a language.", "Describe the water cycle.", "Who was Ada Lovelace?",
           "How do vaccines work?", "Summarize the plot of Hamlet."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(client, prompt: str, tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first, last, chunks = None, None, 0
    for ch in client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0, stream=True):
        if ch.choices and ch.choices[0].text:
            now = time.perf_counter()
            first = first or now
            last = now
            chunks += 1
    return first - t0, last - first, chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2, help="server --max-concurrency")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from openai import OpenAI

    lm = powerinfer.load(args.model, threads=args.threads)
    prompt = PROMPTS[0]
    list(powerinfer.stream_generate(lm, prompt, 8, temperature=0))  # warm-up
    ttft, decode = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        first = None
        for r in powerinfer.stream_generate(lm, prompt, args.tokens, temperature=0):
            first = first or time.perf_counter()
        ttft.append(first - t0)
        decode.append(r.generation_tps)
    port = free_port()
    cmd = [sys.executable, "-m", "powerinfer.cli", "serve", "--port", str(port), "--model-name", "m", "-t",
           str(args.threads), "--max-concurrency", str(args.concurrency), "--queue-size", "16"]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
        stream_once(client, prompt, 8)  # warm-up (numba compile in the server process)
        runs = [stream_once(client, prompt, args.tokens) for _ in range(3)]
        s_ttft = statistics.median(r[0] for r in runs)
        tokens = client.completions.create(model="m", prompt=prompt, max_tokens=args.tokens, temperature=0).usage
        s_decode = statistics.median((tokens.completion_tokens - 1) / r[1] for r in runs)
        print(f"\nmodel {args.model or 'embedded SmolLM2-135M'}; {args.tokens} greedy tokens; threads {args.threads}; "
              f"server --max-concurrency {args.concurrency}\n")
        print("| path | TTFT ms | decode tok/s |\n|---|---|---|")
        print(f"| in-process stream_generate | {statistics.median(ttft) * 1e3:.0f} | {statistics.median(decode):.1f} |")
        print(f"| server, 1 streaming client | {s_ttft * 1e3:.0f} | {s_decode:.1f} |")
        print("\n| concurrent clients | aggregate completion tok/s | wall s |\n|---|---|---|")
        for n in (1, 4, 8):
            counts = [0] * n

            def run(i):
                r = client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=args.tokens,
                                              temperature=0)
                counts[i] = r.usage.completion_tokens

            t0 = time.perf_counter()
            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            print(f"| {n} | {sum(counts) / wall:.1f} | {wall:.1f} |")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
