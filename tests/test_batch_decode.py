"""Batched decode (models/batch.py, ops/batch_decode.py) and the engine loop that serves with
it (engine/batch.py): a sequence's result equals its solo result exactly (not closely),
whatever else is in the batch, for every weight format and family; the loop admits, chunks
prefill, cancels and samples per sequence."""

from __future__ import annotations

import threading
import time

import numba
import numpy as np
import pytest
import torch
from test_quant import quantized

import powerinfer
from powerinfer.engine.batch import BatchEngine
from powerinfer.engine.generate import prefill, stream_generate
from powerinfer.engine.sample import SamplingParams
from powerinfer.ops import batch_decode, cpu, decode, panels
from powerinfer.ops.activations import activation_id
from powerinfer.ops.linear import Linear
from tiny_models import build_tiny

# fp16 panels run the bf16 panels' code with another widening (each a compile of its own in a
# clean CI run): bf16 stands for both here; tests/test_panels.py covers fp16 panels
WEIGHTS = ["fp32", "bf16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def weight(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    if kind in ("fp32", "bf16", "fp16"):
        g = torch.Generator().manual_seed(seed)
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(dt)
    return quantized(rows, cols, kind, seed)


def vectors(B: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(B, n, generator=torch.Generator().manual_seed(seed))


def assert_same(batch: torch.Tensor, solo: torch.Tensor) -> None:
    assert torch.equal(batch, solo), (batch - solo).abs().max()


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("B,threads", [(3, 1), (8, 2)])
def test_each_row_equals_the_one_token_gemv(kind, B, threads):
    """Rows (fp32), panels (bf16/fp16 at 512 columns) and every GGUF format; bias and
    residual; an odd row count (the leftover rows after the four-stream split). Exactly equal,
    for every format (GGUF blocks: block_ir runs every (row, vector) dot alike)."""
    lin = Linear(weight(kind, 67, 512, 1), torch.randn(67))
    x, res = vectors(B, 512, 2), vectors(B, 67, 3)
    numba.set_num_threads(threads)
    try:
        batch = lin.each_row(x, residual=res)
        solo = torch.cat([lin(x[b:b + 1], residual=res[b:b + 1]) for b in range(B)])
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert_same(batch, solo)
    assert lin.panels == (kind == "bf16")


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("gated,B", [(True, 3), (False, 3), (True, 8)])
def test_batched_dense_ffn_equals_the_one_token_kernel(kind, gated, B):
    d, n_ff = 256, 512 if gated else 768
    w_in = Linear(weight(kind, (2 if gated else 1) * n_ff, d, 4), None if gated else torch.randn(n_ff)).w_np
    w_out = Linear(weight(kind, d, n_ff, 5), torch.randn(d)).w_np
    b_in = cpu.NO_BIAS if gated else torch.randn(n_ff).numpy()
    b_out = torch.randn(d).numpy()
    act = activation_id("silu" if gated else "relu")
    H = vectors(B, d, 6).numpy()
    X = vectors(B, d, 7).numpy()
    solo = X.copy()
    for b in range(B):
        decode.dense_ffn(H[b], w_in, b_in, w_out, b_out, gated, act, -1, 0, np.float32(0.0), solo[b], panels.threads())
    batch_decode.dense_ffn(H, w_in, b_in, w_out, b_out, gated, act, -1, 0, np.float32(0.0), X, panels.threads())
    assert_same(torch.from_numpy(X), torch.from_numpy(solo))


def _solo_logits(model, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    cache = model.new_cache(len(prompt) + len(steps) + 1)
    prefill(model, torch.tensor(prompt), cache)
    return [model.forward(torch.tensor([t]), cache) for t in steps]


def check_batch_equals_solo(model, vocab: int, seed: int = 0, per_layer_caches: bool = False) -> None:
    """Sequences with prompts of different lengths decode together, a fourth joins after two
    steps and the first leaves after four: every row equals the sequence decoded alone, bit
    for bit. `per_layer_caches`: the caches without their (layers, ...) blocks, as when some
    layers' caches are on the GPU tier (the attention then takes per-layer lists)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (5, 1, 9, 3)]
    feeds = [rng.integers(3, vocab, 6).tolist() for _ in prompts]
    solo = [_solo_logits(model, p, f) for p, f in zip(prompts, feeds)]
    caches = [model.new_cache(len(p) + 7) for p in prompts]
    for p, c in zip(prompts, caches):
        prefill(model, torch.tensor(p), c)
        if per_layer_caches:
            c.k_all_np = c.v_all_np = None
    members = {0: 0, 1: 0, 2: 0}  # sequence -> steps done
    for step in range(6):
        if step == 2:
            members[3] = 0
        if step == 4:
            members.pop(0)
        seqs = sorted(members)
        rows = model.decode([feeds[s][members[s]] for s in seqs], [caches[s] for s in seqs])
        for s, row in zip(seqs, rows):
            assert torch.equal(row, solo[s][members[s]]), (s, members[s], (row - solo[s][members[s]]).abs().max())
            members[s] += 1


@pytest.mark.parametrize("blocks", [False, True])
def test_batched_attention_equals_each_sequence_alone(blocks):
    """Sequences at positions of one, two and three chunks of `cpu.CHUNK` (their work items
    in one parallel loop) attend exactly as `cpu.attend_one` does for each alone; their
    caches passed per layer or as (layers, ...) blocks with the layer's index."""
    from numba.typed import List

    n_heads, n_kv, d, max_len, layers, layer = 6, 2, 16, 700, 3, 1
    rng = np.random.default_rng(3)
    pos = np.array([10, 300, 650, 256], dtype=np.int64)
    angles = np.outer(np.arange(max_len), 1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    qkv = rng.standard_normal((len(pos), (n_heads + 2 * n_kv) * d)).astype(np.float32)
    caches = [rng.standard_normal((2, layers, n_kv, max_len, d)).astype(np.float32) for _ in pos]
    alone = np.zeros((len(pos), n_heads * d), dtype=np.float32)
    for s, c in enumerate(caches):
        k, v = c[0, layer].copy(), c[1, layer].copy()
        cpu.attend_one(qkv[s], pos[s], cos, sin, k, v, n_heads, n_kv, d, d**-0.5, True, alone[s], 0, np.float32(0.0))
    together = np.zeros_like(alone)
    k_caches = List([c[0] if blocks else c[0, layer] for c in caches])
    v_caches = List([c[1] if blocks else c[1, layer] for c in caches])
    # the scale as the model passes it (a Python float): a float32 one would compile another kernel
    batch_decode.attend(qkv, pos, cos, sin, k_caches, v_caches, layer, n_heads, n_kv, d, d**-0.5, True, together)
    assert [cpu.attention_chunks(p, 0) for p in pos] == [1, 2, 3, 2]
    assert np.array_equal(together, alone)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "opt", "falcon_mq_parallel"])
def test_families_decode_in_a_batch_as_alone(tmp_path, name):
    lm = powerinfer.load(str(build_tiny(name, tmp_path)))
    check_batch_equals_solo(lm.model, lm.args.vocab_size)


@pytest.mark.parametrize("dtype", ["native", "bf16"])
def test_default_model_decodes_in_a_batch_as_alone(smollm2_path, dtype):
    """Its own Q4_1 blocks (Q8_0 embeddings), and bf16 panels: both bit for bit."""
    lm = powerinfer.load(smollm2_path, dtype=dtype)
    check_batch_equals_solo(lm.model, lm.args.vocab_size)


def test_a_batch_of_per_layer_caches_decodes_as_alone(tmp_path):
    lm = powerinfer.load(str(build_tiny("llama", tmp_path)))
    check_batch_equals_solo(lm.model, lm.args.vocab_size, per_layer_caches=True)


@pytest.mark.parametrize("source", ["tiny_llama", "smollm2_native"])
def test_a_batch_step_in_one_call_equals_the_per_layer_batch_path(tmp_path, smollm2_path, source):
    """Where the layers gather into a stack, a batched step runs every layer in one numba call
    (batch_decode.layer_stack; as one team region where every matrix is in lanes,
    ops/batch_team.py): the same kernels as the per-layer batch path, so the same logits and
    caches to the bit, for rows at different positions."""
    from powerinfer.models import batch

    path = str(build_tiny("llama", tmp_path)) if source == "tiny_llama" else smollm2_path
    model = powerinfer.load(path, dtype="native").model
    prompts = [torch.arange(3, 3 + n) % model.args.vocab_size for n in (1, 5, 20)]

    def run(stack: bool, team: bool = True):
        model.stack_decode = stack
        if stack:
            model._layer_stack().team = team and model._layer_stack().team
        caches = [model.new_cache(40) for _ in prompts]
        for p, c in zip(prompts, caches):
            model.forward(p, c)
        steps = [batch.decode_step(model, [7 + k, 11 + k, 13 + k], caches) for k in range(3)]
        return torch.stack(steps), caches

    model.forward(prompts[0], model.new_cache(4))
    assert model._layer_stack() is not None
    assert model._layer_stack().team == (source == "smollm2_native")
    (per_layer, caches_b) = run(False)
    for team in (True, False):
        one_call, caches_a = run(True, team)
        assert torch.equal(one_call, per_layer), (team, (one_call - per_layer).abs().max())
        for a, b in zip(caches_a, caches_b):
            assert a.length == b.length and np.array_equal(a.k_all_np, b.k_all_np)
            assert np.array_equal(a.v_all_np, b.v_all_np)


@pytest.mark.parametrize("source", ["tiny_llama", "smollm2_native"])
def test_a_short_prompt_prefills_as_its_tokens_decoded_one_by_one(tmp_path, smollm2_path, source):
    """A prompt of a few tokens runs through the batched decode kernels as rows sharing one
    cache (models/batch.py, `prefill_short`): causal, the cache and the last token's logits
    equal decoding the tokens one at a time exactly (every row's logits, which the LM head
    computes as one matmul, to rounding); from position 0 and after earlier tokens."""
    from powerinfer.models import batch

    path = str(build_tiny("llama", tmp_path)) if source == "tiny_llama" else smollm2_path
    model = powerinfer.load(path, dtype="native").model
    ids = torch.arange(3, 3 + 2 * batch.SHORT_PREFILL_MAX) % model.args.vocab_size

    def cache_after(start: int):
        c = model.new_cache(64)
        if start:
            model.forward(ids[:start], c)
        return c

    for start, T in ((0, 11), (5, batch.SHORT_PREFILL_MAX)):
        assert batch.short_prefill_fits(model, T, model.new_cache(64))
        short, one_by_one = cache_after(start), cache_after(start)
        last = model.forward(ids[start:start + T], short)
        want = torch.stack([model.forward(ids[t:t + 1], one_by_one) for t in range(start, start + T)])
        assert short.length == one_by_one.length == start + T
        assert all(np.array_equal(a, b) for a, b in zip(short.k_np + short.v_np, one_by_one.k_np + one_by_one.v_np))
        assert torch.equal(last, want[-1]), (last - want[-1]).abs().max()
        every = model.forward(ids[start:start + T], cache_after(start), all_logits=True)
        torch.testing.assert_close(every, want, rtol=1e-5, atol=2e-5)
    assert not batch.short_prefill_fits(model, batch.SHORT_PREFILL_MAX + 1, model.new_cache(64))
    assert not batch.short_prefill_fits(model, 1, model.new_cache(64))


@pytest.mark.parametrize("source", ["tiny_llama", "smollm2_native", "tiny_llama_per_layer"])
def test_prompts_ride_in_a_batch_step_as_alone(tmp_path, smollm2_path, source):
    """New sequences' short prompts run as rows of the decoding sequences' step (batch_step):
    each prompt's last logits and cache equal its `forward` alone, each decoding row equals
    its token decoded alone, to the bit; the next (pure decode, team where it applies) step
    too. Through the stack (one call) and the per-layer kernels (caches without blocks)."""
    from powerinfer.models import batch

    path = str(build_tiny("llama", tmp_path)) if source.startswith("tiny") else smollm2_path
    model = powerinfer.load(path, dtype="native").model
    vocab = model.args.vocab_size
    rng = np.random.default_rng(3)
    old = [rng.integers(3, vocab, n).tolist() for n in (4, 9)]  # decoding
    new = [rng.integers(3, vocab, n).tolist() for n in (batch.SHORT_PREFILL_MAX, 1, 6)]  # joining
    feeds = rng.integers(3, vocab, (len(old) + len(new), 2)).tolist()

    def fresh(prompt=None):
        c = model.new_cache(40)
        if source.endswith("per_layer"):
            c.k_all_np = c.v_all_np = None
        if prompt:
            model.forward(torch.tensor(prompt), c)
        return c

    caches = [fresh(p) for p in old] + [fresh() for _ in new]
    assert all(batch.can_ride(model, len(p), c) for p, c in zip(new, caches[len(old):]))
    step1 = batch.batch_step(model, [[f[0]] for f in feeds[:len(old)]] + new, caches)
    step2 = model.decode([f[1] for f in feeds], caches)
    for s, prompt in enumerate(old + new):
        alone = fresh(prompt if s < len(old) else None)
        first = model.forward(torch.tensor([feeds[s][0]] if s < len(old) else prompt), alone)
        second = model.forward(torch.tensor([feeds[s][1]]), alone)
        assert torch.equal(step1[s], first), (s, (step1[s] - first).abs().max())
        assert torch.equal(step2[s], second), (s, (step2[s] - second).abs().max())
        assert caches[s].length == alone.length
        assert all(np.array_equal(a, b) for a, b in zip(caches[s].k_np + caches[s].v_np, alone.k_np + alone.v_np))
    too_long = rng.integers(3, vocab, batch.SHORT_PREFILL_MAX + 1).tolist()
    with pytest.raises(powerinfer.PowerInferError, match="cannot run as rows"):
        batch.batch_step(model, [[1], too_long], [fresh([5]), fresh()])


def test_decode_step_refuses_shared_or_full_caches(smollm2_path):
    model = powerinfer.load(smollm2_path).model
    c = model.new_cache(4)
    with pytest.raises(powerinfer.PowerInferError, match="its own cache"):
        model.decode([1, 2], [c, c])
    c.length = 4
    with pytest.raises(ValueError, match="holds 4 positions"):
        model.decode([1, 2], [c, model.new_cache(4)])


# -- the engine loop -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(smollm2_path):
    """bf16 panels: batched rows equal solo ones bit for bit."""
    return powerinfer.load(smollm2_path, dtype="bf16")


class Collector:
    """What the engine emits for one request, with arrival times."""

    def __init__(self):
        self.items, self.times, self.done = [], [], threading.Event()

    def __call__(self, item):
        if item is None:
            self.done.set()
        else:
            self.items.append(item)
            self.times.append(time.perf_counter())

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.items)

    @property
    def finish(self) -> str | None:
        return self.items[-1].finish_reason if self.items else None


def solo_text(lm, prompt: list[int], max_tokens: int, sampling: SamplingParams, stop=None) -> tuple[str, str]:
    rs = list(stream_generate(lm.model, lm.tokenizer, prompt, max_tokens, sampling, stop))
    return "".join(r.text for r in rs), rs[-1].finish_reason


GREEDY = SamplingParams(temperature=0)


def test_requests_joining_and_leaving_get_their_solo_output(lm):
    tok = lm.tokenizer
    prompts = [tok.encode(p) for p in ["The capital of France is", "Write a poem about the sea:", "1, 2, 3,",
                                       "def fibonacci(n):", "Once upon a time", "The best way to learn is"]]
    lengths = [24, 7, 16, 30, 1, 12]
    stops = [None, None, None, ["\n\n"], None, None]
    engine = BatchEngine(lm.model, tok, max_batch=4)
    try:
        got = [Collector() for _ in prompts]
        for i in range(3):
            engine.submit(prompts[i], lengths[i], GREEDY, stops[i], got[i])
        while len(got[0].items) < 3:  # the rest join while the first three decode
            time.sleep(0.01)
        for i in range(3, 6):
            engine.submit(prompts[i], lengths[i], GREEDY, stops[i], got[i])
        for g in got:
            assert g.done.wait(120)
        assert engine.batch_tokens > engine.steps  # steps did decode several sequences at once
    finally:
        engine.close()
    for i, g in enumerate(got):
        assert (g.text, g.finish) == solo_text(lm, prompts[i], lengths[i], GREEDY, stops[i]), i


def test_short_prompts_join_the_decode_pass(lm, monkeypatch):
    """Requests admitted together with short prompts run them as rows of one batched pass (no
    prefill of their own: `forward` is never called), each still gets its solo output, and
    every step after the first decodes all of them."""
    tok = lm.tokenizer
    prompts = [tok.encode(p) for p in ["Hello there", "The capital of France is", "1, 2, 3,", "A"]]
    solo = [solo_text(lm, p, 6, GREEDY) for p in prompts]
    calls = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    engine = BatchEngine(lm.model, tok, max_batch=4, own_thread=False)
    got = [Collector() for _ in prompts]
    for p, g in zip(prompts, got):
        engine.submit(p, 6, GREEDY, None, g)
    loop = threading.Thread(target=engine.run)
    loop.start()
    try:
        assert all(g.done.wait(120) for g in got)
    finally:
        engine.close()
        loop.join(30)
    assert not calls
    assert (engine.steps, engine.batch_tokens) == (6, 24)
    assert [(g.text, g.finish) for g in got] == solo


def test_the_warm_up_runs_a_riding_prompt(lm, monkeypatch):
    """The server's warm-up also runs a step where a short prompt rides along (the per-layer
    kernels, not the team's), so the first joining request does not stall every stream while
    they compile."""
    from powerinfer.engine import batch as engine_batch

    seen = []
    step = engine_batch.batch_step
    monkeypatch.setattr(engine_batch, "batch_step", lambda m, tokens, caches: seen.append(
        [len(t) for t in tokens]) or step(m, tokens, caches))
    engine_batch.warm_up_batch(lm.model)
    assert [1, 2] in seen


def test_seeded_sampling_does_not_depend_on_the_batch(lm):
    tok = lm.tokenizer
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    prompt = tok.encode("Tell me a story:")
    alone = solo_text(lm, prompt, 20, sampling)
    engine = BatchEngine(lm.model, tok, max_batch=4)
    try:
        others = [Collector() for _ in range(3)]
        for i, o in enumerate(others):
            engine.submit(tok.encode(f"Noise {i}"), 25, SamplingParams(temperature=1.0, seed=i), None, o)
        mine = Collector()
        engine.submit(prompt, 20, sampling, None, mine)
        assert mine.done.wait(120) and all(o.done.wait(120) for o in others)
    finally:
        engine.close()
    assert (mine.text, mine.finish) == alone


def test_a_cancelled_request_leaves_at_the_next_step(lm):
    tok = lm.tokenizer
    engine = BatchEngine(lm.model, tok, max_batch=2)
    try:
        long, other = Collector(), Collector()
        seq = engine.submit(tok.encode("Count to a thousand:"), 500, GREEDY, None, long)
        prompt = tok.encode("A bystander asks")
        engine.submit(prompt, 20, GREEDY, None, other)
        while len(long.items) < 3:
            time.sleep(0.01)
        seq.cancel.set()
        assert long.done.wait(10) and len(long.items) < 100
        assert long.finish is None  # cut off, not finished
        assert other.done.wait(120)
        assert engine.active == 0 and engine.waiting == 0
    finally:
        engine.close()
    assert (other.text, other.finish) == solo_text(lm, prompt, 20, GREEDY)


def test_a_long_prompt_is_prefilled_between_the_others_tokens(lm):
    """With 32-token prefill chunks, a 400-token prompt takes 13 steps; each of them also
    decodes the running sequences, so they keep producing tokens meanwhile."""
    tok = lm.tokenizer
    engine = BatchEngine(lm.model, tok, max_batch=4, prefill_chunk=32)
    try:
        runners = [Collector() for _ in range(2)]
        for i, r in enumerate(runners):
            engine.submit(tok.encode(f"Runner {i} says"), 60, GREEDY, None, r)
        while min(len(r.items) for r in runners) < 2:
            time.sleep(0.01)
        long_prompt = (tok.encode("word ") * 400)[:400]
        t_submit = time.perf_counter()
        late = Collector()
        engine.submit(long_prompt, 2, GREEDY, None, late)
        assert late.done.wait(120)
        t_first = late.times[0]
        for r in runners:
            during = [t for t in r.times if t_submit < t < t_first]
            assert len(during) >= 10 or r.done.is_set() and r.times[-1] < t_first, len(during)
        assert all(r.done.wait(120) for r in runners)
    finally:
        engine.close()
    assert (late.text, late.finish) == solo_text(lm, long_prompt, 2, GREEDY)


def test_zero_tokens_and_closing_with_work_left(lm):
    tok = lm.tokenizer
    engine = BatchEngine(lm.model, tok, max_batch=1)
    zero, busy, queued = Collector(), Collector(), Collector()
    engine.submit(tok.encode("Hi"), 0, GREEDY, None, zero)
    assert zero.done.wait(30) and [(r.text, r.finish_reason) for r in zero.items] == [("", "length")]
    engine.submit(tok.encode("Count:"), 500, GREEDY, None, busy)
    engine.submit(tok.encode("Wait"), 5, GREEDY, None, queued)
    engine.close()
    assert busy.done.is_set() and queued.done.is_set() and not queued.items
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(tok.encode("Hi"), 1, GREEDY, None, Collector())
