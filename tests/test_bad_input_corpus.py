"""A corpus of bad input, generated here: GGUF files cut short at many offsets and with
corrupt header fields, NaN weights, bad HF configs and safetensors, bad packed models, bad
flags and outputs aimed at the user's files: at least 120 cases (each corpus asserts its
share: 45 GGUF, 45 HF, 30 packed, 60 flags and outputs). Each case must end with exit status 2, one
`powerinfer: error:` line (a `(see ... --help)` hint may follow), no traceback, and every
file that was there before (inputs and the user's own) exactly as it was.

The CLI runs in this process (`powerinfer.cli.main`), so the ~150 cases take seconds, not the
minutes of as many interpreters; a handful also run as real subprocesses at the end. Bad HTTP
requests are in test_server.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_clean_error, run_cli
from gguf_export import export_gguf
from tiny_models import build_tokenized_llama

NOISE = ("note:", "loading ", "pack:", "wrote ")  # our own progress lines, allowed before the error


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, smollm2_path):
    """Good inputs the cases spoil: an HF directory, its GGUF (with SmolLM2's tokenizer) and
    a packed model of it, and a folder of the user's own files."""
    root = tmp_path_factory.mktemp("corpus")
    hf = build_tokenized_llama(root / "hf", smollm2_path)
    export_gguf(hf, root / "tiny.gguf", tokenizer_from=smollm2_path)
    from powerinfer.cli import main

    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
        assert main(["profile", "-m", str(hf), "--prompts", "2", "--heldout", "0", "--max-tokens", "16",
                     "-o", str(root / "profile")]) == 0, quiet.getvalue()
        assert main(["pack", "-m", str(hf), "--profile", str(root / "profile"), "--predictors", "none",
                     "-o", str(root / "packed")]) == 0, quiet.getvalue()
    user = root / "user"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("the user's notes")
    (user / "sub" / "mine.txt").write_text("more of the user's files")
    (root / "existing.json").write_text('{"the user": "wrote this"}')
    return root


def fingerprint(root: Path) -> dict[str, tuple]:
    """Every file and folder under `root` with its inode, size and modification time: any
    write, replacement, creation or removal changes it (hashing the corpus's hundreds of MB
    before and after each case would take minutes)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def run_main(argv: list[str], stdin: str = "") -> tuple[int, str]:
    """Exit status and stderr of `powerinfer ARGV`, run in this process."""
    import sys

    from powerinfer.cli import main

    err, out = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    finally:
        sys.stdin = old_stdin
    return code, err.getvalue()


def check_case(name: str, root: Path, argv: list[str], fragment: str | None = None) -> str | None:
    """Run one case in folder `root`; None when it behaved, else what went wrong."""
    before = fingerprint(root)
    try:
        code, err = run_main(argv)
    except BaseException as e:  # would have been a traceback
        return f"{name}: raised {type(e).__name__}: {e}"
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith(NOISE) and "\r" not in l]
    errors = [l for l in lines if l.startswith("powerinfer: error:")]
    problems = []
    if code != 2:
        problems.append(f"exit {code}")
    if "Traceback" in err:
        problems.append("traceback")
    if len(errors) != 1 or len(lines) > 2 or (len(lines) == 2 and not lines[1].startswith("(see")):
        problems.append(f"not one error line: {lines!r}")
    if fragment and errors and fragment not in errors[0]:
        problems.append(f"{fragment!r} not in {errors[0]!r}")
    if fingerprint(root) != before:
        problems.append("files changed")
    return f"{name}: {'; '.join(problems)} | {err.strip()[-300:]!r}" if problems else None


def run_corpus(cases: list[tuple], root: Path) -> None:
    failures = [f for f in (check_case(*c[:1], root, *c[1:]) for c in cases) if f]
    assert not failures, f"{len(failures)} of {len(cases)} cases misbehaved:\n" + "\n".join(failures)


# -- GGUF --------------------------------------------------------------------------------------

def gguf_layout(path: Path) -> dict[str, int]:
    """Byte offsets of structural fields in the GGUF file (to corrupt them)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    pos = {}
    for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                "llama.attention.head_count_kv", "llama.context_length", "tokenizer.ggml.tokens",
                "tokenizer.ggml.model"):
        f = r.fields[key]
        value = f.offset + 8 + len(key) + 4  # key length, key, value type
        pos[key + ":type"] = f.offset + 8 + len(key)
        pos[key] = value
    for t in r.tensors[:3]:
        name_end = t.field.offset + 8 + len(t.name)
        pos[t.name + ":n_dims"] = name_end
        pos[t.name + ":dim0"] = name_end + 4
        pos[t.name + ":type"] = name_end + 4 + 8 * len(t.shape)
        pos[t.name + ":offset"] = name_end + 4 + 8 * len(t.shape) + 4
        pos[t.name + ":data"] = int(t.data_offset)
    pos["tensor_info"] = r.tensors[0].field.offset
    pos["data"] = int(r.tensors[0].data_offset)
    pos["last_tensor_end"] = int(r.tensors[-1].data_offset + r.tensors[-1].n_bytes)
    return pos


