"""Decode tok/s on an idle machine and beside a process that is busy in short bursts.

    python benchmarks/busy_decode.py [--model FILE.gguf] [--threads N] [--tokens 128] [--rounds 6] [--busy-ms 0.7] [--period-ms 4]

A desktop is rarely idle: a browser or an editor wakes up for a fraction of a millisecond
every few milliseconds. Each such wake-up deschedules one of the engine's threads, and a
token waits for the share that thread holds (ops/team.py). This runs one model in-process
(`powerinfer.stream_generate`, greedy, `--threads` or the default count), alternating per round
between an idle machine and one with a second process that spins for `--busy-ms` out of
every `--period-ms`, and prints each round's tok/s, the medians and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time


def _bursts(busy_s: float, period_s: float, stop) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(period_s - busy_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the engine's)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--busy-ms", type=float, default=0.7)
    ap.add_argument("--period-ms", type=float, default=4.0)
    args = ap.parse_args()
    if not 0 < args.busy_ms < args.period_ms:
        raise SystemExit("busy_decode: need 0 < --busy-ms < --period-ms")
    import powerinfer

    lm = powerinfer.load(args.model, dtype="native", threads=args.threads)
    prompt = "Explain why the sky is blue."
    list(powerinfer.stream_generate(lm, prompt, 8, temperature=0))  # warm-up
    rates: dict[str, list[float]] = {"idle": [], "busy": []}
    for _ in range(args.rounds):
        for kind in rates:
            stop, proc = multiprocessing.Event(), None
            if kind == "busy":
                proc = multiprocessing.Process(target=_bursts, args=(args.busy_ms / 1e3, args.period_ms / 1e3, stop))
                proc.start()
                time.sleep(0.05)
            try:
                for r in powerinfer.stream_generate(lm, prompt, args.tokens, temperature=0):
                    pass
            finally:
                if proc is not None:
                    stop.set()
                    proc.join()
            rates[kind].append(r.generation_tps)
    idle, busy = statistics.median(rates["idle"]), statistics.median(rates["busy"])
    print(f"model {args.model or 'embedded SmolLM2-135M'}; threads {args.threads or 'default'}; {args.tokens} greedy "
          f"tokens; {args.rounds} rounds; "
          f"a process busy {args.busy_ms} ms of every {args.period_ms} ms beside it in the busy rounds")
    for kind, v in rates.items():
        print(f"{kind}: median {statistics.median(v):.1f} tok/s, rounds {' '.join(f'{x:.0f}' for x in v)}")
    print(f"busy / idle: {busy / idle:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
