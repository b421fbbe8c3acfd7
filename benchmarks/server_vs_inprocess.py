"""Server vs in-process: time to first token and decode tok/s for one client, and aggregate
throughput with 1, 2, 4 and 8 concurrent streaming clients, with the p50/p95 inter-token
gap over all clients' gaps and the range of each client's own (embedded SmolLM2 by
default, its own Q4_1 weights in both paths).

Where a single stream's time goes besides the engine: the one-client rounds alternate
in-process, the official `openai` client and a bare httpx reader of the same SSE stream
(no parsing: the client's own CPU mostly gone), and report the CPU each streamed chunk costs
the server's threads (from /proc/PID/task/*/stat; Linux) and the `openai` client.

    python benchmarks/server_vs_inprocess.py [--model PATH] [--tokens 64] [--max-batch 8] [--kv-dtype fp16]
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
from quant_vs_llamacpp import peak_rss  # benchmarks/, beside this script

# each runs the full 64 tokens greedily on the default model (no early EOS to skew the rates)
PROMPTS = ["Explain why the sky is blue.", "What is a binary search tree?", "Describe the water cycle.",
           "Who was Ada Lovelace?", "How do vaccines work?", "Summarize the plot of Hamlet.",
           "The history of the Roman Empire", "In computer science, a hash table is"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(client, prompt: str, tokens: int) -> tuple[float, float, int, list[float], float, float]:
    """(time to first text, first to last text, text chunks, gaps between chunks, clock at
    the first and the last text) of one streamed greedy completion."""
    t0 = time.perf_counter()
    times = []
    for ch in client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0, stream=True):
        if ch.choices and ch.choices[0].text:
            times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not times:  # the model ended at once
        return float("nan"), 0.0, 0, [], t0, t0
    return times[0] - t0, times[-1] - times[0], len(times), gaps, times[0], times[-1]


def stream_bare(base: str, prompt: str, tokens: int) -> float:
    """Decode tok/s of one streamed greedy completion read as raw SSE lines by httpx (text
    chunks are counted by a substring test: no JSON parsing)."""
    times = []
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=600) as c, c.stream("POST", base + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid` ({} off Linux)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8, help="server --max-batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="fp32", choices=["fp32", "fp16"], help="KV cache dtype, both paths")
    args = ap.parse_args()
    from openai import OpenAI

    port = free_port()
    cmd = [sys.executable, "-m", "powerinfer.cli", "serve", "--port", str(port), "--model-name", "m", "-t",
           str(args.threads), "--max-batch", str(args.max_batch), "--queue-size", "16", "--kv-dtype", args.kv_dtype]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        lm = powerinfer.load(args.model, dtype="native", threads=args.threads, kv_dtype=args.kv_dtype)  # as the server
        prompt = PROMPTS[0]
        list(powerinfer.stream_generate(lm, prompt, 8, temperature=0))  # warm-up
        for _ in range(240):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
        stream_once(client, prompt, 8)  # warm-up (numba compile in the server process)
        ttft, decode, runs, bare = [], [], [], []
        server_cpu: dict[int, float] = {}
        client_cpu = 0.0
        for _ in range(3):  # alternating: in-process, then the server (idle meanwhile)
            t0 = time.perf_counter()
            first = None
            for r in powerinfer.stream_generate(lm, prompt, args.tokens, temperature=0):
                first = first or time.perf_counter()
            ttft.append(first - t0)
            decode.append(r.generation_tps)
            before, cpu0 = thread_cpu(proc.pid), time.process_time()
            runs.append(stream_once(client, prompt, args.tokens))
            client_cpu += time.process_time() - cpu0
            for tid, t in thread_cpu(proc.pid).items():
                server_cpu[tid] = server_cpu.get(tid, 0.0) + t - before.get(tid, 0.0)
            bare.append(stream_bare(base, prompt, args.tokens))
        s_ttft = statistics.median(r[0] for r in runs)
        s_decode = statistics.median((r[2] - 1) / r[1] for r in runs)
        print(f"\nmodel {args.model or 'embedded SmolLM2-135M'}; {args.tokens} greedy tokens; threads {args.threads}; "
              f"server --max-batch {args.max_batch}\n")
        print("| path | TTFT ms | decode tok/s |\n|---|---|---|")
        print(f"| in-process stream_generate | {statistics.median(ttft) * 1e3:.0f} | {statistics.median(decode):.1f} |")
        print(f"| server, 1 streaming client | {s_ttft * 1e3:.0f} | {s_decode:.1f} |")
        print(f"| server, bare httpx reader | - | {statistics.median(bare):.1f} |")
        print(f"\nserver / in-process decode: {s_decode / statistics.median(decode):.2f}x (bare reader "
              f"{statistics.median(bare) / statistics.median(decode):.2f}x); TTFT difference "
              f"{(s_ttft - statistics.median(ttft)) * 1e3:+.0f} ms")
        chunks = sum(r[2] for r in runs)
        busy = sorted(((t, tid) for tid, t in server_cpu.items() if t > 0), reverse=True)
        per = ", ".join(f"{'main (engine)' if tid == proc.pid else f'thread {tid}'} {t / chunks * 1e3:.2f}"
                        for t, tid in busy)
        print(f"CPU ms per streamed chunk (openai rounds, {chunks} chunks): server threads: {per or 'n/a'}; "
              f"this process (the openai client) {client_cpu / chunks * 1e3:.2f}")
        # aggregate: every text chunk over the wall time (prefills included); decode: the chunks
        # after each client's first over the span from the first client's first chunk to the end
        print("\n| concurrent clients | aggregate tok/s | vs 1 client | decode tok/s | vs 1 client | p50 gap ms | "
              "p95 gap ms | clients' p50 / p95 ms (range) | wall s | clients' CPU s |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        one = one_decode = None
        for n in (1, 2, 4, 8):
            results = [None] * n

            def run(i):
                results[i] = stream_once(client, PROMPTS[i % len(PROMPTS)], args.tokens)

            t0, cpu0 = time.perf_counter(), time.process_time()
            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
            total = sum(r[2] for r in results) / wall
            span = max(r[5] for r in results) - min(r[4] for r in results)
            decode = sum(max(r[2] - 1, 0) for r in results) / span if span > 0 else float("nan")
            one, one_decode = one or total, one_decode or decode
            gaps = [g for r in results for g in r[3]]
            p50s = [percentile(r[3], 0.5) * 1e3 for r in results if r[3]]
            p95s = [percentile(r[3], 0.95) * 1e3 for r in results if r[3]]
            print(f"| {n} | {total:.1f} | {total / one:.2f}x | {decode:.1f} | {decode / one_decode:.2f}x | "
                  f"{percentile(gaps, 0.5) * 1e3:.0f} | {percentile(gaps, 0.95) * 1e3:.0f} | "
                  f"{min(p50s):.0f}-{max(p50s):.0f} / {min(p95s):.0f}-{max(p95s):.0f} | {wall:.1f} | "
                  f"{client_cpu:.1f} |")
        print(f"\npeak RSS: server {peak_rss(proc.pid) / 2**20:.0f} MiB, this process (in-process engine and the "
              f"clients) {peak_rss() / 2**20:.0f} MiB")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
