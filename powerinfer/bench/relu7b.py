"""A ReluLLaMA-7B-shaped model with random weights and a planted power-law activation
pattern: decode tok/s dense vs sparse on the CPU, next to the memory-bandwidth bound.

    powerinfer bench relu7b [--layers 16] [--sparsity 0.9] [--dtype fp16] [--tokens 32] [--dir DIR]
                            [--d-model 4096 --ffn-dim 11008 --heads 32]

Shape: d 4096, FFN 11008, 32 heads (ReluLLaMA-7B); `--layers` of them (default 16: the dense
and the packed model, 7.3 GB each, fit a 24 GB machine, and the working set is ~200x the
last-level cache). The layer count sets the ceiling of sparse / dense: the attention
weights and the LM head are read by both engines, so at 10% active neurons the bytes per
token give at most 2.10x with 8 layers, 2.31x with 16 and 2.37x with all 32.

The model is written as an F16 GGUF file of the llama architecture, with SmolLM2's
tokenizer embedded, so other GGUF engines load the very same file (they run it as a SiLU
model; the speed comparison does not depend on the activation).

Planted pattern: each layer's neuron firing rates follow a power law with the given mean
sparsity (offline/synthetic.py, 20% of neurons carry 80% of activations); the predictors
are planted to select each neuron with its rate (a per-neuron bias plus input-dependent
noise standardised on real hidden states, then one offset per layer calibrated on the sparse
model's own decode), so about 10% of neurons are computed per token and the set changes
from token to token. The bound is this machine's read bandwidth, measured in the same run
(a probe per round, or the dense engine's own read rate in that round where that is more),
over the bytes a token must read: all attention weights and the LM head, the predictors,
and the active neurons' gate, up and down rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
from typing import Iterator, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from ..timing import decode_round


class Shape(NamedTuple):
    """Width, FFN neurons and heads of the benchmark model's layers."""

    d: int = 4096  # ReluLLaMA-7B's
    n_ff: int = 11008
    heads: int = 32


RELULLAMA_7B = Shape()
PROMPT = [1, 2, 3, 4]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16; ReluLLaMA-7B has 32)")
    p.add_argument("--sparsity", type=float, default=0.9, help="mean share of inactive neurons (default 0.9)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "q4_0"], default="fp16",
                   help="weight dtype in RAM (default fp16); q4_0 writes a Q4_0 GGUF that both engines read natively")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per round (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="dense/sparse round pairs, alternating (default 5)")
    p.add_argument("--rank", type=int, default=16, help="predictor rank (default 16)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write the GGUF and packed model (default: a temp dir)")
    add_shape_arguments(p)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=RELULLAMA_7B.d, help="model width (default 4096, ReluLLaMA-7B's)")
    p.add_argument("--ffn-dim", type=int, default=RELULLAMA_7B.n_ff, help="FFN neurons per layer (default 11008)")
    p.add_argument("--heads", type=int, default=RELULLAMA_7B.heads, help="attention heads (default 32)")


def check_planted_args(args: argparse.Namespace) -> None:
    """The flags of the planted-model benchmarks (relu7b, hybrid), checked before minutes
    of writing and packing."""
    from ..errors import require

    require(args.layers >= 1, "--layers must be >= 1")
    require(0 <= args.sparsity < 1, "--sparsity must be in [0, 1) (the mean share of inactive neurons)")
    require(args.tokens >= 1 and args.rounds >= 1, "--tokens and --rounds must be >= 1")
    require(args.rank >= 1, "--rank must be >= 1")
    require(args.threads >= 1, "--threads must be >= 1")


