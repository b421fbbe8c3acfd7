"""Decode as one team region per token vs one parallel region per phase, side by side.

    python benchmarks/team_decode.py [--model FILE.gguf] [--rounds 6] [--tokens 64] [--hog]

Both run the same model in one process (ops/decode_team.py against decode.layer_stack,
which give the same logits to the bit), alternating per round, each round `--tokens` greedy
tokens after an 8-token prompt. `--hog` runs a busy process beside them (one core's worth of
pure-Python spinning) to show what each does on a machine that is not idle.
Prints tok/s per round, the medians, the per-round ratio and the peak RSS.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hog", action="store_true", help="a busy process beside the engine")
    args = p.parse_args()

    import torch

    from powerinfer.loader import load
    from powerinfer.paths import default_model_path

    model = load(args.model or default_model_path(), dtype="native", with_tokenizer=False).model
    prompt = torch.arange(100, 108)

    def rate(team: bool) -> float:
        cache = model.new_cache(len(prompt) + args.tokens + 1)
        logits = model.forward(prompt, cache)
        token = logits.reshape(-1, logits.shape[-1])[-1].argmax().reshape(1)
        start = time.perf_counter()
        for _ in range(args.tokens):
            if model._stack is not None:
                model._stack.team = team
            logits = model.forward(token, cache)
            token = logits.reshape(-1, logits.shape[-1])[-1].argmax().reshape(1)
        return args.tokens / (time.perf_counter() - start)

    rate(True)  # compile and warm both
    teams = model._stack is not None and model._stack.team
    rate(False)
    if not teams:
        raise SystemExit("this model does not decode as a team (every matrix in lanes, gated FFN)")
    stop = multiprocessing.Event()
    hog = multiprocessing.Process(target=_spin, args=(stop,)) if args.hog else None
    if hog:
        hog.start()
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(args.rounds):
            for team in (True, False) if r % 2 == 0 else (False, True):
                rates[team].append(rate(team))
    finally:
        if hog:
            stop.set()
            hog.join()
    for team, name in ((True, "team region"), (False, "region per phase")):
        print(f"{name:17s} " + " ".join(f"{v:6.1f}" for v in rates[team]) + f"  median {statistics.median(rates[team]):.1f}")
    ratios = [a / b for a, b in zip(rates[True], rates[False])]
    print("ratio per round   " + " ".join(f"{v:6.3f}" for v in ratios) + f"  median {statistics.median(ratios):.3f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
