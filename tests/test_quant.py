"""GGUF quantized blocks kept as they are (ops/quant.py): every kernel against its reference
twin (gguf's dequantize and the activations quantized to int8 per 32 as the kernels
quantize them, then the fp32 op), every format, odd shapes, 1 and 2 threads; and the dense
engine on the default model's own Q4_1/Q8_0 weights against the fp32 path."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from powerinfer.ops import block_ir, block_lanes, cpu, decode, lanes, panels, quant, reference
from powerinfer.ops.activations import activation_id
from powerinfer.ops.linear import Linear
from powerinfer.ops.weights import LaneWeight, QuantWeight, weight_for

FORMATS = list(quant.FORMATS)


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def acts(x: torch.Tensor) -> torch.Tensor:
    """x as the block kernels multiply it: int8 per 32 values, one scale each."""
    return torch.from_numpy(block_ir.reference_acts(x.float().numpy()))


def quantized(rows: int, cols: int, fmt: str, seed: int = 0) -> torch.Tensor:
    """Random weights in `fmt`: quantized by gguf where it can, else (K-quants, which gguf only
    dequantizes) random blocks with small valid fp16 scales."""
    rng = np.random.default_rng(seed)
    per, nbytes = quant.FORMATS[fmt]
    cols = -(-cols // per) * per
    if fmt not in K_QUANTS:
        w = (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)
        return quant.from_gguf(quantize(w, GGMLQuantizationType[fmt]), fmt, rows, cols)
    q = rng.integers(0, 256, (rows, cols // per, nbytes), dtype=np.uint8)
    scales = np.frombuffer(np.array([0.01, 0.004], dtype=np.float16).tobytes(), dtype=np.uint8)
    if fmt == "Q6_K":
        q[:, :, 208:210] = scales[:2]
    else:
        q[:, :, 0:4] = scales
    return torch.from_numpy(q)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (130, 576), (67, 1536)])  # K-quants: cols up to 256s
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_matches_reference(fmt, rows, cols, threads):
    t = quantized(rows, cols, fmt, seed=rows)
    cols = quant.shape_of(t)[1]
    assert quant.format_of(t) == fmt and quant.shape_of(t)[0] == rows
    dense = quant.dequantize(t)
    x = torch.randn(cols, generator=torch.Generator().manual_seed(1))
    b = torch.randn(rows)
    res = torch.randn(rows)
    out = np.empty(rows, dtype=np.float32)
    numba.set_num_threads(threads)
    try:
        panels.gemv_any(t.numpy(), x.numpy(), b.numpy(), res.numpy(), out, threads)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    torch.testing.assert_close(torch.from_numpy(out), reference.gemv(dense, acts(x), b, res), atol=2e-4, rtol=1e-4)


def _row_dot_for(isa: str, bb: int, monkeypatch):
    """A one-row, one-vector block dot whose integer dots are `isa`'s, compiled on this
    machine (the AVX2 and plain code run on any AVX-512 CPU too)."""
    from numba import njit

    monkeypatch.setattr(block_ir, "_isa", lambda: isa)
    dots = block_ir._block_dots(bb, 1, 1)

    @njit
    def run(w, qa):
        return dots((w.ctypes.data,), w.shape[1], (qa.ctypes.data,))[0]

    return run


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_dots_of_every_cpu_kind_give_the_same_bits(fmt, monkeypatch):
    """Machines differ (some AVX-512 VNNI, some AVX2 only, older ones neither) and numba
    compiles for the host: VNNI's vpdpbusd, AVX2's pmaddubsw + pmaddwd and the plain widening
    multiplies give the same integers and the float steps are the same, so a row's dot is
    equal bit for bit whichever integer dot the CPU has, every format (on CPUs with FMA;
    without it the multiply-adds round twice)."""
    t = quantized(3, 512, fmt, seed=3)
    w = t.numpy()
    v = np.random.default_rng(1).standard_normal(512).astype(np.float32)
    qa = block_ir.quantize_acts(v, int(t.shape[2]))
    isas = ["avx2", "generic"] + (["vnni"] if block_ir._isa() == "vnni" else [])
    got = {}
    for isa in isas:
        run = _row_dot_for(isa, int(t.shape[2]), monkeypatch)
        got[isa] = [run(w[r:r + 1], qa) for r in range(3)]
        asm = run.inspect_asm(run.signatures[0])
        assert ("vpdpbusd" in asm, "pmaddubsw" in asm) == (isa == "vnni", isa == "avx2"), isa
    for isa in isas:
        assert got[isa] == got["generic"], isa
    expect = reference.gemv(quant.dequantize(t), acts(torch.from_numpy(v)), torch.zeros(3), torch.zeros(3))
    torch.testing.assert_close(torch.tensor(got["generic"]), expect, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_and_tiled_matmul_match_reference(fmt, monkeypatch):
    t = quantized(300, 96, fmt)
    cols = quant.shape_of(t)[1]
    dense = quant.dequantize(t)
    out = np.empty((5, cols), dtype=np.float32)
    quant.dequantize_rows(t.numpy(), 17, out)
    torch.testing.assert_close(torch.from_numpy(out), dense[17:22])
    monkeypatch.setattr(quant, "TILE_ROWS", 64)  # several tiles and a short last one
    x = torch.randn(9, cols)
    b = torch.randn(300)
    torch.testing.assert_close(quant.matmul(t, x, b), acts(x) @ dense.t() + b, atol=2e-4, rtol=1e-4)
    ids = torch.tensor([0, 299, 5, 5])
    torch.testing.assert_close(quant.embedding(t, ids), dense[ids])
    many = torch.randint(0, 300, (quant.GATHER_PARALLEL_ROWS + 3,))  # the parallel lookup
    torch.testing.assert_close(quant.embedding(t, many), dense[many])


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_matmul_rows_equal_the_gemv(fmt):
    """Prefill (4 x 4 tiles of rows and tokens, edges alone) and decode (the GEMV) run each
    (row, token) dot alike. Bit for bit in a fresh process; within a few ulps here, because
    once, late in a full suite run, the two differed in the last bits (not explained; see
    the closing note of 2026-12-03): the server's batch-equals-solo guarantee does not rest on
    this pair (batched decode takes the batched GEMV, tests/test_batch_decode.py)."""
    t = quantized(23, 512, fmt, seed=5)
    x = torch.randn(7, quant.shape_of(t)[1])
    tiled = quant.matmul(t, x)
    for k in range(7):
        y = np.zeros(23, dtype=np.float32)
        quant.add_matvec_q(t.numpy(), x[k].numpy(), cpu.NO_BIAS, y, 2)
        torch.testing.assert_close(tiled[k], torch.from_numpy(y), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_on_quantized_blocks(fmt):
    t = quantized(70, 128, fmt)
    cols = quant.shape_of(t)[1]
    w = weight_for(t)
    assert isinstance(w, QuantWeight) and w.quant_format == fmt and w.shape == (70, cols)
    lin = Linear(w, torch.randn(70))
    dense = Linear(quant.dequantize(t), lin.bias)
    for tokens in (1, 3, 12):  # one GEMV per token, and the tiled GEMM
        x = torch.randn(tokens, cols)
        torch.testing.assert_close(lin(x), dense(acts(x)), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_decode_kernels_read_quantized_blocks(fmt):
    """The one-call dense FFN and attention block take quantized weights as they take rows."""
    d = n_ff = 256
    w_in, w_out = quantized(2 * n_ff, d, fmt, 1), quantized(d, n_ff, fmt, 2)
    h = np.random.default_rng(3).standard_normal(d).astype(np.float32)
    x = np.zeros(d, dtype=np.float32)
    decode.dense_ffn(h, w_in.numpy(), cpu.NO_BIAS, w_out.numpy(), cpu.NO_BIAS, True, activation_id("silu"), -1, 0,
                     np.float32(0.0), x, panels.threads())
    g = quant.dequantize(w_in) @ acts(torch.from_numpy(h))
    expected = quant.dequantize(w_out) @ acts(torch.nn.functional.silu(g[:n_ff]) * g[n_ff:])
    torch.testing.assert_close(torch.from_numpy(x), expected, atol=2e-4, rtol=1e-4)


def test_default_model_runs_on_its_own_blocks(smollm2_path):
    """The embedded Q4_1 model (Q8_0 embeddings) in native dtype: blocks, no float copies,
    logits near the dequantize-to-fp32 path (the activations are rounded to int8 per 32
    values, as llama.cpp rounds them), and 64 greedy chat tokens on two prompts that take
    the fp32 path's choice wherever that choice is not a near-tie (issue 19's quality check:
    where they part, the fp32 model's logit for our token is within 0.3 of its best)."""
    import powerinfer

    native = powerinfer.load(smollm2_path, dtype="native")
    ref = powerinfer.load(smollm2_path, dtype="fp32")
    m = native.model
    # blocks re-laid 16 rows at a time for the dense kernels (ops/lanes.py); the embedding
    # table stays in the file's rows (looked up), the tied LM head is its lanes copy
    assert all(isinstance(lin.w, LaneWeight) for layer in m.layers for lin in (layer.attn.qkv, layer.attn.o,
                                                                              layer.ffn.w_in, layer.ffn.w_out))
    assert quant.is_quantized(m.embed) and isinstance(m.lm_head.w, LaneWeight)
    assert m.layers[0].attn.qkv.w.quant_format == "Q4_1" and m.lm_head.w.quant_format == "Q8_0"
    assert not any(t.is_floating_point() and t.dim() == 2 and t.numel() > 100_000 for t in m.tensors())
    ids = torch.tensor(ref.tokenizer.encode("The capital of France is"))
    prefill = m.forward(ids, m.new_cache(64), all_logits=True)
    fp32 = ref.model.forward(ids, ref.model.new_cache(64), all_logits=True)
    assert (prefill - fp32).abs().mean() < 0.5 and (prefill - fp32).abs().max() < 2.5  # logits span about 50
    assert torch.equal(prefill.argmax(-1), fp32.argmax(-1))
    cache = m.new_cache(64)
    decode = torch.stack([m.forward(tok[None], cache) for tok in ids])  # the GEMV; prefill took the tiles
    # the two routes' attention rounds apart by ~1e-7, enough to move a few activations to the
    # next int8 step; 30 layers carry that as far as the int8 rounding itself goes
    assert torch.equal(decode.argmax(-1), prefill.argmax(-1)) and (decode - prefill).abs().mean() < 0.5
    parted = 0
    for question in ("Why is the sky blue?", "Write a poem about the sea."):
        prompt = native.tokenizer.encode_chat([{"role": "user", "content": question}])
        cache, out = m.new_cache(256), []
        logits = m.forward(torch.tensor(prompt), cache)
        for _ in range(64):
            out.append(int(logits.argmax()))
            logits = m.forward(torch.tensor(out[-1:]), cache)
        assert len(set(out)) > 10  # a real completion, not an end-of-text
        teacher = ref.model.forward(torch.tensor(prompt + out), ref.model.new_cache(256), all_logits=True)
        best = teacher[len(prompt) - 1 : -1]
        gap = best.max(-1).values - best[torch.arange(64), torch.tensor(out)]
        assert gap.max() <= 0.3, gap.max()
        parted += int((gap > 0).sum())
    assert parted < 16  # near-ties are rare; the fp32 path is taken elsewhere