def shape_of(args: argparse.Namespace) -> Shape:
    from ..errors import BadArgumentError

    shape = Shape(args.d_model, args.ffn_dim, args.heads)
    if min(shape) < 1 or shape.d % shape.heads or (shape.d // shape.heads) % 2:
        raise BadArgumentError(f"--d-model {shape.d} must split into --heads {shape.heads} heads of an even size")
    return shape


def tokenizer_source():
    """The GGUF reader of the file whose tokenizer the benchmark model embeds (SmolLM2's)."""
    import gguf

    from ..paths import default_model_path

    return gguf.GGUFReader(default_model_path())


def vocab_size(src) -> int:
    return len(src.fields["tokenizer.ggml.tokens"].contents())


def write_gguf(path: str, n_layers: int, seed: int = 0, src=None, shape: Shape = RELULLAMA_7B,
               quant: str | None = None) -> None:
    """Random F16 llama-architecture GGUF with the tokenizer metadata of `src` (default
    `tokenizer_source()`); with `quant` (Q4_0) its matrices quantized by gguf's reference
    quantizer instead."""
    D, N_FF, HEADS = shape
    import gguf

    src = src or tokenizer_source()
    vocab = vocab_size(src)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("relullama-7b-shaped-random")
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(D)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if quant else gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    g = torch.Generator().manual_seed(seed)

    qtype = None if quant is None else gguf.GGMLQuantizationType[quant]

    def rand(*shape: int, scale: float) -> np.ndarray:
        return (torch.randn(*shape, generator=g) * scale).half().numpy()

    def add(name: str, t: np.ndarray) -> None:
        if qtype is None or t.ndim == 1:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", rand(vocab, D, scale=0.02))
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    add("output.weight", rand(vocab, D, scale=0.02))
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(D, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(D, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(p + name + ".weight", rand(D, D, scale=D**-0.5))
        add(p + "ffn_gate.weight", rand(N_FF, D, scale=D**-0.5))
        add(p + "ffn_up.weight", rand(N_FF, D, scale=D**-0.5))
        add(p + "ffn_down.weight", rand(D, N_FF, scale=0.1 * N_FF**-0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def ffn_inputs(model, n_tokens: int = 48) -> list[torch.Tensor]:
    """Each layer's FFN inputs along a greedy decode like the benchmark's (to standardise the
    planted predictors on the hidden states they will see)."""
    from ..offline.profile import instrumented

    xs: list[list[torch.Tensor]] = [[] for _ in model.layers]

    def obs(i):
        return lambda x, score: xs[i].append(x.clone())

    with instrumented(model, "gate_up", observers=[obs(i) for i in range(len(model.layers))]):
        decode_speed(model, n_tokens)
    return [torch.cat(x) for x in xs]


def planted_predictors(profile, xs: list[torch.Tensor], rank: int, model_hash: str):
    """Predictors whose logit for neuron i exceeds 0 with probability ~ its profiled rate."""
    from scipy.stats import norm

    from ..offline.train import LayerPredictor, Predictors

    D, N_FF = xs[0].shape[1], profile.layers[0].n_ff

    g = torch.Generator().manual_seed(2)
    layers = []
    for st, x in zip(profile.layers, xs):
        w1 = torch.randn(rank, D, generator=g) / D**0.5
        b1 = torch.zeros(rank)
        h = torch.relu(x @ w1.t())
        w2 = torch.randn(N_FF, rank, generator=g)
        z = h @ w2.t()
        mu, sd = z.mean(0), z.std(0).clamp_min(1e-6)
        w2 = w2 / sd[:, None]
        rate = np.clip(st.counts / st.tokens, 1e-4, 1 - 1e-4)
        b2 = torch.from_numpy(norm.ppf(rate).astype(np.float32)) - mu / sd
        layers.append(LayerPredictor(w1, b1, w2, b2, 0.0, 1.0, 1.0, float(1 - rate.mean()), float(1 - rate.mean()), {}))
    return Predictors(layers, {"model_hash": model_hash})


def calibrate_active_share(sparse, target: float, n: int = 32, max_passes: int = 8, tolerance: float = 0.03) -> float:
    """Shift each layer's predictor logits so that, on the sparse model's own decode of `n`
    tokens (the benchmark's; its hidden states differ from the dense model's the predictors
    were standardised on), the mean share of predicted neurons is `target`. Each layer's
    inputs depend on the layers before, so passes repeat until the measured share is within
    `tolerance` (relative) of the target; passes can overshoot, so the closest measured state
    is kept. Returns its share."""
    predictors = [layer.ffn.predictor for layer in sparse.layers]
    best: tuple[float, list[torch.Tensor], float] = (float("inf"), [], float("nan"))
    for _ in range(max_passes):
        records: list[list[np.ndarray]] = [[] for _ in predictors]
        for p, rec in zip(predictors, records):
            p.observe = rec.append  # every decode route (CPU or CUDA predictor) reports its logits
        decode_speed(sparse, n)
        for p in predictors:
            p.observe = None
        logits = [np.concatenate(r) for r in records]
        share = float(np.mean([np.mean(z > p.threshold) for z, p in zip(logits, predictors)]))
        if abs(share - target) < best[0]:
            best = (abs(share - target), [p.b2.clone() for p in predictors], share)
        if abs(share - target) <= tolerance * target:
            break
        for z, p in zip(logits, predictors):
            p.b2.sub_(float(np.quantile(z, 1 - target)) - p.threshold)  # in place: the numba path reads it
    for p, b2 in zip(predictors, best[1]):
        p.b2.copy_(b2)
    return best[2]


# Peak resident memory over the 16-bit model size: the dense and the packed model, and while
# one loads its load buffers (the GGUF's float tensors are mapped, not copied, and packing
# runs with the dense model freed). Observed: 16 layers (7.3 GB) peaked at 15.5 GB anonymous.
PEAK_OVER_MODEL = 2.6


def model_bytes(layers: int, vocab: int, shape: Shape = RELULLAMA_7B) -> int:
    """16-bit weight bytes of the 7B-shaped model with `layers` layers (embeddings and LM head
    of `vocab` rows each)."""
    D, N_FF, _ = shape
    return 2 * (layers * (4 * D * D + 3 * D * N_FF) + 2 * vocab * D)


def check_memory(layers: int, vocab: int, shape: Shape = RELULLAMA_7B) -> None:
    """Refuse, in one line, a layer count whose run would not fit in this machine's memory."""
    from ..engine.packed import available_ram
    from ..errors import BadArgumentError

    need, have = PEAK_OVER_MODEL * model_bytes(layers, vocab, shape), available_ram()
    if need > have:
        raise BadArgumentError(f"--layers {layers} needs about {need / 2**30:.1f} GiB of memory (the dense model, "
                               f"its packed copy and load buffers), {have / 2**30:.1f} GiB are available; try a smaller --layers")


def decode_speed(model, n: int) -> float:
    return decode_round(model, PROMPT, n)[1]


def gguf_name(layers: int, shape: Shape, quant: str | None = None) -> str:
    kind = "f16" if quant is None else quant.lower()
    if shape == RELULLAMA_7B:
        return f"relullama-7b-shaped-{layers}l.{kind}.gguf"
    return f"planted-{shape.d}d-{shape.n_ff}ff-{shape.heads}h-{layers}l.{kind}.gguf"


def engine_dtype(args: argparse.Namespace) -> str:
    """The dtype our engines load the planted file in: its own blocks for a quantized file."""
    return "native" if args.dtype == "q4_0" else args.dtype


def file_quant(args: argparse.Namespace) -> str | None:
    return "Q4_0" if args.dtype == "q4_0" else None


def planted_model(args: argparse.Namespace, shape: Shape, root: str, place=None, src=None) -> tuple[str, str, object]:
    """Write (or reuse) the random GGUF in `root`, then plant the power-law profile and its
    predictors and pack the model, placed by `place(profile, model_hash)` (a placement
    document; default: every neuron on the CPU). Returns (GGUF path, packed dir, predictors)."""
    from ..loader import load
    from ..offline.pack import pack_model
    from ..offline.synthetic import synthetic_profile
    from ..paths import content_hash

    gguf_path = os.path.join(root, gguf_name(args.layers, shape, file_quant(args)))
    if not os.path.isfile(gguf_path):
        print(f"writing {gguf_path}", file=sys.stderr)
        # under a temporary name until complete: an interrupted write must not leave a
        # truncated file that the next run would take for the model
        partial = gguf_path + ".partial"
        write_gguf(partial, args.layers, src=src, shape=shape, quant=file_quant(args))
        os.replace(partial, gguf_path)
    model_hash = content_hash(gguf_path)
    dense = load(gguf_path, dtype=engine_dtype(args), threads=args.threads, with_tokenizer=False)
    profile = synthetic_profile(args.layers, shape.n_ff, sparsity=args.sparsity)
    profile.manifest.update(model={"hash": model_hash}, criterion="gate_up")
    profile.save(os.path.join(root, "profile"))
    packed_dir = os.path.join(root, "packed")
    preds = planted_predictors(profile, ffn_inputs(dense.model), args.rank, model_hash)
    del dense  # packing holds the model's state and the shards: not a third copy as well
    gc.collect()
    placement = place(profile, model_hash) if place is not None else None
    pack_model(gguf_path, packed_dir, profile, preds, placement, engine_dtype(args), force=True)
    gc.collect()
    return gguf_path, packed_dir, preds


@contextlib.contextmanager
def work_dir(path: str | None, prefix: str) -> Iterator[str]:
    """`path` (created, kept for the next run to reuse), or a temporary folder removed at the
    end: the planted model's GGUF and packed copy take ~14 GB at 16 layers, which a run
    without --dir must not leave behind."""
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
        return
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    from ..engine.packed import load_packed
    from ..loader import load
    from ..ops.memory import huge_page_share
    from ..timing import memory_read_bandwidth

    check_planted_args(args)
    torch.set_num_threads(args.threads)
    shape = shape_of(args)
    D, N_FF, _ = shape
    src = tokenizer_source()
    check_memory(args.layers, vocab_size(src), shape)
    with work_dir(args.dir, "relu7b-") as root:
        gguf_path, packed_dir, preds = planted_model(args, shape, root, src=src)
        # The sparse model first: its scattered row reads need huge pages more than the dense
        # model's sequential ones, and the second 7 GB model loaded finds them scarcer (16
        # layers, dense loaded first: dense 91%, sparse 78% of weights on huge pages).
        sparse_lm = load_packed(packed_dir, mode="sparse", dtype=engine_dtype(args), threads=args.threads, with_tokenizer=False,
                                predictor_bypass=None)  # calibrated below to the target share
        sparse = sparse_lm.model
        dense = load(gguf_path, dtype=engine_dtype(args), threads=args.threads, with_tokenizer=False)
        calibrated = calibrate_active_share(sparse, 1 - args.sparsity, n=args.tokens)
        decode_speed(dense.model, 2), decode_speed(sparse, 2)  # warm-up
        # Rounds alternate dense and sparse, and the bus is probed in each: this machine's
        # bandwidth drifts by 20-30% within minutes, so the ratio is taken per round (paired),
        # and each round runs dense, sparse, dense (half the tokens each time for dense), so that
        # a drift within the round weighs on both engines alike.
        d_speeds, s_speeds, active, probes = [], [], [], []
        half = max(1, args.tokens // 2)
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            probes.append(memory_read_bandwidth())
            before = decode_speed(dense.model, half)
            sparse_lm.ffn_stats.reset()
            s_speeds.append(decode_speed(sparse, args.tokens))
            active.append(sparse_lm.ffn_stats.active_fraction)
            after = decode_speed(dense.model, half)
            d_speeds.append(statistics.harmonic_mean([before, after]))  # tokens over time, both halves
        huge = {name: huge_page_share(m.tensors()) for name, m in (("dense", dense.model), ("sparse", sparse))}
        ratios = [b / a for a, b in zip(d_speeds, s_speeds)]
        # bytes per weight: 16-bit, or Q4_0 blocks (18 bytes / 32) with the sparse engine's
        # transposed down projection in Q8_0 (34 / 32)
        el, el_down = (18 / 32, 34 / 32) if file_quant(args) else (2, 2)
        attn = args.layers * 4 * D * D * el
        head = dense.model.lm_head.out_features * D * el
        pred = sum(p.n_params for p in preds.layers) * 4
        frac = statistics.mean(active)
        sparse_bytes = attn + head + pred + frac * args.layers * N_FF * D * (2 * el + el_down)
        dense_bytes = attn + head + args.layers * N_FF * 3 * D * el
        # The bus per round: its probe, or what the dense engine read in that round where that is
        # more (it reads the weights once per token, sequentially: a bound it beats is no bound).
        buses = [max(b, v * dense_bytes) for b, v in zip(probes, d_speeds)]
        bandwidth = max(buses)  # the best the bus did in this run
        d, s = statistics.median(d_speeds), statistics.median(s_speeds)
        bound = bandwidth / sparse_bytes
        # each round's share of its own bus (the bus swings within minutes)
        d_share = statistics.median(v * dense_bytes / b for v, b in zip(d_speeds, buses))
        s_share = statistics.median(v * sparse_bytes / b for v, b in zip(s_speeds, buses))
        source = "the dense engine's own reads" if bandwidth > max(probes) else "a probe"
        what = "ReluLLaMA-7B-shaped" if shape == RELULLAMA_7B else f"planted d {D}, {N_FF} neurons, {shape.heads} heads"
        print(f"\n{what}, {args.layers} layers, {args.dtype}, {args.threads} threads; planted mean sparsity "
              f"{args.sparsity}; {frac:.3f} of FFN neurons computed per token (calibrated to {calibrated:.3f}); "
              f"bandwidth {bandwidth / 1e9:.1f} GB/s (the run's best, from {source}; probes {min(probes) / 1e9:.1f}-"
              f"{max(probes) / 1e9:.1f}); median of {args.rounds} rounds x {args.tokens} tokens; weights on huge pages: "
              + ", ".join(f"{k} {'?' if v is None else f'{v:.0%}'}" for k, v in huge.items()) + "\n")
        print("| engine | decode tok/s | bytes/token | bound tok/s (best bus) | share of it | share of each round's bus |"
              "\n|---|---|---|---|---|---|")
        print(f"| dense | {d:.2f} | {dense_bytes / 1e9:.2f} GB | {bandwidth / dense_bytes:.2f} | "
              f"{d / (bandwidth / dense_bytes):.0%} | {d_share:.0%} |")
        print(f"| sparse | {s:.2f} | {sparse_bytes / 1e9:.2f} GB | {bound:.2f} | {s / bound:.0%} | {s_share:.0%} |")
        print(f"\nsparse / dense: {s / d:.2f}x (median of medians); per round {statistics.median(ratios):.2f}x median, "
              f"{min(ratios):.2f}-{max(ratios):.2f}x; GGUF for other engines: {gguf_path}")
        return 0
