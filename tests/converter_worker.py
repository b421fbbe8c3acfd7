"""A long-lived llama.cpp converter for the test session: imports convert_hf_to_gguf.py once
(torch and the converter take ~5 s to import, more than converting a tiny model) and runs
its own `main()` for each job read from stdin, as `python convert_hf_to_gguf.py ARGS` would.

Protocol: one JSON list of converter arguments per line in; one JSON line out per job,
{"ok": true} or {"ok": false, "error": "..."}. The converter's own output goes to stderr.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path


def main() -> None:
    converter = Path(sys.argv[1])
    sys.path.insert(0, str(converter.parent))  # as when run as a script: its `conversion` package
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", converter)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    replies = sys.stdout
    for line in sys.stdin:
        sys.argv = [str(converter)] + json.loads(line)
        reply: dict = {"ok": True}
        try:
            with contextlib.redirect_stdout(sys.stderr):
                module.main()
        except SystemExit as done:
            if done.code not in (None, 0):
                reply = {"ok": False, "error": f"the converter exited with {done.code}"}
        except BaseException:  # noqa: BLE001 - any failure of one job is reported, the next job still runs
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