def test_fused_rows_of_mixed_formats_are_widened_and_noted():
    """Q4_K_M files mix formats within a fused matrix (attn_v in Q6_K beside Q4_K q and k)."""
    a, b = quantized(8, 256, "Q4_K"), quantized(4, 256, "Q6_K")
    notes: set[str] = set()
    same = quant.cat_rows([a, a], notes)
    assert quant.is_quantized(same) and same.shape[0] == 16 and not notes
    mixed = quant.cat_rows([a, b], notes)
    assert mixed.dtype == torch.bfloat16 and mixed.shape == (12, 256)
    torch.testing.assert_close(mixed.float(), torch.cat([quant.dequantize(a), quant.dequantize(b)]), atol=1e-2, rtol=1e-2)
    assert notes == {"fused rows of mixed formats (Q4_K, Q6_K)"}


def test_weight_parts_with_a_bias_give_each_batch_row_the_one_vector_gemv():
    """A fused weight of mixed-format row parts with a bias (a Q4_K_M file's QKV in a family
    with QKV biases): each row of a batch equals the one-vector GEMV of the same parts, bit
    for bit, and both are the parts' dequantized product plus the bias."""
    from powerinfer.ops import batch_decode

    a, b = quantized(32, 96, "Q8_0", 1), quantized(16, 96, "Q4_0", 2)
    parts = (lanes.interleave(a).numpy(), b.numpy())  # a lanes part and a row-blocks part
    gen = torch.Generator().manual_seed(3)
    bias, V = torch.randn(48, generator=gen), torch.randn(3, 96, generator=gen)
    none = np.zeros(0, dtype=np.float32)
    solo = np.zeros((3, 48), dtype=np.float32)
    for s in range(3):
        panels.gemv_any(parts, V[s].numpy(), bias.numpy(), none, solo[s], 2)
    batch = np.zeros((3, 48), dtype=np.float32)
    batch_decode.gemv(parts, V.numpy(), bias.numpy(), none, batch, 2)
    assert np.array_equal(batch, solo)
    want = acts(V) @ torch.cat([quant.dequantize(a), quant.dequantize(b)]).T + bias
    torch.testing.assert_close(torch.from_numpy(batch), want, atol=2e-4, rtol=1e-4)


