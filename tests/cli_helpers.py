"""Running the real `powerinfer` CLI: in a subprocess, as a user would, or in this process."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys


def run_cli(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "powerinfer.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def run_cli_here(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`powerinfer ARGS` through `cli.main` in this process, its output captured: the same
    code path as `run_cli` without a new interpreter loading torch and numba's kernels
    (~5 s a call on 2 cores). For tests that run the CLI many times; the subprocess tests
    keep the real entry point and exit codes covered."""
    import numba
    import torch

    from powerinfer.cli import main

    err, out = io.StringIO(), io.StringIO()
    old_stdin, threads, torch_threads = sys.stdin, numba.get_num_threads(), torch.get_num_threads()
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's --help and the like
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = old_stdin
        numba.set_num_threads(threads)  # --threads must not leak into the next test
        torch.set_num_threads(torch_threads)
    return subprocess.CompletedProcess(["powerinfer", *args], code, out.getvalue(), err.getvalue())


def assert_clean_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("powerinfer: error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
