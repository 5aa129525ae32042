"""A dataset's regime: how separable the spurious cue is, against the core feature.

A likelihood (class-conditional generative) classifier weighs a feature by its separation:
the Mahalanobis distance between the means of two groups that differ only in that feature,
under the within-group covariance. Every prepared file records

    separation = {"cue": ..., "core": ...}

- cue:  between groups (y, a) and (y, a') — same label, different attribute — averaged over
        every such pair present in train;
- core: between groups (y, a) and (y', a) — same attribute, different label — likewise;

both under the pooled within-group covariance. A generator whose population is known returns
the closed form (`closed_form`); everywhere else `estimate_separation` (or, for loaders that
stream, `SeparationAccumulator`) estimates it on the train rows. cue > core predicts that a generative classifier leans on the shortcut more
than a discriminative one, cue < core that it leans on it less (`predicted_direction`).

The estimator, exactly (docs/datasets.md, "Separation"):

1. Group means μ_g and counts n_g over the train rows; pooled within-group covariance
   S = Σ_g Σ_{i∈g} (x_i − μ_g)(x_i − μ_g)ᵀ / (N − G) (G = groups present).
2. Regularised: Σ̂ = (1 − SHRINKAGE)·S + SHRINKAGE·diag(S) + RIDGE·mean(diag S)·I. Shrinking the
   correlations towards zero keeps every feature's own variance (so a diagonal population, like
   the Gaussian toy dataset's, is recovered), and is needed when d is large against n (3×8×8 =
   192 pixels against the 900 train images of the 8×8 digits); the ridge keeps Σ̂ invertible
   where a feature never varies within a group (blank pixels, a marker word): a cue carried by
   such a feature gets a separation bounded only by the ridge — read it as "exact".
3. Per pair (g, h): D² = (μ_g − μ_h)ᵀ Σ̂⁻¹ (μ_g − μ_h), less its finite-sample bias
   tr(Σ̂⁻¹ S)·(1/n_g + 1/n_h) (estimated means scatter by S/n around the true ones: with 22
   images in a minority group of 192-pixel images the bias alone is ~2.3² in D²);
   separation = sqrt(max(D² − bias, 0)).
4. cue and core are the means of the pairs' separations, rounded to DECIMALS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

SHRINKAGE = 0.1  # weight of diag(S) in the regularised covariance
RIDGE = 1e-4  # added to the diagonal, in units of the mean within-group variance
DECIMALS = 4  # values are rounded so the metadata's bytes do not depend on BLAS's last bits
# Streaming loaders estimate on a seeded sample of at most this many train rows per group
# (every row of a smaller group), each group's scatter reweighted to its full size.
SAMPLE_PER_GROUP = 2000
# Image benchmarks are estimated on their pixels area-averaged to 3×POOL_SIDE×POOL_SIDE (the
# size of the built-in 8×8 digits): with d ≈ n (3×32×32 = 3,072 pixels against Waterbirds' 4,795 train
# images) the inverse covariance, and so any distance under it, is biased far beyond what
# step 3 corrects, and a d×d solve at full resolution would cost more than decoding.
POOL_SIDE = 8


def closed_form(cue: float, core: float) -> dict[str, float]:
    """`{"cue", "core"}` of a known population, rounded like an estimate (inf stays inf)."""
    return {"cue": _round(cue), "core": _round(core)}


def _round(v: float | None) -> float | None:
    if v is None or not np.isfinite(v):
        return v
    return round(float(v), DECIMALS)


class SeparationAccumulator:
    """Pooled within-group second moments gathered block by block; `result()` is the separation.

    Holds one d×d matrix and a mean per group whatever the number of rows. `weights[g]` scales
    group g's scatter (a subsampled group counts as its full size); the bias term uses the rows
    actually seen.
    """

    def __init__(self, dim: int, n_classes: int, n_attrs: int, weights: Mapping[int, float] | None = None) -> None:
        self.dim, self.n_classes, self.n_attrs = dim, n_classes, n_attrs
        n_groups = n_classes * n_attrs
        self.weights = np.ones(n_groups) if weights is None else np.array([float(weights.get(g, 1.0)) for g in range(n_groups)])
        self.count = np.zeros(n_groups, dtype=np.int64)
        self.sums = np.zeros((n_groups, dim))
        self.cross = np.zeros((dim, dim))
        self.shift: np.ndarray | None = None  # subtracted from every row, against cancellation

    def add(self, x: np.ndarray, y: np.ndarray, a: np.ndarray) -> None:
        """Accumulate rows `x` (n, dim) of labels `y` and attributes `a`."""
        if len(x) == 0:
            return
        x = np.asarray(x, dtype=np.float64).reshape(len(x), self.dim)
        if self.shift is None:
            self.shift = x.mean(axis=0)
        x = x - self.shift
        g = np.asarray(y, dtype=np.int64) * self.n_attrs + np.asarray(a, dtype=np.int64)
        for gg in np.unique(g):
            rows = x[g == gg]
            self.count[gg] += len(rows)
            self.sums[gg] += rows.sum(axis=0)
            self.cross += self.weights[gg] * (rows.T @ rows)

    def result(self) -> dict[str, float | None]:
        """`{"cue", "core"}` (None where train holds no pair of that kind)."""
        present = np.flatnonzero(self.count > 0)
        if len(present) == 0:
            return {"cue": None, "core": None}
        means = np.zeros_like(self.sums)
        means[present] = self.sums[present] / self.count[present, None]
        scatter = self.cross.copy()
        for g in present:
            scatter -= self.weights[g] * self.count[g] * np.outer(means[g], means[g])
        dof = float((self.weights[present] * self.count[present]).sum()) - len(present)
        cov = scatter / max(dof, 1.0)
        cov = (cov + cov.T) / 2
        var = np.clip(np.diag(cov), 0.0, None)
        reg = (1 - SHRINKAGE) * cov
        reg[np.diag_indices(self.dim)] = var + RIDGE * max(float(var.mean()), 1e-12)
        cue_pairs, core_pairs = pairs(self.count, self.n_classes, self.n_attrs)
        all_pairs = cue_pairs + core_pairs
        if not all_pairs:
            return {"cue": None, "core": None}
        diffs = np.stack([means[g] - means[h] for g, h in all_pairs], axis=1)
        solved = np.linalg.solve(reg, np.concatenate([diffs, cov], axis=1))
        d2 = np.einsum("ij,ij->j", diffs, solved[:, : len(all_pairs)])
        trace = float(np.trace(solved[:, len(all_pairs) :]))
        seps = [
            float(np.sqrt(max(d2[k] - trace * (1 / self.count[g] + 1 / self.count[h]), 0.0)))
            for k, (g, h) in enumerate(all_pairs)
        ]
        cue = seps[: len(cue_pairs)]
        core = seps[len(cue_pairs) :]
        return {
            "cue": _round(float(np.mean(cue))) if cue else None,
            "core": _round(float(np.mean(core))) if core else None,
        }


def pairs(count: np.ndarray, n_classes: int, n_attrs: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(cue pairs, core pairs) of groups g = y·n_attrs + a that both have rows: same y and
    different a, or same a and different y."""
    def has(y: int, a: int) -> bool:
        return bool(count[y * n_attrs + a] > 0)

    cue = [
        (y * n_attrs + a, y * n_attrs + b)
        for y in range(n_classes)
        for a in range(n_attrs)
        for b in range(a + 1, n_attrs)
        if has(y, a) and has(y, b)
    ]
    core = [
        (y * n_attrs + a, z * n_attrs + a)
        for a in range(n_attrs)
        for y in range(n_classes)
        for z in range(y + 1, n_classes)
        if has(y, a) and has(z, a)
    ]
    return cue, core


