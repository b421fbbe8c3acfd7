"""Activation statistics: per-neuron counts per layer, thresholds, skew metrics, and their
files (safetensors + JSON manifest), validated on load."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PowerInferError
from ..manifest import read_manifest
from ..paths import Artefact

FORMAT = "powerinfer-profile"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATS = "stats.safetensors"
ARTEFACT = Artefact(FORMAT, "profile", frozenset({MANIFEST, STATS, "samples", "split.json",
                                                  "activation_distribution.png"}))


class ProfileError(PowerInferError):
    """Profile files missing, corrupt, or made for another model."""


@dataclass
class LayerStats:
    """One layer: how many of `tokens` tokens activated each neuron, and the threshold used."""

    counts: np.ndarray  # int64 (n_ff,)
    tokens: int
    threshold: float

    @property
    def n_ff(self) -> int:
        return int(self.counts.shape[0])

    @property
    def sparsity(self) -> float:
        """Share of (token, neuron) pairs that were inactive."""
        return 1.0 - float(self.counts.sum()) / max(1, self.tokens * self.n_ff)

    def coverage(self, top_fraction: float) -> float:
        """Share of all activations carried by the hottest `top_fraction` of neurons."""
        total = float(self.counts.sum())
        if total == 0:
            return 0.0
        k = max(1, int(round(top_fraction * self.n_ff)))
        return float(np.sort(self.counts)[::-1][:k].sum()) / total

    @property
    def gini(self) -> float:
        """Gini coefficient of the counts: 0 = every neuron equally active, -> 1 = a few carry all."""
        c = np.sort(self.counts.astype(np.float64))
        total = c.sum()
        if total == 0:
            return 0.0
        n = c.shape[0]
        return float((2 * np.arange(1, n + 1) - n - 1).dot(c) / (n * total))

    def metrics(self) -> dict[str, float]:
        return {"sparsity": self.sparsity, "top10_coverage": self.coverage(0.10),
                "top20_coverage": self.coverage(0.20), "gini": self.gini, "threshold": self.threshold,
                "tokens": self.tokens}


@dataclass
class Profile:
    """All layers' statistics plus the manifest describing how they were made."""

    layers: list[LayerStats]
    manifest: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def model_hash(self) -> str | None:
        return self.manifest.get("model", {}).get("hash")

    @property
    def thresholds(self) -> list[float]:
        return [layer.threshold for layer in self.layers]

    @property
    def criterion(self) -> str:
        return self.manifest.get("criterion", "gate_up")

    def samples_dir(self) -> str | None:
        if self.path is None or not self.manifest.get("samples", {}).get("count"):
            return None
        return os.path.join(self.path, "samples")

    def save(self, out_dir: str) -> None:
        from safetensors.numpy import save_file

        os.makedirs(out_dir, exist_ok=True)
        tensors = {}
        for i, layer in enumerate(self.layers):
            tensors[f"layers.{i}.counts"] = np.ascontiguousarray(layer.counts, dtype=np.int64)
            tensors[f"layers.{i}.tokens"] = np.array([layer.tokens], dtype=np.int64)
        tensors["thresholds"] = np.array(self.thresholds, dtype=np.float32)
        manifest = dict(self.manifest)
        manifest.update(format=FORMAT, format_version=FORMAT_VERSION, n_layers=len(self.layers),
                        n_ff=self.layers[0].n_ff if self.layers else 0,
                        layers=[layer.metrics() for layer in self.layers])
        tmp = os.path.join(out_dir, STATS + ".tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(out_dir, STATS))
        with open(os.path.join(out_dir, MANIFEST + ".tmp"), "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(os.path.join(out_dir, MANIFEST + ".tmp"), os.path.join(out_dir, MANIFEST))
        self.manifest, self.path = manifest, out_dir

    @classmethod
    def load(cls, path: str, model_hash: str | None = None) -> "Profile":
        """Read a profile directory; refuse it clearly when it is incomplete, corrupt, or (given
        `model_hash`) made for another model."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        manifest_path = os.path.join(path, MANIFEST)
        manifest = read_manifest(manifest_path, FORMAT, "profile",
                                 f"{path}: not a profile directory (no {MANIFEST}); run `powerinfer profile` first",
                                 ProfileError)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ProfileError(f"{manifest_path}: profile format version {manifest.get('format_version')} "
                               f"is not {FORMAT_VERSION}; re-run `powerinfer profile`")
        if model_hash is not None and manifest.get("model", {}).get("hash") != model_hash:
            raise ProfileError(f"{path}: profile was made for model {manifest.get('model', {}).get('hash')}, "
                               f"not this one ({model_hash})")
        try:
            tensors = load_file(os.path.join(path, STATS))
        except (SafetensorError, OSError, ValueError) as e:
            raise ProfileError(f"{os.path.join(path, STATS)}: missing or corrupt ({e})") from None
        n_layers, n_ff = int(manifest.get("n_layers", -1)), int(manifest.get("n_ff", -1))
        thresholds = tensors.get("thresholds")
        if thresholds is None or thresholds.shape != (n_layers,):
            raise ProfileError(f"{path}: thresholds do not match the manifest's {n_layers} layers")
        layers = []
        for i in range(n_layers):  # by integer index, never by sorted tensor name
            counts, tokens = tensors.get(f"layers.{i}.counts"), tensors.get(f"layers.{i}.tokens")
            if counts is None or tokens is None or counts.shape != (n_ff,) or counts.dtype != np.int64:
                raise ProfileError(f"{path}: layer {i} statistics are missing or malformed")
            layers.append(LayerStats(counts=counts, tokens=int(tokens[0]), threshold=float(thresholds[i])))
        return cls(layers=layers, manifest=manifest, path=path)
