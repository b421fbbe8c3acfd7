"""Bad input on the command line: one clear line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_helpers import assert_clean_error, run_cli, run_cli_here


def test_missing_model_file():
    assert_clean_error(run_cli("generate", "-m", "/nonexistent/model.gguf", "-p", "hi"), "no such file")


def test_not_a_model(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    assert_clean_error(run_cli("generate", "-m", str(p), "-p", "hi"), "not a GGUF file or HF model directory")
    assert_clean_error(run_cli("generate", "-m", str(tmp_path), "-p", "hi"), "no config.json")


def test_truncated_gguf(tmp_path, smollm2_path):
    p = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        p.write_bytes(f.read(40_000_000))
    assert_clean_error(run_cli("generate", "-m", str(p), "-p", "hi"), "truncated")


def test_corrupt_gguf(tmp_path, smollm2_path):
    p = tmp_path / "corrupt.gguf"
    with open(smollm2_path, "rb") as f:
        data = bytearray(f.read(2_000_000))
    data[8:24] = b"\xff" * 16  # tensor and metadata counts become absurd
    p.write_bytes(bytes(data))
    assert_clean_error(run_cli("generate", "-m", str(p), "-p", "hi"), "corrupt")


def test_unsupported_architecture(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    save_file({"wte.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    assert_clean_error(run_cli("generate", "-m", str(tmp_path), "-p", "hi"), "unsupported model_type 'gpt2'")


def test_truncated_safetensors(chat_model_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(chat_model_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_clean_error(run_cli("generate", "-m", str(bad), "-p", "hi"), "safetensors")


def test_prompt_longer_than_context(chat_model_dir):
    assert_clean_error(run_cli_here("generate", "-m", str(chat_model_dir), "-p", "word " * 100), "context is 64 tokens")


def test_chat_survives_a_message_longer_than_the_context(chat_model_dir):
    """The context error is reported and the session goes on (it used to end the program)."""
    flags = ("-n", "6", "--temperature", "1", "--seed", "3")  # sampled: visible text from the random model
    r = run_cli_here("chat", "-m", str(chat_model_dir), *flags, stdin="word " * 100 + "\nHi there\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "context is 64 tokens" in r.stderr and "/reset" in r.stderr
    solo = run_cli_here("chat", "-m", str(chat_model_dir), *flags, stdin="Hi there\n/exit\n")
    assert r.stdout == solo.stdout and r.stdout.strip()  # the refused message left no trace


def test_bench_outputs_are_checked_before_any_work(tmp_path):
    """A missing folder or an existing file fails at once, not after minutes of benchmark."""
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"the user's")
    assert_clean_error(run_cli_here("bench", "ops", "--plot", str(tmp_path / "no" / "x.png")), "no such folder")
    assert_clean_error(run_cli_here("bench", "ops", "--plot", str(mine)), "--force")
    assert_clean_error(run_cli_here("bench", "e2e", "-o", str(mine)), "--force")
    assert mine.read_bytes() == b"the user's"


def test_generate_and_chat_run(chat_model_dir):
    r = run_cli("generate", "-m", str(chat_model_dir), "-p", "Hello", "-n", "5", "--temperature", "0", "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello") and "decode:" in r.stdout and "warm-up before:" in r.stdout
    r = run_cli("chat", "-m", str(chat_model_dir), "-n", "4", "--temperature", "0",
                stdin="Hi there\n/reset\nAnother question\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert len([l for l in r.stdout.splitlines()]) >= 2


def test_bench_ops_runs_on_a_small_shape(tmp_path, monkeypatch):
    from powerinfer.bench import ops

    # four small matrices, not thousands cycled above the LLC, and no 1 GiB bus probe: the
    # command's flow and output are under test here, the timing method in the test below
    monkeypatch.setattr(ops, "cache_bytes", lambda device: 0)
    monkeypatch.setattr(ops, "bus_probe", lambda device: (lambda: 2e9))
    plot = tmp_path / "ops.png"
    r = run_cli_here("bench", "ops", "--rows", "300", "--cols", "64", "--dtypes", "fp32,fp16", "--fractions", "0.1,1",
                "--repeats", "1", "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("| float32 |") == 2 and r.stdout.count("| float16 |") == 2
    assert plot.stat().st_size > 1000


def test_bench_ops_times_the_gpu_tier_ops_and_refuses_a_missing_device(monkeypatch):
    """`--device cuda` times ops/gpu.py's torch ops; here they run on CPU tensors (the same
    code, CUDA only adds the synchronize)."""
    import torch

    from powerinfer.bench import ops
    from powerinfer.bench.ops import bench_dtype

    monkeypatch.setattr(ops, "cache_bytes", lambda device: 0)  # four small matrices, not thousands
    rows = bench_dtype(torch.float16, 200, 48, [0.1, 1.0], 3, torch.device("cpu"), torch_ops=True,
                       probe=lambda: 2e9)
    assert [r["k"] for r in rows] == [20, 200]
    assert all(r["row_us"] > 0 and r["col_us"] > 0 and r["dense_us"] > 0 for r in rows)
    for r in rows:  # a steady bus: each cell's share is its rate over the bus
        assert r["bus_gbs"] == pytest.approx(2.0)
        assert r["row_bus"] == pytest.approx(r["row_gbs"] / 2.0, rel=1e-6)
        assert r["col_bus"] == pytest.approx(r["col_gbs"] / 2.0, rel=1e-6)
    if not torch.cuda.is_available():
        assert_clean_error(run_cli_here("bench", "ops", "--device", "cuda"), "no CUDA device")
    assert_clean_error(run_cli_here("bench", "ops", "--device", "tpu"), "unknown --device")


def test_bench_relu7b_refuses_a_model_that_does_not_fit(tmp_path):
    """Checked before anything is written: 512 layers of the 7B shape need ~500 GiB."""
    assert_clean_error(run_cli_here("bench", "relu7b", "--layers", "512", "--dir", str(tmp_path / "r")), "GiB of memory")
    assert not (tmp_path / "r").exists()


def test_warm_up_leaves_generation_unchanged(chat_model_dir):
    import powerinfer
    from powerinfer.engine.generate import warm_up

    lm = powerinfer.load(str(chat_model_dir))
    before = powerinfer.generate(lm, "Hello there", max_tokens=8, temperature=0)
    assert warm_up(lm.model) > 0
    assert powerinfer.generate(lm, "Hello there", max_tokens=8, temperature=0) == before


def test_logits_that_become_nan_stop_the_generation_with_a_clear_error(chat_model_dir, monkeypatch):
    """Weights can pass the load-time check and activations still overflow (fp16): the
    generation stops with one clear error, not a crash or tokens sampled from NaN."""
    import powerinfer
    from powerinfer.engine.generate import stream_generate
    from powerinfer.engine.sample import SamplingParams
    from powerinfer.errors import NonFiniteError

    lm = powerinfer.load(str(chat_model_dir))
    forward, calls = lm.model.forward, []

    def overflowing(tokens, cache, **kw):
        calls.append(1)
        logits = forward(tokens, cache, **kw)
        return torch.full_like(logits, float("nan")) if len(calls) == 3 else logits

    monkeypatch.setattr(lm.model, "forward", overflowing)
    got = []
    with pytest.raises(NonFiniteError, match="NaN or Inf at token 2"):
        for r in stream_generate(lm.model, lm.tokenizer, "Hello", 8, SamplingParams(temperature=0)):
            got.append(r.token)
    assert len(got) == 2  # the tokens before the overflow were delivered


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_an_unsupported_architecture_is_refused_before_torch_loads(tmp_path, kind):
    """Refused from the GGUF header or config.json alone (a fraction of a second; it used to
    take 10-20 s of loading), naming what is supported: torch is never imported."""
    import subprocess
    import sys

    import gguf
    import numpy as np

    if kind == "gguf":
        path = tmp_path / "mamba.gguf"
        w = gguf.GGUFWriter(str(path), "mamba")
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        fragment = "unsupported GGUF architecture 'mamba'; supported: falcon, gemma2, gemma3, llama, phi3, qwen2, qwen3"
    else:
        path = tmp_path / "mamba"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
        fragment = "unsupported model_type 'mamba'; supported:"
    code = ("import sys; from powerinfer.cli import main; rc = main(['generate', '-m', sys.argv[1], '-p', 'hi']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert_clean_error(r, fragment)


@pytest.mark.parametrize("argv,fragment", [
    (["generate", "--nope"], "unrecognized arguments: --nope"),  # was "-p/--prompt is required"
    (["generate"], "required: -p/--prompt"),
    (["generate", "-p"], "expected one argument"),
    (["bench", "ops", "--nope"], "unrecognized arguments: --nope"),
])
def test_flag_errors_name_the_flag(argv, fragment):
    from test_bad_input_corpus import run_main

    code, err = run_main(argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2 and fragment in lines[0] and lines[1].startswith("(see ")


def test_help_a_mistyped_subcommand_and_a_missing_model_answer_without_loading_torch():
    """Only the named subcommand's module is imported (cli.build_parser): `powerinfer --help`,
    an unknown subcommand and a model path that does not exist answer at once instead of
    after torch and the kernels load."""
    code = ("import contextlib, io, sys\nfrom powerinfer.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:\n"
            "    try:\n        main(['--help'])\n    except SystemExit as e:\n        assert e.code == 0\n"
            "    assert main(['genrate']) == 2\n"
            "    assert main(['generate', '-m', '/no/such/model.gguf', '-p', 'hi']) == 2\n"
            "assert \"invalid choice: 'genrate'\" in err.getvalue(), err.getvalue()\n"
            "assert '/no/such/model.gguf: no such file or directory' in err.getvalue(), err.getvalue()\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