def test_fused_qkv_of_mixed_formats_keeps_each_part(tmp_path):
    """Q4_K_M files store attn_v in another format than attn_q and attn_k: the fused QKV keeps
    each part in its own blocks (no bf16 copy), one token and a batch of sequences give the
    same bits, and the logits stay near the dequantize-to-fp32 path's."""
    from gguf import GGMLQuantizationType as Q
    from gguf_export import export_gguf
    from test_gguf_tiny import _hf_dir

    import powerinfer
    from powerinfer.ops.weights import PartsWeight

    kinds = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
             "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0}
    path = export_gguf(_hf_dir("llama", tmp_path), tmp_path / "mixed.gguf", "llama",
                       quantized={f"blk.{i}.{k}.weight": v for i in range(2) for k, v in kinds.items()})
    native = powerinfer.load(str(path), dtype="native", with_tokenizer=False).model
    fp32 = powerinfer.load(str(path), dtype="fp32", with_tokenizer=False).model
    w = native.layers[0].attn.qkv.w
    assert isinstance(w, PartsWeight) and w.quant_format == "Q8_0+Q8_0+Q4_0" and w.shape == (128, 64)
    assert all(t.dtype == torch.uint8 for layer in native.layers for t in layer.attn.qkv.tensors())
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0))
    prefill = native.forward(tokens, native.new_cache(16), all_logits=True)
    want = fp32.forward(tokens, fp32.new_cache(16), all_logits=True)
    assert (prefill - want).abs().max() < 0.05 * (want.max() - want.min())
    caches = [native.new_cache(16) for _ in range(3)]
    for c, start in zip(caches, (0, 3, 5)):
        native.forward(tokens[start:start + 4], c)
    solo = []
    for c, start in zip(caches, (0, 3, 5)):
        copy = native.new_cache(16)
        native.forward(tokens[start:start + 4], copy)
        solo.append(native.forward(tokens[start + 4:start + 5], copy))
    batch = native.decode([int(tokens[s + 4]) for s in (0, 3, 5)], caches)
    assert torch.equal(batch, torch.stack(solo))
    # the parts run inside the fused attention kernel (a tuple of part arrays); the unfused
    # layer (torch norms, each part's own GEMV) rounds elsewhere, so: near
    assert all(layer.fused_decode for layer in native.layers)
    fused, plain = native.new_cache(16), native.new_cache(16)
    native.forward(tokens[:6], fused)
    native.forward(tokens[:6], plain)
    want = []
    for layer in native.layers:
        layer.fused_decode = False
    for t in tokens[6:9]:
        want.append(native.forward(t[None], plain))
    for layer in native.layers:
        layer.fused_decode = True
    got, want = torch.stack([native.forward(t[None], fused) for t in tokens[6:9]]), torch.stack(want)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # packed (native): the parts stay blocks there too, and oracle mode is the dense model
    # but for the down projection's Q8_0 requantization
    from powerinfer.engine.packed import load_packed
    from powerinfer.offline.pack import pack_model
    from powerinfer.offline.stats import LayerStats, Profile
    from powerinfer.paths import content_hash

    a = powerinfer.load(str(path), dtype="native", with_tokenizer=False).args
    prof = Profile([LayerStats(np.arange(a.ffn_dim, dtype=np.int64), 100, 0.0) for _ in range(a.n_layers)],
                   {"model": {"hash": content_hash(str(path))}, "criterion": "gate_up"})
    pack_model(str(path), str(tmp_path / "packed"), prof, None, None, "native")
    packed = load_packed(str(tmp_path / "packed"), mode="oracle", dtype="native", with_tokenizer=False).model
    pw = packed.layers[0].attn.qkv.w
    assert isinstance(pw, PartsWeight) and pw.quant_format == "Q8_0+Q8_0+Q4_0"
    got = packed.forward(tokens, packed.new_cache(16), all_logits=True)
    assert torch.equal(got.argmax(-1), prefill.argmax(-1)) and (got - prefill).abs().max() < 0.05 * (
        prefill.max() - prefill.min())