def estimate_separation(
    x: np.ndarray, y: np.ndarray, a: np.ndarray, n_attrs: int, n_classes: int = 2
) -> dict[str, float | None]:
    """`{"cue", "core"}` estimated on rows `x` (the train rows) with labels `y` and attributes `a`."""
    x = np.asarray(x)
    acc = SeparationAccumulator(x.shape[1] if x.ndim == 2 else int(np.prod(x.shape[1:])), n_classes, n_attrs)
    acc.add(x, y, a)
    return acc.result()


def pool_pixels(pixels: np.ndarray, resolution: int, side: int = POOL_SIDE) -> np.ndarray:
    """CHW-flattened images (n, 3·r·r) area-averaged to (n, 3·s·s), s = min(side, r): output
    pixel i averages the source rows/columns j with j·s // r == i."""
    s = min(side, resolution)
    x = np.asarray(pixels, dtype=np.float64).reshape(len(pixels), -1, resolution, resolution)
    if s == resolution:
        return x.reshape(len(pixels), -1)
    bins = np.arange(resolution) * s // resolution
    starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    counts = np.diff(np.r_[starts, resolution])
    x = np.add.reduceat(np.add.reduceat(x, starts, axis=2), starts, axis=3)
    return (x / np.outer(counts, counts)).reshape(len(pixels), -1)