def spoil(src: Path, dst: Path, at: int, new: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at:at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def test_gguf_corpus(corpus):
    good = corpus / "tiny.gguf"
    code, err = run_main(["generate", "-m", str(good), "-p", "Hello", "-n", "2"])
    assert code == 0, err  # the intact file runs: each case below fails because of its one fault
    bad = corpus / "gguf"
    bad.mkdir()
    size = good.stat().st_size
    pos = gguf_layout(good)
    cases = []
    # cut short at many offsets: header, metadata, tensor table, data
    cuts = [0, 3, 4, 7, 12, 20, 24, 30, 200, 5000, 100_000, 400_000, 800_000, 1_200_000, pos["tensor_info"] + 5,
            pos["data"] - 1, pos["data"] + 100, (pos["data"] + size) // 2, size - 4096, size - 1]
    for cut in cuts:
        p = bad / f"cut-{cut}.gguf"
        p.write_bytes(good.read_bytes()[:cut])
        cases.append((f"gguf cut at {cut}", ["generate", "-m", str(p), "-p", "hi"]))
    ff4, ff8 = b"\xff" * 4, b"\xff" * 8
    corruptions = {
        "magic": (0, b"GGUX", "not a GGUF"), "version": (4, ff4, "version"), "tensor count": (8, ff8, None),
        "field count": (16, ff8, None), "first key length": (24, ff8, None),
        "architecture type": (pos["general.architecture:type"], ff4, "type"),
        "architecture length": (pos["general.architecture"], ff8, None),
        "architecture name": (pos["general.architecture"] + 8, b"lxama", "lxama"),
        "tokens item type": (pos["tokenizer.ggml.tokens"], ff4, "item type"),
        "tokens count": (pos["tokenizer.ggml.tokens"] + 4, ff8, None),
        "tokenizer model": (pos["tokenizer.ggml.model"] + 8, b"xxxx", "tokenizer"),
        "block count huge": (pos["llama.block_count"], ff4, None),
        "block count zero": (pos["llama.block_count"], b"\0" * 4, None),
        "embedding length": (pos["llama.embedding_length"], struct.pack("<I", 48), None),
        "head count zero": (pos["llama.attention.head_count"], b"\0" * 4, None),
        "kv head count 3": (pos["llama.attention.head_count_kv"], struct.pack("<I", 3), None),
        "context zero": (pos["llama.context_length"], b"\0" * 4, None),
    }
    for t in ("token_embd.weight", "blk.0.attn_norm.weight"):
        if t + ":n_dims" in pos:
            corruptions.update({
                f"{t} n_dims": (pos[t + ":n_dims"], ff4, "dimensions"),
                f"{t} dim0": (pos[t + ":dim0"], ff8, None),
                f"{t} type": (pos[t + ":type"], ff4, "unknown type"),
                f"{t} offset": (pos[t + ":offset"], ff8, None),
                f"{t} NaN": (pos[t + ":data"] + 64, np.full(4, np.nan, np.float32).tobytes(), "NaN"),
                f"{t} Inf": (pos[t + ":data"] + 128, np.full(2, np.inf, np.float32).tobytes(), "NaN or Inf"),
            })
    for name, (at, new, fragment) in corruptions.items():
        p = spoil(good, bad / f"{name.replace(' ', '-')}.gguf", at, new)
        cases.append((f"gguf {name}", ["generate", "-m", str(p), "-p", "hi"], fragment))
    assert len(cases) >= 45
    run_corpus(cases, corpus)


# -- HF directories ----------------------------------------------------------------------------

def hf_variant(corpus: Path, name: str, config: dict | str | None = None, weights=None) -> Path:
    """A copy of the good HF directory with config.json and/or the weights replaced."""
    d = corpus / "hf-bad" / name
    shutil.copytree(corpus / "hf", d)
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        weights(d / "model.safetensors")
    return d


def test_hf_corpus(corpus):
    cfg = json.loads((corpus / "hf" / "config.json").read_text())
    cases = []

    def add(name, config=None, weights=None, fragment=None):
        d = hf_variant(corpus, name, config, weights)
        cases.append((f"hf {name}", ["generate", "-m", str(d), "-p", "hi"], fragment))

    add("config not json", "{oops", fragment="config.json")
    add("config a list", "[1, 2]", fragment="config.json")
    add("config empty", "", fragment="config.json")
    add("no model_type", {k: v for k, v in cfg.items() if k != "model_type"}, fragment="model_type")
    add("model_type gpt2", {**cfg, "model_type": "gpt2"}, fragment="gpt2")
    add("model_type number", {**cfg, "model_type": 7}, fragment="model_type")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        add(f"no {key}", {k: v for k, v in cfg.items() if k != key}, fragment="config.json")
        add(f"{key} text", {**cfg, key: "many"}, fragment=key)
        add(f"{key} zero", {**cfg, key: 0}, fragment=key)
    add("more layers than weights", {**cfg, "num_hidden_layers": 5}, fragment="config.json")
    add("heads do not divide", {**cfg, "num_attention_heads": 3}, fragment="config.json")
    add("kv heads do not divide", {**cfg, "num_key_value_heads": 3}, fragment="config.json")
    add("vocab disagrees", {**cfg, "vocab_size": 100}, fragment="config.json")
    add("ffn disagrees", {**cfg, "intermediate_size": 65}, fragment="config.json")
    add("hidden disagrees", {**cfg, "hidden_size": 48}, fragment="config.json")
    add("context zero", {**cfg, "max_position_embeddings": 0}, fragment="max_seq_len")
    add("eps text", {**cfg, "rms_norm_eps": "tiny"}, fragment="rms_norm_eps")
    add("unknown activation", {**cfg, "hidden_act": "swish2"}, fragment="swish2")
    add("dynamic rope", {**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, fragment="RoPE")
    add("untied without lm_head", {**cfg, "tie_word_embeddings": False}, fragment="lm_head")
    add("no weights", weights=lambda f: f.unlink(), fragment="safetensors")

    def cut(n):
        return lambda f: f.write_bytes(f.read_bytes()[:n])

    size = (corpus / "hf" / "model.safetensors").stat().st_size
    for n in (0, 5, 8, 100, 2000, size // 3, size - 10):
        add(f"weights cut at {n}", weights=cut(n), fragment="truncated safetensors")
    add("header length huge", weights=lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:]), fragment="safetensors")
    add("header garbage", weights=lambda f: f.write_bytes(f.read_bytes()[:8] + b"#" * 40 + f.read_bytes()[48:]),
        fragment="safetensors")

    def poisoned(name: str, value: float):
        def write(f):
            from safetensors.torch import load_file, save_file

            sd = load_file(str(f))
            sd[name] = sd[name].clone()
            sd[name].view(-1)[3] = value
            save_file(sd, str(f), metadata={"format": "pt"})
        return write

    add("NaN weight", weights=poisoned("model.layers.1.mlp.down_proj.weight", float("nan")), fragment="NaN")
    add("Inf weight", weights=poisoned("model.layers.0.input_layernorm.weight", float("inf")), fragment="NaN or Inf")

    def without(name: str):
        def write(f):
            from safetensors.torch import load_file, save_file

            sd = load_file(str(f))
            del sd[name]
            save_file(sd, str(f), metadata={"format": "pt"})
        return write

    add("missing tensor", weights=without("model.layers.1.self_attn.k_proj.weight"), fragment="k_proj")

    def reshaped(f):
        from safetensors.torch import load_file, save_file

        sd = load_file(str(f))
        sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:-1].contiguous()
        save_file(sd, str(f), metadata={"format": "pt"})

    add("tensor of the wrong shape", weights=reshaped, fragment="shape [127, 32]")
    d = hf_variant(corpus, "tokenizer corrupt")
    (d / "tokenizer.json").write_text("{not json")
    cases.append(("hf tokenizer corrupt", ["generate", "-m", str(d), "-p", "hi"], "tokenizer"))
    assert len(cases) >= 45
    run_corpus(cases, corpus)


# -- packed models -----------------------------------------------------------------------------

def packed_variant(corpus: Path, name: str, edit=None, shard=None) -> Path:
    d = corpus / "packed-bad" / name
    shutil.copytree(corpus / "packed", d)
    if edit is not None:
        m = json.loads((d / "manifest.json").read_text())
        edited = edit(m)
        (d / "manifest.json").write_text(edited if isinstance(edited, str) else json.dumps(m))
    if shard is not None:
        shard(d)
    return d


def test_packed_corpus(corpus):
    cases = []

    def add(name, edit=None, shard=None, fragment=None):
        d = packed_variant(corpus, name, edit, shard)
        cases.append((f"packed {name}", ["generate", "--packed", str(d), "--mode", "sparse", "-p", "hi", "-n", "2"],
                      fragment))

    def drop(key):
        return lambda m: m.pop(key)

    def put(path: str, value):
        def edit(m):
            *head, last = path.split(".")
            node = m
            for k in head:
                node = node[int(k)] if k.isdigit() else node[k]
            node[int(last) if last.isdigit() else last] = value
        return edit

    for key in ("shards", "placement", "source", "args", "layers", "family", "format_version", "dtype"):
        add(f"no {key}", drop(key), fragment=key)
    add("format_version text", put("format_version", "1"), fragment='"1"')
    add("format_version 2", put("format_version", 2), fragment="version 2")
    add("another format", put("format", "powerinfer-profile"), fragment="format")
    add("manifest not json", lambda m: "{oops", fragment="manifest")
    add("manifest empty", lambda m: "", fragment="manifest")
    add("manifest a list", lambda m: "[]", fragment="manifest")
    add("n_heads 3", put("args.n_heads", 3), fragment="n_heads")
    add("n_heads 0", put("args.n_heads", 0), fragment="n_heads")
    add("vocab disagrees", put("args.vocab_size", 100), fragment="vocab")
    add("ffn disagrees", put("args.ffn_dim", 60), fragment=None)
    add("d_model disagrees", put("args.d_model", 48), fragment=None)
    add("one layer more", put("args.n_layers", 3), fragment="layer")
    add("neuron count disagrees", put("layers.0.n_cpu", 63), fragment="neurons")
    add("threshold text", put("layers.1.threshold", "high"), fragment="threshold")
    add("shard bytes disagree", put("shards.cpu.bytes", 12), fragment="bytes")
    add("unknown dtype", put("dtype", "int3"), fragment="dtype")

    def cut_shard(n):
        def f(d):
            p = d / "cpu.safetensors"
            p.write_bytes(p.read_bytes()[:n])
        return f

    size = (corpus / "packed" / "cpu.safetensors").stat().st_size
    for n in (0, 10, 1000, size // 2, size - 1):
        add(f"shard cut at {n}", shard=cut_shard(n), fragment="cpu.safetensors")

    def flip(d):
        p = d / "cpu.safetensors"
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF
        p.write_bytes(bytes(data))

    add("shard bytes flipped", shard=flip, fragment="hash")

    def nan_keeping_mtime(d):
        """NaN written over weights with the file's size and mtime kept: the memoised hash
        cannot see it, the finite check must."""
        from safetensors.torch import load_file, save_file

        p = d / "cpu.safetensors"
        from powerinfer.paths import content_hash

        content_hash(str(p))  # memoise the good file's hash by (path, size, mtime)
        st = p.stat()
        sd = load_file(str(p))
        key = next(k for k in sd if k.endswith("ffn.cpu.gate"))
        sd[key] = sd[key].clone()
        sd[key].view(-1)[:4] = float("nan")
        save_file(sd, str(p))
        assert p.stat().st_size == st.st_size
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))

    add("NaN in a shard, mtime kept", shard=nan_keeping_mtime, fragment="NaN")
    add("missing shard", shard=lambda d: (d / "gpu.safetensors").unlink(), fragment="missing shard")
    assert len(cases) >= 30
    run_corpus(cases, corpus)