def test_releasing_copied_file_pages_keeps_every_value(smollm2_path):
    """Loading drops the mapped file's pages under tensors it has copied (madvise on the
    private mapping); a view read afterwards maps the file again, and memory that is not the
    file's is never touched."""
    from powerinfer.formats.gguf import open_gguf

    g = open_gguf(smollm2_path, native=True)
    view = g.tensor("blk.0.ffn_down.weight")  # Q4_1 blocks: a view of the mapping
    copy = view.clone()
    g.release_copied(view)
    assert torch.equal(view, copy)  # re-read from the file
    g.release("blk.0.ffn_up.weight")
    assert torch.equal(g.tensor("blk.0.ffn_up.weight"), g.tensor("blk.0.ffn_up.weight").clone())
    anonymous = torch.arange(1 << 20, dtype=torch.float32)
    g.release_copied(anonymous)  # outside the mapping: left alone
    assert torch.equal(anonymous, torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("tokens,subset", [(1, True), (1, False), (2, True), (9, False), (9, True)])
def test_ffn_over_quantized_rows_matches_reference(fmt, gated, tokens, subset):
    """The sparse FFN over quantized gate/up rows and a Q8_0 transposed down projection
    (quant_sparse.py for a few tokens, tiles for a batch) against the fp32 reference."""
    from powerinfer.ops import ffn_rows
    from powerinfer.ops.criterion import Criterion
    from powerinfer.ops.ffn_rows import FFNRows, FFNSpec

    # 16 blocks of 32 per row: those formats' gate/up rows are re-laid (ops/block_lanes.py)
    n, d = 40, 512 if fmt in block_lanes.FORMATS else 256
    w_gate, w_up = quantized(n, d, fmt, 1), quantized(n, d, fmt, 2) if gated else None
    down = torch.randn(n, 96, generator=torch.Generator().manual_seed(3)) / n**0.5
    wt_down = quant.quantize_q8_0(down)
    b_in = None if gated else torch.randn(n) * 0.1
    rows = FFNRows(w_gate, w_up, b_in, wt_down, numba_kernels=True)
    assert rows.quant and rows.numba and rows.out_features == 96
    assert rows.blocked == (fmt in block_lanes.FORMATS)
    spec = FFNSpec("silu" if gated else "relu", None, gated, threshold=0.02)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, d, generator=g)
    idx = torch.tensor([0, 3, 4, 17, 39]) if subset else None
    for criterion in (Criterion.NONE, Criterion.GATE_UP, Criterion.GATE):
        got = ffn_rows.output(rows, spec, x, idx, criterion)
        ref_idx = torch.arange(n) if idx is None else idx
        c = criterion.for_ffn(gated)
        wg, wd = quant.dequantize(w_gate), quant.dequantize(wt_down)
        if gated:
            expected = reference.sparse_gated_ffn(wg, quant.dequantize(w_up), wd, acts(x), ref_idx, "silu", None, c.label,
                                                  0.02)[0]
        else:
            a = reference.sparse_row_gemv(wg, acts(x), ref_idx, b_in, "relu")
            expected = reference.sparse_col_axpy(wd, torch.where(a.abs() <= 0.02, 0.0, a) if c != Criterion.NONE else a,
                                                 ref_idx)
        torch.testing.assert_close(got, expected, atol=3e-4, rtol=1e-3)


