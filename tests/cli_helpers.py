"""Running the real `powerinfer` CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "powerinfer.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def assert_clean_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("powerinfer: error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
