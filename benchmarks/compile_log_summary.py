"""Summarize a numba compile log (`POWERINFER_COMPILE_LOG=file make test`, tests/conftest.py).

Prints the total of the top-level compiles (both test workers together), the kernels with the
most exclusive compile time (a compile's seconds less those of the compiles nested in it), and
the totals per module. Usage: python benchmarks/compile_log_summary.py /tmp/compile.jsonl [top]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def summarize(path: str, top: int) -> None:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    exclusive: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    modules: collections.Counter = collections.Counter()
    children: dict = collections.defaultdict(float)  # (pid, depth) -> seconds of finished nested compiles
    for r in rows:  # in order of ending: a nested compile ends before the one it is nested in
        pid, depth, seconds = r.get("pid", 0), r["nested"], r["seconds"]
        exclusive[r["kernel"]] += seconds - children.pop((pid, depth + 1), 0.0)
        inclusive[r["kernel"]] += seconds
        count[r["kernel"]] += 1
        children[(pid, depth)] += seconds
        if depth == 0:
            modules[".".join(r["kernel"].split(".")[:3])] += seconds
    print(f"top-level compiles: {sum(modules.values()):.0f} s in {len(rows)} compiles")
    print(f"\n{'exclusive s':>11} {'inclusive s':>11} {'n':>4}  kernel")
    for kernel, s in exclusive.most_common(top):
        print(f"{s:11.1f} {inclusive[kernel]:11.1f} {count[kernel]:4d}  {kernel}")
    print(f"\n{'top-level s':>11}  module")
    for module, s in modules.most_common(top):
        print(f"{s:11.1f}  {module}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("top", nargs="?", type=int, default=25)
    a = p.parse_args(argv)
    try:
        summarize(a.log, a.top)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read {a.log} as a compile log: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
