"""Neuron placement: an integer linear program over the cost model and a GPU memory budget.

Per layer, neurons are sorted by activation count and cut into groups of `group_size`.
Which groups go to the GPU is decided hottest-first: a layer's GPU part is its k hottest
groups, and the ILP picks k per layer. Variables: z[l, k] = 1 when layer l puts its k
hottest groups on the GPU (k = 0..G_l). "Group g of layer l is on the GPU" is
x[l,g] = sum_{k>g} z[l,k], and "layer l has a GPU part" is 1 - z[l,0].

    minimise   sum_{l,k} value[l,k] z[l,k]
    subject to sum_k z[l,k] = 1                               (one choice per layer)
               sum_{l,k} neurons[l,k] z[l,k] <= room           (GPU memory, exact bytes
                                                                / bytes per neuron)
               z[l,k] = 0 for 0 < neurons[l,k] < min_neurons[l] (a GPU part must pay for
                                                                its launches, or none)

With objective "time" (default) value[l,k] is the cost model's layer time for that split:
attention + max(GPU part, CPU part) + sync unless the layer is entirely on the GPU. So the
tiers are balanced by construction (the max: neither idles for long), sync and launch
costs are priced, and nothing is approximated. Objective "impact" is the paper's: value =
minus the activation mass served from the GPU.

Why this form rather than one binary per group with linking rows for "has a GPU part",
"entirely on the GPU" and the max: that form's LP relaxation lets the last group be 30% on
the GPU and so "30% remove" a sync; on a LLaMA-70B shape its root LP took 5-27 s and left a
3% gap. Here each layer's LP relaxation is the convex hull of its exact (memory, time)
points, the LP has one row per layer plus the memory row, and the only gap left comes from
the single knapsack row.

HiGHS via scipy.optimize.milp: scipy is a dependency anyway and its milp takes sparse
constraint matrices and reports the MIP gap, all this needs; highspy would add a second
binding for no gain here.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from ..errors import BadArgumentError
from ..hardware import HardwareProfile, LayerCosts, ModelShape, head_time, layer_costs, layer_time
from .stats import Profile


@dataclass
class Problem:
    """Everything the solver needs, derived from a profile, a shape and a hardware profile."""

    shape: ModelShape
    hw: HardwareProfile
    dtype: str
    budget: int
    mandatory: dict[str, int]
    costs: LayerCosts
    order: list[np.ndarray]  # per layer: neuron indices, hottest first
    loads: list[np.ndarray]  # per layer: expected active neurons per token, per group
    sizes: list[np.ndarray]  # per layer: neurons per group
    min_neurons: list[int]
    neuron_bytes: int
    dense_on_gpu: bool = True

    @property
    def room(self) -> int:
        return self.budget - sum(self.mandatory.values())


@dataclass
class Placement:
    """Which neurons of each layer live on the GPU, and what the model predicts for it."""

    gpu_neurons: list[np.ndarray]  # per layer, sorted original indices
    method: str
    objective: float
    predicted_time: float
    solve_seconds: float = 0.0
    status: str = ""
    gap: float | None = None
    lp_bound: float | None = None
    extra: dict = field(default_factory=dict)


def mandatory_gpu_bytes(shape: ModelShape, dtype: str, context: int, kv_on_gpu: bool, dense_on_gpu: bool,
                        predictor_rank: int, runtime_buffers: int) -> dict[str, int]:
    """Bytes that must sit on the GPU before any FFN neuron, item by item."""
    items = {"runtime_buffers": int(runtime_buffers)}
    if dense_on_gpu:
        items["attention"] = shape.n_layers * shape.attention_bytes(dtype)
        items["lm_head"] = shape.lm_head_bytes(dtype)
        items["final_norm"] = 4 * shape.d_model
    if predictor_rank:
        items["predictors"] = shape.n_layers * shape.predictor_bytes(predictor_rank)
    if kv_on_gpu:
        items["kv_cache"] = shape.kv_bytes(context, "fp16")
    return items


def build_problem(profile: Profile, shape: ModelShape, hw: HardwareProfile, budget: int, dtype: str = "fp16",
                  group_size: int = 64, context: int = 2048, kv_on_gpu: bool = False,
                  dense_on_gpu: bool | None = None, predictor_rank: int = 128) -> Problem:
    """Validate inputs and precompute groups, loads and costs."""
    if len(profile.layers) != shape.n_layers:
        raise BadArgumentError(f"profile has {len(profile.layers)} layers, the model {shape.n_layers}")
    if any(layer.n_ff != shape.n_ff for layer in profile.layers):
        raise BadArgumentError(f"profile layers do not have the model's {shape.n_ff} neurons")
    if group_size < 1:
        raise BadArgumentError("group size must be >= 1")
    if budget <= 0:
        raise BadArgumentError("the VRAM budget must be positive")
    if not hw.has_gpu:
        raise BadArgumentError(f"hardware {hw.name!r} has no GPU; nothing to place")
    if budget > hw.gpu_memory:
        raise BadArgumentError(f"budget {budget / 2**30:.2f} GiB exceeds the GPU's {hw.gpu_memory / 2**30:.2f} GiB")
    if dense_on_gpu is None:  # attention on the GPU when it fits (see solve_auto to compare both)
        dense = mandatory_gpu_bytes(shape, dtype, context, kv_on_gpu, True, predictor_rank, hw.runtime_buffers)
        dense_on_gpu = sum(dense.values()) <= budget
    mandatory = mandatory_gpu_bytes(shape, dtype, context, kv_on_gpu, dense_on_gpu, predictor_rank,
                                    hw.runtime_buffers)
    if budget < sum(mandatory.values()):
        parts = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in mandatory.items())
        raise BadArgumentError(f"budget {budget / 2**20:.0f} MiB is smaller than the parts that must be on the GPU "
                               f"({sum(mandatory.values()) / 2**20:.0f} MiB: {parts})")
    costs = layer_costs(shape, hw, dtype, context, dense_on_gpu, predictor_rank)
    order, loads, sizes, mins = [], [], [], []
    saving = costs.cpu_per_neuron - costs.gpu_per_neuron
    for layer in profile.layers:
        rate = layer.counts.astype(np.float64) / max(layer.tokens, 1)
        idx = np.argsort(-rate, kind="stable")
        starts = np.arange(0, shape.n_ff, group_size)
        order.append(idx)
        loads.append(np.add.reduceat(rate[idx], starts))
        sizes.append(np.minimum(group_size, shape.n_ff - starts))
        # the smallest hottest-first GPU part whose saved CPU time pays the GPU launch cost
        need = costs.gpu_overhead + (0.0 if dense_on_gpu else costs.sync)
        cum = np.cumsum(rate[idx]) * saving
        k = int(np.searchsorted(cum, need)) + 1 if need > 0 else 1
        mins.append(min(k, shape.n_ff))
    return Problem(shape, hw, dtype, budget, mandatory, costs, order, loads, sizes, mins, shape.neuron_bytes(dtype),
                   dense_on_gpu)


def predicted_time(problem: Problem, n_gpu_groups: list[int]) -> float:
    """Cost-model seconds per token when layer l has its n_gpu_groups[l] hottest groups on the GPU."""
    total = 0.0
    for l, k in enumerate(n_gpu_groups):
        gpu_load = float(problem.loads[l][:k].sum())
        cpu_load = float(problem.loads[l][k:].sum())
        total += layer_time(problem.costs, gpu_load, cpu_load, k > 0, k == len(problem.loads[l]))
    on_gpu = "lm_head" in problem.mandatory
    return total + head_time(problem.shape, problem.hw, problem.dtype, on_gpu)


def _placement_from_counts(problem: Problem, n_gpu_groups: list[int], **kw) -> Placement:
    gpu = []
    for l, k in enumerate(n_gpu_groups):
        n = int(problem.sizes[l][:k].sum())
        gpu.append(np.sort(problem.order[l][:n]))
    return Placement(gpu_neurons=gpu, predicted_time=predicted_time(problem, n_gpu_groups), **kw)


def greedy(problem: Problem) -> Placement:
    """The reference's top-K: hottest groups first across all layers until the budget is full."""
    t0 = time.perf_counter()
    entries = [(-problem.loads[l][g] / problem.sizes[l][g], l, g) for l in range(len(problem.loads))
               for g in range(len(problem.loads[l]))]
    entries.sort()
    room = problem.room
    taken = [0] * len(problem.loads)
    for _, l, g in entries:
        cost = int(problem.sizes[l][g]) * problem.neuron_bytes
        if g == taken[l] and cost <= room:  # keep each layer a hottest-first prefix
            taken[l] += 1
            room -= cost
    impact = sum(float(problem.loads[l][:k].sum()) for l, k in enumerate(taken))
    return _placement_from_counts(problem, taken, method="greedy", objective=impact,
                                  solve_seconds=time.perf_counter() - t0, status="heuristic")


