"""Shared fixtures: an isolated cache dir, tiny random HF models built with transformers'
own classes (the oracle), and the real embedded SmolLM2 GGUF."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before any OpenMP runtime loads: under `pytest -n 2` (make test) idle threads must sleep,
# not spin on the cores the other test process needs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The tests' own cached numba kernels inline helpers of powerinfer/ops (test_team's chain runs
# ops/team.py's protocol), and numba checks a cached kernel against its own file only: after an
# edit to ops/, they would run machine code built from the old helpers. Dropped here as the
# package's own are (ops/kernel_cache.py).
from powerinfer.ops import kernel_cache  # noqa: E402

_tests_cache = kernel_cache.cache_dir_for(Path(__file__).resolve().parent)
if _tests_cache is not None:
    kernel_cache.drop_stale(Path(kernel_cache.__file__).resolve().parent, _tests_cache)


if os.environ.get("POWERINFER_COMPILE_LOG"):  # diagnostics: which numba kernels a cold run compiles, and for how long
    import json as _json
    import time as _time

    from numba.core import event as _numba_event

    class _CompileLog(_numba_event.Listener):
        """Append one JSON line per numba compilation (a cache miss) to $POWERINFER_COMPILE_LOG."""

        def __init__(self):
            self._starts: list[float] = []  # compilations nest (a kernel compiles the functions it calls)

        def on_start(self, event):
            self._starts.append(_time.perf_counter())

        def on_end(self, event):
            fn, seconds = event.data["dispatcher"].py_func, _time.perf_counter() - self._starts.pop()
            with open(os.environ["POWERINFER_COMPILE_LOG"], "a") as f:
                f.write(_json.dumps({"kernel": f"{fn.__module__}.{fn.__qualname__}", "pid": os.getpid(),
                                     "seconds": round(seconds, 2),
                                     "nested": len(self._starts), "args": str(event.data.get("args"))}) + "\n")

    _numba_event.register("numba:compile", _CompileLog())


# The C functions (ops/symbols.py) are compiled at import under a lock per module, ~55 s on a
# cold cache: imported in one order by both test workers, one compiled them all while the
# other waited at each lock. Each worker starts with a different independent chain (lane_ir
# needs block_ir; cpu needs row_dots), so the two compile side by side; the other chain is
# then loaded from the cache. The same work in either order.
_CHAINS = ["powerinfer.ops.lane_ir", "powerinfer.ops.cpu"]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    import importlib

    _start = int(_WORKER[2:]) % len(_CHAINS)
    for _module in _CHAINS[_start:] + _CHAINS[:_start]:
        importlib.import_module(_module)


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Keep the tests' cache (tokenizers, hashes) out of the user's ~/.cache."""
    path = tmp_path_factory.mktemp("powerinfer-cache")
    old = os.environ.get("POWERINFER_CACHE")
    os.environ["POWERINFER_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("POWERINFER_CACHE", None)
    else:
        os.environ["POWERINFER_CACHE"] = old


# The GPU tier's device: the CPU always (the virtual GPU tier CI runs), CUDA where there is one
# (select those runs with `-k cuda`; benchmarks/gpu_check.sh does on a lent GPU).
GPU_TIERS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device"))]


@pytest.fixture(params=GPU_TIERS)
def gpu_tier(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from powerinfer.paths import default_model_path

    return default_model_path()


@pytest.fixture(autouse=True)
def deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, smollm2_path):
    """A tiny random llama with SmolLM2's tokenizer and chat template and a 64-token context."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from powerinfer.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("chat-model")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    load_tokenizer(smollm2_path).hf.save_pretrained(path)
    return path