def train_sample(
    split: np.ndarray, y: np.ndarray, a: np.ndarray, n_attrs: int, seed: int, per_group: int = SAMPLE_PER_GROUP
) -> tuple[np.ndarray, dict[int, float]]:
    """(mask of the train rows a streaming loader accumulates, weight per group).

    Every train row of a group with at most `per_group` of them; otherwise a seeded sample of
    `per_group`, weighted by (group size / sample size) so the pooled covariance weighs the
    groups as the full train split does.
    """
    rng = np.random.default_rng([seed, 13])  # its own stream: no other draw of the loader moves
    keep = np.zeros(len(split), dtype=bool)
    weights: dict[int, float] = {}
    g = np.asarray(y, dtype=np.int64) * n_attrs + np.asarray(a, dtype=np.int64)
    train = np.asarray(split) == "train"
    for gg in np.unique(g[train]):
        idx = np.flatnonzero(train & (g == gg))
        if len(idx) > per_group:
            weights[int(gg)] = len(idx) / per_group
            idx = np.sort(rng.choice(idx, per_group, replace=False))
        keep[idx] = True
    return keep, weights


def parse_separation(value: Any) -> dict[str, float | None] | None:
    """File metadata `separation` as {cue, core} floats (None where unknown), or None when the
    file has none; ValueError saying what is wrong with a malformed one."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not {"cue", "core"} <= set(value):
        raise ValueError(f"file metadata 'separation' must be {{cue, core}}, got {value!r}")
    try:
        return {k: None if value[k] is None else float(value[k]) for k in ("cue", "core")}
    except (TypeError, ValueError) as e:
        raise ValueError(f"file metadata 'separation' has a malformed value ({e})") from None


def expected_use(sep: Mapping[str, Any] | None) -> str | None:
    """How much a likelihood classifier is expected to use the shortcut against a discriminative
    one: "more" (cue > core), "less" (cue < core), "about as much", or None when unknown."""
    cue = None if sep is None else sep.get("cue")
    core = None if sep is None else sep.get("core")
    if cue is None or core is None:
        return None
    return "more" if cue > core else "less" if cue < core else "about as much"


def predicted_direction(sep: Mapping[str, Any] | None) -> str:
    """What the separation predicts about generative against discriminative classifiers."""
    use = expected_use(sep)
    if use is None:
        return "no prediction: the separation of the cue or of the core is unknown"
    return f"a likelihood (generative) classifier is expected to use the shortcut {use} {'as' if use == 'about as much' else 'than'} a discriminative one"


def describe(sep: Mapping[str, Any] | None) -> str:
    """One line: the two separations and the prediction."""
    if sep is None:
        return "separation not recorded"
    return f"separation cue {_fmt(sep.get('cue'))} vs core {_fmt(sep.get('core'))}: {predicted_direction(sep)}"


def _fmt(v: Any) -> str:
    return "unknown" if v is None else f"{float(v):.3g}"