# -- flags and outputs -------------------------------------------------------------------------

def test_flag_corpus(corpus):
    hf = str(corpus / "hf")
    g = ["generate", "-m", hf, "-p", "hi"]
    flags = [
        [], ["bogus"], ["generate"], [*g, "-n", "nan"], [*g, "-n", "1e9"], [*g, "-n", "-3"], [*g, "--dtype", "int8"],
        [*g, "--temperature", "-1"], [*g, "--temperature", "nan"], [*g, "--temperature", "3"],
        [*g, "--top-p", "0"], [*g, "--top-p", "1.5"], [*g, "--min-p", "2"], [*g, "--top-k", "-1"],
        [*g, "--repetition-penalty", "0"], [*g, "--seed", str(2**64)], [*g, "-t", "0"], [*g, "--mode", "fast"],
        [*g, "--unknown-flag"], [*g, "--gpu-device", "tpu"], ["generate", "-m", hf, "-p", "caf\udce9 \udcff"],
        ["generate", "-m", hf, "-p", "hi", "--stop", "\udcff"], ["generate", "-m", hf, "-p", "word " * 100],
        ["generate", "-m", str(corpus / "nope.gguf"), "-p", "hi"], ["generate", "-m", str(corpus / "existing.json"),
                                                                   "-p", "hi"],
        ["solve", "--vram-budget", "-5GiB", "--profile", str(corpus / "profile"), "--shape", "relullama-7b"],
        ["solve", "--vram-budget", "1e23TiB", "--profile", str(corpus / "profile"), "--shape", "relullama-7b"],
        ["solve", "--vram-budget", "lots"], ["prepare", "-m", hf, "--vram-budget", "1e23TiB"],
        ["prepare", "-m", hf, "--vram-budget", "-1GiB"], ["prepare", "-m", hf, "--vram-budget", "100TiB"],
        ["prepare", "-m", hf, "--vram-budget", "100TiB", "--hardware", "rtx4090"],
        ["prepare", "-m", hf, "--target-sparsity", "1.5"],
        ["prepare", "-m", hf, "--hardware", "no-such-gpu"], ["prepare", "-m", hf, "--predictors", "some"],
        ["profile", "-m", hf, "--prompts", "0"], ["profile", "-m", hf, "--target-sparsity", "nan"],
        ["profile", "--report", str(corpus / "user")], ["train", "-m", hf, "--budget", "0"],
        ["pack", "-m", hf, "--profile", str(corpus / "user"), "-o", str(corpus / "out-x")],
        ["pack", "-m", hf, "--profile", str(corpus / "profile"), "--dtype", "q3", "-o", str(corpus / "out-y")],
        ["serve", "--port", "abc"], ["serve", "-m", hf, "--port", "70000"], ["serve", "-m", hf, "--max-batch", "0"],
        ["hardware", "--show", "no-such-profile"], ["bench", "ops", "--repeats", "0"], ["bench", "nothing"],
        ["chat", "-m", hf, "--top-p", "nan"],
    ]
    cases = [(f"flags {' '.join(a)[-80:]!r}", a) for a in flags]
    # the message names the flag at fault (and the benchmarks refuse before writing --dir)
    small = ["--layers", "4", "--d-model", "256", "--ffn-dim", "1024", "--heads", "4"]
    named = [
        ([*g, "--temperature", "-1"], "temperature"), ([*g, "--top-p", "0"], "top_p"), ([*g, "-n", "-3"], "max_tokens"),
        ([*g, "-t", "0"], "threads"), ([*g, "--temperature", "nan"], "temperature"),
        ([*g, "--repetition-penalty", "nan"], "repetition_penalty"),  # NaN fails every comparison
        (["bench", "ops", "--repeats", "0"], "--repeats"), (["bench", "ops", "--fractions", "0.1,abc"], "--fractions"),
        (["bench", "ops", "--fractions", "1.5"], "--fractions"), (["bench", "ops", "--cols", "-3"], "--rows and --cols"),
        (["bench", "relu7b", "--sparsity", "1", "--dir", str(corpus / "d")], "--sparsity"),
        (["bench", "relu7b", "--layers", "0", "--dir", str(corpus / "d")], "--layers"),
        (["bench", "hybrid", "--rank", "0", "--dir", str(corpus / "d")], "--rank"),
        (["bench", "e2e", "--outputs", "128,x"], "--outputs"),
        (["bench", "hybrid", *small, "--vram-fraction", "1.5"], "between 0 and 1"),
        (["bench", "hybrid", *small, "--hardware", "cpu"], "has no GPU"),
        (["bench", "hybrid", *small, "--vram-fraction", "0.01", "--dir", str(corpus / "d")], "before any neuron"),
        (["bench", "hybrid", "--d-model", "250", "--heads", "4"], "even size"),
        (["generate", "-m", hf, "--mode", "dense", "-p", "Hi", "--kv-on-gpu"], "--kv-on-gpu needs the packed engine"),
        (["generate", "-m", hf, "--mode", "sparse", "-p", "Hi"], "has not been prepared"),
        (["generate", "--packed", str(corpus / "nowhere"), "-p", "Hi"], "no such packed model"),
        (["chat", "-m", hf, "-n", "-1"], "max_tokens"),  # chat checks its flags before the first message
        (["chat", "-m", hf, "--top-p", "nan"], "top_p"),
    ]
    cases += [(f"flag {' '.join(a)[-60:]!r}", a, fragment) for a, fragment in named]
    # outputs aimed at the user's own files and folders: refused before any work, nothing touched
    user, existing = str(corpus / "user"), str(corpus / "existing.json")
    outputs = [
        ["pack", "-m", hf, "--profile", str(corpus / "profile"), "--predictors", "none", "-o", user],
        ["pack", "-m", hf, "--profile", str(corpus / "profile"), "--predictors", "none", "-o", user, "--force"],
        ["pack", "-m", hf, "--profile", str(corpus / "profile"), "--predictors", "none", "-o", existing],
        ["pack", "-m", hf, "--profile", str(corpus / "profile"), "--predictors", "none", "-o", str(corpus / "packed")],
        ["profile", "--synthetic", "-m", hf, "-o", user], ["profile", "--synthetic", "-m", hf, "-o", user, "--force"],
        ["profile", "--synthetic", "-m", hf, "-o", str(corpus / "profile")],
        ["profile", "--synthetic", "-m", hf, "-o", str(corpus / "no" / "such" / "folder")],
        ["train", "-m", hf, "--profile", str(corpus / "profile"), "-o", user],
        ["solve", "--profile", str(corpus / "profile"), "--shape", "relullama-7b", "-o", existing],
        ["hardware", "--measure", "-o", existing], ["bench", "e2e", "-o", existing],
        ["bench", "ops", "--plot", existing], ["bench", "ops", "--plot", str(corpus / "no" / "x.png")],
    ]
    cases += [(f"output {' '.join(a[-3:])!r}", a) for a in outputs]
    assert len(cases) >= 60
    run_corpus(cases, corpus)


@pytest.mark.parametrize("argv,fragment", [
    (["generate", "-n", "nan", "-p", "hi"], "invalid int value"),
    (["solve", "--vram-budget", "-5GiB"], "negative"),
    (["generate", "-p", "caf\udce9"], "not valid UTF-8"),
])
def test_a_few_cases_as_real_processes(argv, fragment):
    """The same rules through the real entry point (argv decoded by Python, exit status)."""
    assert_clean_error(run_cli(*argv), fragment)