US = 1e6  # the MILP's time unit: microseconds (seconds per neuron are ~1e-10: badly scaled)


def layer_choice_values(problem: Problem, l: int, objective: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For layer l and every k = 0..G (its k hottest groups on the GPU): (value to minimise,
    neurons on the GPU, allowed). Value is the layer's cost-model time in microseconds
    (objective "time") or minus its GPU activation mass ("impact")."""
    loads, sizes = problem.loads[l], problem.sizes[l]
    G = len(loads)
    cum_load = np.concatenate([[0.0], np.cumsum(loads)])
    cum_neurons = np.concatenate([[0], np.cumsum(sizes)])
    if objective == "time":
        total = cum_load[-1]
        value = np.array([layer_time(problem.costs, cum_load[k], total - cum_load[k], k > 0, k == G)
                          for k in range(G + 1)]) * US
    else:
        value = -cum_load
    allowed = (cum_neurons == 0) | (cum_neurons >= problem.min_neurons[l])
    return value, cum_neurons, allowed


def _formulate(problem: Problem, objective: str):
    """(c, integrality, bounds, constraints, layout) of the MILP in z[l, k]."""
    values, neurons, allowed = zip(*(layer_choice_values(problem, l, objective) for l in range(len(problem.loads))))
    sizes = [len(v) for v in values]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = int(offsets[-1])
    c = np.concatenate(values)
    ub = np.concatenate([a.astype(float) for a in allowed])
    L = len(values)
    data, ri, ci = [], [], []
    for l in range(L):  # one choice per layer
        ci.extend(range(offsets[l], offsets[l + 1]))
        ri.extend([l] * sizes[l])
        data.extend([1.0] * sizes[l])
    ci.extend(range(n))  # memory, in neurons
    ri.extend([L] * n)
    data.extend(np.concatenate(neurons).astype(float).tolist())
    A = sparse.csr_matrix((data, (ri, ci)), shape=(L + 1, n))
    lo = np.concatenate([np.ones(L), [-np.inf]])
    hi = np.concatenate([np.ones(L), [float(problem.room // problem.neuron_bytes)]])
    return c, np.ones(n), Bounds(np.zeros(n), ub), LinearConstraint(A, lo, hi), (offsets, sizes)


def solve(problem: Problem, objective: str = "time", time_limit: float = 10.0, mip_gap: float = 1e-3) -> Placement:
    """The ILP placement, with HiGHS's gap and the LP relaxation bound."""
    if objective not in ("time", "impact"):
        raise BadArgumentError("objective must be 'time' or 'impact'")
    c, integrality, bounds, constraints, (offsets, sizes) = _formulate(problem, objective)
    t0 = time.perf_counter()
    lp = milp(c, integrality=np.zeros_like(integrality), bounds=bounds, constraints=constraints)
    res = milp(c, integrality=integrality, bounds=bounds, constraints=constraints,
               options={"time_limit": time_limit, "mip_rel_gap": mip_gap, "disp": False})
    seconds = time.perf_counter() - t0
    if res.x is None:
        raise BadArgumentError(f"the solver found no placement ({res.message})")
    counts = [int(np.argmax(res.x[offsets[l] : offsets[l + 1]])) for l in range(len(sizes))]
    const = head_time(problem.shape, problem.hw, problem.dtype, "lm_head" in problem.mandatory)
    to_value = (lambda v: v / US + const) if objective == "time" else (lambda v: -v)
    lp_bound = to_value(lp.fun) if lp.status == 0 else None
    gap = getattr(res, "mip_gap", None)
    return _placement_from_counts(problem, counts, method=f"ilp-{objective}", objective=to_value(res.fun),
                                  solve_seconds=seconds, status=res.message, gap=None if gap is None else float(gap),
                                  lp_bound=lp_bound)


def solve_auto(build, objective: str = "time", time_limit: float = 10.0) -> tuple[Problem, Placement]:
    """Solve with attention on the GPU and on the CPU (where each is feasible) and keep the
    faster; `build(dense_on_gpu)` makes the Problem."""
    best = None
    for dense in (True, False):
        try:
            problem = build(dense)
        except BadArgumentError as e:
            if "smaller than the parts" in str(e) and dense:
                continue
            raise
        placement = solve(problem, objective, time_limit)
        if best is None or placement.predicted_time < best[1].predicted_time:
            best = (problem, placement)
    assert best is not None
    return best


def gpu_bytes(problem: Problem, placement: Placement) -> int:
    """GPU bytes the placement uses, mandatory parts included."""
    return sum(problem.mandatory.values()) + sum(len(g) for g in placement.gpu_neurons) * problem.neuron_bytes


def placement_document(problem: Problem, placement: Placement, others: dict[str, Placement], offload: dict,
                       model_hash: str | None, profile_path: str | None) -> dict:
    """The JSON written by `powerinfer solve`."""
    neurons_gpu = sum(len(g) for g in placement.gpu_neurons)
    layers = []
    for l, gpu in enumerate(placement.gpu_neurons):
        k = int(np.searchsorted(np.cumsum(problem.sizes[l]), len(gpu), side="right"))
        gpu_load, cpu_load = float(problem.loads[l][:k].sum()), float(problem.loads[l][k:].sum())
        layers.append({"layer": l, "n_gpu": len(gpu), "n_cpu": problem.shape.n_ff - len(gpu),
                       "gpu_load": gpu_load, "cpu_load": cpu_load,
                       "gpu_share_of_load": gpu_load / max(gpu_load + cpu_load, 1e-12),
                       "time_us": 1e6 * layer_time(problem.costs, gpu_load, cpu_load, k > 0, k == len(problem.loads[l])),
                       "gpu_neurons": gpu.tolist()})
    summary = lambda p: {"method": p.method, "objective": p.objective, "tokens_per_s": 1.0 / p.predicted_time,
                         "solve_seconds": p.solve_seconds, "status": p.status, "gap": p.gap, "lp_bound": p.lp_bound}
    return {
        "format": "powerinfer-placement", "format_version": 1, "model_hash": model_hash, "profile": profile_path,
        "shape": asdict(problem.shape), "hardware": problem.hw.to_dict(), "dtype": problem.dtype,
        "group_size": int(problem.sizes[0][0]) if problem.sizes and len(problem.sizes[0]) else 0,
        "dense_on_gpu": problem.dense_on_gpu,
        "budget": {"total": problem.budget, "mandatory": problem.mandatory, "neurons": neurons_gpu * problem.neuron_bytes,
                   "neuron_bytes": problem.neuron_bytes, "free": problem.budget - gpu_bytes(problem, placement)},
        "solution": summary(placement),
        "baselines": {name: summary(p) for name, p in others.items()} | {"offload": offload},
        "predicted_tokens_per_s": 1.0 / placement.predicted_time,
        "gpu_share_of_neuron_load": sum(l["gpu_load"] for l in layers) / max(sum(l["gpu_load"] + l["cpu_load"]
                                                                             for l in layers), 1e-12),
        "layers": layers,
    }


def explain(doc: dict) -> str:
    lines = ["| layer | GPU neurons | CPU neurons | GPU share of load | layer us |", "|---|---|---|---|---|"]
    for l in doc["layers"]:
        lines.append(f"| {l['layer']} | {l['n_gpu']} | {l['n_cpu']} | {l['gpu_share_of_load']:.3f} | {l['time_us']:.1f} |")
    return "\n".join(lines)


def brute_force(problem: Problem, objective: str = "time") -> float:
    """Exhaustive optimum over hottest-first prefixes (tests: tiny instances only)."""
    import itertools

    best = math.inf if objective == "time" else -math.inf
    ranges = [range(len(loads) + 1) for loads in problem.loads]
    for ks in itertools.product(*ranges):
        used = sum(int(problem.sizes[l][:k].sum()) * problem.neuron_bytes for l, k in enumerate(ks))
        if used > problem.room:
            continue
        if any(0 < problem.sizes[l][:k].sum() < problem.min_neurons[l] for l, k in enumerate(ks)):
            continue
        if objective == "time":
            best = min(best, predicted_time(problem, list(ks)))
        else:
            best = max(best, sum(float(problem.loads[l][:k].sum()) for l, k in enumerate(ks)))
    return best


def shape_from_manifest(manifest: dict) -> ModelShape | None:
    data = manifest.get("model", {}).get("shape")
    if not data:
        return None
    return ModelShape(**{f.name: data[f.name] for f in fields(ModelShape) if f.name in data})
