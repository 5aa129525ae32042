"""`mnist1d_shortcut`: MNIST-1D signals (Greydanus, 2020) with an injected spurious marker.

The `mnist1d` package generates the 40-sample signals offline from its ten digit templates
(`mnist1d.data.make_dataset`, no download). y = int(digit < 5); the binary attribute a agrees
with y with probability rho_train in train/val/test_id and rho_ood in test_ood, and is written
into the signal as a marker: the first `marker_width` samples get (2a − 1)·spurious_scale
plus N(0, spurious_noise²) noise per sample; `pixel_noise` adds independent N(0, pixel_noise²)
to every sample of the signal (0 = none). Splits and attribute counts are drawn by the
shared `assign_splits` / `assign_attributes` (stratified by y, exact agreement counts per
split and class).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np

from stages.core.artifacts import SPLITS
from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import Generated, assign_attributes, assign_splits


@dataclass
class Mnist1DShortcutConfig:
    """MNIST-1D (generated offline by `mnist1d`), y = digit < 5, a marker agreeing with y w.p. ρ."""

    kind: str = option("dataset generator")
    seed: int = option("seed of the signals, splits, attributes and marker noise")
    num_samples: int = option("MNIST-1D examples generated (split over train/val/test_id/test_ood)")
    rho_train: float = option("P(attribute == label) in train, val and test_id")
    rho_ood: float = option("P(attribute == label) in test_ood")
    spurious_scale: float = option("marker height: ±scale added to the first marker_width samples")
    spurious_noise: float = option("std of the noise on the marker")
    marker_width: int = option("how many leading samples of the 40 carry the marker")
    pixel_noise: float = option("std of independent N(0, ·) noise added to every sample of every signal (0 = none)")
    val_frac: float = option("fraction of examples in val")
    test_id_frac: float = option("fraction of examples in test_id")
    test_ood_frac: float = option("fraction of examples in test_ood")

    def check(self, c: Checks) -> None:
        c.require(self.num_samples >= 200, "num_samples", f"must be >= 200, got {self.num_samples}")
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.non_negative(self.spurious_scale, "spurious_scale")
        c.non_negative(self.spurious_noise, "spurious_noise")
        c.non_negative(self.pixel_noise, "pixel_noise")
        c.require(1 <= self.marker_width <= 40, "marker_width", f"must be in 1..40, got {self.marker_width}")
        c.fracs(self.val_frac, self.test_id_frac, self.test_ood_frac)


LENGTH = 40


def load_signals(num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(signals (n, 40) float64, digits (n,)) from mnist1d's generator with its default transforms.

    mnist1d seeds and draws from numpy's and Python's global RNGs; their states are restored
    afterwards so nothing else in the process is affected.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed, args.train_split = num_samples, seed, 1.0
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return np.asarray(data["x"], dtype=np.float64), np.asarray(data["y"], dtype=np.int64)


def inject_marker(x: np.ndarray, a: np.ndarray, cfg: Mnist1DShortcutConfig, rng: np.random.Generator) -> np.ndarray:
    """A copy of `x` whose first marker_width samples carry ±spurious_scale (+ noise) for a = 1 / 0,
    then (pixel_noise > 0 only) independent noise on every sample, drawn after the marker's."""
    out = x.copy()
    w = cfg.marker_width
    out[:, :w] += (2 * a[:, None] - 1) * cfg.spurious_scale + cfg.spurious_noise * rng.standard_normal((len(x), w))
    if cfg.pixel_noise > 0:
        out += cfg.pixel_noise * rng.standard_normal(out.shape)
    return out


def generate(cfg: Mnist1DShortcutConfig) -> Generated:
    """All four splits, rows ordered by split (train, val, test_id, test_ood) then id.

    An example's id is its index in mnist1d's output; one stream `default_rng(seed)` draws,
    in order, the split permutation, the attribute permutation, the marker noise and the
    per-sample noise (pixel_noise > 0 only).
    """
    signals, digits = load_signals(cfg.num_samples, cfg.seed)
    y = (digits < 5).astype(np.int64)
    rng = np.random.default_rng(cfg.seed)
    split = assign_splits(y, cfg, rng)
    a = assign_attributes(y, split, cfg, rng)
    x = inject_marker(signals, a, cfg, rng).astype(np.float32)
    rank = {name: i for i, name in enumerate(SPLITS)}
    order = np.lexsort((np.arange(len(y)), np.array([rank[s] for s in split])))
    columns = {"id": order.astype(np.int64), "split": split[order], "y": y[order], "a": a[order], "x": x[order]}
    meta = {
        "kind": "mnist1d_shortcut",
        "n_classes": 2,
        "n_attrs": 2,
        "shape": [LENGTH],
        "rho_train": cfg.rho_train,
        "rho_ood": cfg.rho_ood,
        "params": dataclasses.asdict(cfg),
        "split_sizes": {name: int((split == name).sum()) for name in SPLITS},
    }
    return columns, meta


register_dataset("mnist1d_shortcut", Mnist1DShortcutConfig, generate=generate)