def test_sparse_mode_on_quantized_rows(smollm2_path, tmp_path, gpu_tier):
    """Predicted neurons over quantized rows, split across both tiers: a predictor that
    selects every neuron computes exactly the oracle model; a selective one computes fewer
    neurons, from both tiers."""
    import powerinfer
    from powerinfer.engine.packed import load_packed
    from powerinfer.offline.pack import pack_model
    from powerinfer.offline.stats import LayerStats, Profile
    from powerinfer.offline.train import LayerPredictor, Predictors
    from powerinfer.paths import content_hash

    native = powerinfer.load(smollm2_path, dtype="native")
    a = native.args
    h = content_hash(smollm2_path)
    rng = np.random.default_rng(1)
    prof = Profile([LayerStats(rng.integers(0, 100, a.ffn_dim).astype(np.int64), 100, 0.0)
                    for _ in range(a.n_layers)], {"model": {"hash": h}, "criterion": "gate_up"})
    g = torch.Generator().manual_seed(0)

    def predictors(threshold: float) -> Predictors:
        return Predictors([LayerPredictor(torch.randn(8, a.d_model, generator=g) * 0.1, torch.zeros(8),
                                          torch.randn(a.ffn_dim, 8, generator=g), torch.zeros(a.ffn_dim), threshold,
                                          1.0, 1.0, 0.5, 0.5, {}) for _ in range(a.n_layers)], {"model_hash": h})

    sets = [rng.choice(a.ffn_dim, a.ffn_dim // 3, replace=False) for _ in range(a.n_layers)]
    placement = {"format": "powerinfer-placement", "layers": [{"gpu_neurons": s.tolist()} for s in sets]}
    ids = torch.tensor(native.tokenizer.encode("Tell me about the sea."))

    def decode(lm):
        cache = lm.model.new_cache(64)
        return torch.stack([lm.model.forward(t[None], cache) for t in ids])

    every, some = str(tmp_path / "every"), str(tmp_path / "some")
    pack_model(smollm2_path, every, prof, predictors(-1e9), placement, "native")
    pack_model(smollm2_path, some, prof, predictors(0.5), placement, "native")
    def load(path, mode):
        return load_packed(path, mode=mode, dtype="native", with_tokenizer=False, predictor_bypass=None,
                           gpu_device=gpu_tier, gpu_dtype="fp32")

    oracle = decode(load(every, "oracle"))
    all_predicted = load(every, "sparse")
    torch.testing.assert_close(decode(all_predicted).cpu(), oracle.cpu(), atol=1e-3, rtol=1e-4)
    selective = load(some, "sparse")
    out = decode(selective)
    st = selective.ffn_stats
    # the share depends on the model's depth (0.16 on gpu_check's two-layer cut, 0.2+ on all 30)
    assert torch.isfinite(out).all() and 0.05 < st.active_fraction < 0.8 and 0 < st.gpu_share < 1


def native_profile(smollm2_path: str):
    """The default model in native dtype, a random profile of it, and a quarter of each
    layer's neurons (random) for the GPU tier."""
    import powerinfer
    from powerinfer.offline.stats import LayerStats, Profile
    from powerinfer.paths import content_hash

    native = powerinfer.load(smollm2_path, dtype="native")
    a = native.args
    rng = np.random.default_rng(0)
    prof = Profile([LayerStats(rng.integers(0, 100, a.ffn_dim).astype(np.int64), 100, 0.0)
                    for _ in range(a.n_layers)], {"model": {"hash": content_hash(smollm2_path)}, "criterion": "gate_up"})
    sets = [rng.choice(a.ffn_dim, a.ffn_dim // 4, replace=False) for _ in range(a.n_layers)]
    return native, prof, sets


def test_packed_default_model_keeps_its_blocks(smollm2_path, tmp_path, gpu_tier):
    """pack --dtype native: gate/up rows stay Q4_1 blocks, the down projection becomes Q8_0
    rows; oracle mode at threshold 0 is the dense model (up to the Q8_0 requantization), the
    split tiers compute each neuron once, and prefill works through the tiles."""
    from powerinfer.engine.packed import load_packed
    from powerinfer.offline.pack import pack_model

    native, prof, sets = native_profile(smollm2_path)
    a = native.args
    placement = {"format": "powerinfer-placement", "layers": [{"gpu_neurons": s.tolist()} for s in sets]}
    out = str(tmp_path / "packed")
    pack_model(smollm2_path, out, prof, None, placement, "native")
    lm = load_packed(out, mode="oracle", dtype="native", with_tokenizer=False, gpu_device=gpu_tier, gpu_dtype="fp32")
    ffn = lm.model.layers[0].ffn
    assert ffn.gpu.w_up.device.type == gpu_tier
    assert quant.format_of(ffn.cpu.w_gate) == "Q4_1" and quant.format_of(ffn.cpu.wt_down) == "Q8_0"
    assert ffn.gpu.n == a.ffn_dim // 4 and quant.is_quantized(ffn.gpu.w_up)
    assert lanes.is_lanes(lm.model.layers[0].attn.qkv.weight)  # dense parts stay blocks too (as lanes)
    # the solver's bytes per neuron for a native pack are the GPU tier's real bytes
    from powerinfer.hardware import shape_of_args
    from powerinfer.offline.prepare import native_weight_types

    weights = native_weight_types(smollm2_path)
    tier_bytes = sum(t.numel() * t.element_size() for layer in lm.model.layers
                     for t in (layer.ffn.gpu.w_gate, layer.ffn.gpu.w_up, layer.ffn.gpu.wt_down))
    assert weights == "q4_1+q8_0"
    assert tier_bytes == a.n_layers * (a.ffn_dim // 4) * shape_of_args(a).neuron_bytes(weights)
    ids = torch.tensor(native.tokenizer.encode("The capital of France is"))
    m, ref = lm.model, native.model
    prefill = m.forward(ids, m.new_cache(64), all_logits=True)  # tiles, both tiers
    cache = m.new_cache(64)
    decode = torch.stack([m.forward(t[None], cache) for t in ids])  # quant_sparse row kernels
    # the two routes agree (to the int8 activations' rounding, see the test above)
    assert torch.equal(decode.argmax(-1), prefill.argmax(-1)) and (decode - prefill).abs().mean() < 0.5
    dense = ref.forward(ids, ref.new_cache(64), all_logits=True)
    # against the dense model only the Q8_0 requantization of the down projection differs:
    # the same next tokens, logits within a few percent (perplexity +0.27%, docs/BENCHMARKS.md)
    assert torch.equal(prefill.argmax(-1), dense.argmax(-1))
    assert (prefill - dense).abs().max() < 0.1 * dense.abs().max()


@pytest.mark.parametrize("mode", ["oracle", "offload"])
def test_dense_layers_of_blocks_on_the_gpu_tier(smollm2_path, tmp_path, gpu_tier, mode):
    """A native pack placed with dense_on_gpu (oracle: every layer's attention and the tied
    LM head with its Q8_0 embeddings on the GPU tier; offload: the baseline's first layers
    whole and the head): the tier keeps blocks and widens them per matmul on its device
    (the code CUDA runs), no float copy of a matrix persists, and the logits are those of the
    same neurons in oracle mode with the dense parts on the CPU block kernels, up to their int8
    activations' rounding (measured: 1-5% of the largest logit at most, same argmax)."""
    from powerinfer.engine.packed import load_packed
    from powerinfer.offline.pack import pack_model

    native, prof, sets = native_profile(smollm2_path)
    a = native.args

    def load(dense_on_gpu: bool, mode: str):
        placement = {"format": "powerinfer-placement", "dense_on_gpu": dense_on_gpu,
                     "baselines": {"offload": {"gpu_layers": 3, "head_on_gpu": dense_on_gpu}},
                     "layers": [{"gpu_neurons": s.tolist()} for s in sets]}
        out = str(tmp_path / f"packed-{dense_on_gpu}")
        pack_model(smollm2_path, out, prof, None, placement, "native")
        return load_packed(out, mode=mode, dtype="native", with_tokenizer=False, gpu_device=gpu_tier,
                           gpu_dtype="fp32").model

    # the reference: every attention block and the head on the CPU block kernels
    m, ref = load(True, mode), load(False, "oracle")
    on_tier = [mode == "oracle" or i < 3 for i in range(a.n_layers)]  # gpu_check cuts the model to 2 layers
    assert [layer.attn.qkv.w_np is None for layer in m.layers] == on_tier
    for layer, tier in zip(m.layers, on_tier):
        for t in layer.attn.qkv.tensors() + layer.attn.o.tensors():
            assert t.dtype == torch.uint8 and t.device.type == (gpu_tier if tier else "cpu")
    assert m.lm_head.w_np is None and quant.is_quantized(m.embed) and m.embed.device.type == gpu_tier
    assert all(layer.attn.qkv.w_np is not None for layer in ref.layers) and ref.lm_head.w_np is not None

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        got, top = got.cpu(), float(want.abs().max())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert (got - want).abs().max() < 0.1 * top and (got - want).abs().mean() < 0.02 * top

    ids = torch.tensor(native.tokenizer.encode("The capital of France is"))
    close(m.forward(ids, m.new_cache(64), all_logits=True), ref.forward(ids, ref.new_cache(64), all_logits=True))
    cache, ref_cache = m.new_cache(64), ref.new_cache(64)
    for t in ids[:4]:  # decode: one token at a time through the tier's torch route
        close(m.forward(t[None], cache), ref.forward(t[None], ref_cache))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K"])
def test_the_torch_route_widens_blocks_a_tile_of_rows_at_a_time(monkeypatch, fmt):
    """The GPU tier's matmul over blocks (`kernels=False`, here on CPU tensors) widens tiles
    of rows (48 rows of 40 here: a short last tile), never the whole matrix, and equals the
    fp32 GEMM of the dequantized matrix plus the bias."""
    from powerinfer.ops import quant_torch, weights

    t = quantized(40, 512, fmt, seed=3)
    widened = []
    real = quant_torch.dequantize
    monkeypatch.setattr(weights, "TIER_TILE_BYTES", 16 * 512 * 4)
    monkeypatch.setattr(quant_torch, "dequantize", lambda blocks, *a: widened.append(len(blocks)) or real(blocks, *a))
    w = weights.weight_for(t, kernels=False)
    x, b = torch.randn(3, 512), torch.randn(40)
    got = w.matmul(x, b)
    assert widened == [16, 16, 8]
    torch.testing.assert_close(got, x @ quant.dequantize(t).t() + b, atol=1e-4, rtol=1e-4)


def test_parts_of_mixed_formats_through_the_torch_route():
    """A fused QKV of Q4_K and Q6_K parts (as Q4_K_M files store it) on the GPU tier's torch
    route equals the CPU block kernels' matmul up to their int8 activations' rounding, and
    keeps each part's blocks."""
    from powerinfer.ops.linear import Linear

    parts = quant.QuantParts([quantized(32, 512, "Q4_K", seed=1), quantized(16, 512, "Q6_K", seed=2)])
    x = torch.randn(3, 512)
    tier, cpu_kernels = Linear(parts, kernels=False), Linear(parts)
    assert not tier.batch_kernels and tier.fused_np is None and all(t.dtype == torch.uint8 for t in tier.tensors())
    want = torch.cat([quant.dequantize(p) for p in parts.parts]) @ x.t()
    torch.testing.assert_close(tier(x), want.t(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cpu_kernels(x), want.t(), atol=0.05 * float(want.abs().max()), rtol=0.05)
