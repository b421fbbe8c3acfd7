"""`powerinfer profile --report DIR`: per-layer table and the power-law plot."""

from __future__ import annotations

import os

import numpy as np

from ..paths import save_figure
from .stats import Profile


def table(profile: Profile) -> str:
    lines = ["| layer | tokens | threshold | sparsity | top-10% share | top-20% share | Gini |",
             "|---|---|---|---|---|---|---|"]
    for i, layer in enumerate(profile.layers):
        lines.append(f"| {i} | {layer.tokens} | {layer.threshold:.3g} | {layer.sparsity:.3f} | "
                     f"{layer.coverage(0.1):.3f} | {layer.coverage(0.2):.3f} | {layer.gini:.3f} |")
    mean = lambda f: float(np.mean([f(layer) for layer in profile.layers]))
    lines.append(f"| mean | | | {mean(lambda l: l.sparsity):.3f} | {mean(lambda l: l.coverage(0.1)):.3f} | "
                 f"{mean(lambda l: l.coverage(0.2)):.3f} | {mean(lambda l: l.gini):.3f} |")
    return "\n".join(lines)


def plot(profile: Profile, path: str, groups: int = 4) -> None:
    """Cumulative share of activations vs share of neurons (hottest first), one curve per
    group of consecutive layers (mean over the group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(profile.layers)
    groups = max(1, min(groups, n))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    bounds = np.linspace(0, n, groups + 1).astype(int)
    for g in range(groups):
        members = profile.layers[bounds[g] : bounds[g + 1]]
        curves = []
        for layer in members:
            c = np.sort(layer.counts.astype(np.float64))[::-1]
            curves.append(np.cumsum(c) / max(c.sum(), 1))
        x = np.arange(1, len(curves[0]) + 1) / len(curves[0])
        ax.plot(x, np.mean(curves, axis=0), label=f"layers {bounds[g]}-{bounds[g + 1] - 1}")
    ax.plot([0, 1], [0, 1], "k:", label="uniform")
    ax.axvline(0.2, color="0.7", lw=0.8)
    ax.set_xlabel("share of neurons (hottest first)")
    ax.set_ylabel("cumulative share of activations")
    name = profile.manifest.get("model", {}).get("name") or ("synthetic" if "synthetic" in profile.manifest else "")
    ax.set_title(f"Activation distribution {name}".strip())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def report(profile_dir: str) -> str:
    """The table as text; writes activation_distribution.png into the profile directory."""
    profile = Profile.load(profile_dir)
    png = os.path.join(profile_dir, "activation_distribution.png")
    plot(profile, png)
    quality = profile.manifest.get("quality") or {}
    extra = "".join(f"\n{k}: {v:.4g}" for k, v in quality.items())
    return f"{table(profile)}\n{extra}\nplot: {png}"
