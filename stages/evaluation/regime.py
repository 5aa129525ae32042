"""A dataset's regime: how separable the spurious cue is against the core feature, and what the
compared classifiers make of it.

Every prepared file records, in its metadata, a flat dict `separation` (docs/datasets.md,
"Separation"):

- `cue`, `core`: Mahalanobis distances between the means of groups that differ only in the
  attribute ((y, a) and (y, a′)) or only in the label ((y, a) and (y′, a)), averaged over the
  pairs present in train, under the pooled within-group covariance;
- `cue_low`, `cue_high`, `core_low`, `core_high`: their 95 % intervals (a delete-a-fold
  jackknife over JACKKNIFE_FOLDS random folds of the train rows);
- `cue_floor`, `core_floor`: the largest `cue` of NULL_DRAWS estimates with the attribute
  shuffled within each class (a cue that is not there), and the largest `core` with the label
  shuffled within each attribute — what the estimator reports for nothing at this n and d;
- `rho`: the training agreement (binary y and a: P(a = y); generally the share of train rows in
  the majority attribute of their class);
- `lda_wga`, `lr_wga`: the worst-group accuracy of the rules LDA and logistic regression
  converge to with unlimited train data drawn from Gaussian groups at these distances and the
  train group mix (stages/evaluation/population.py) — what each classifier actually weighs:
  LDA models each class as one Gaussian, so the attribute's spread inside a class (set by ρ)
  counts as noise, and a two-peaked cue is fitted as one wide peak;
- `gap`, `gap_low`, `gap_high`: `lda_wga − lr_wga` and its interval.

The regime is called from the gap (`regime_call`; `expected_use` is its word): "more" (the
generative classifier leans on the shortcut more) when the whole gap interval lies below
−REGIME_MARGIN, "less" when above +REGIME_MARGIN, and no call otherwise — nor when the cue's
interval reaches down to its shuffled-attribute floor (the cue is not distinguishable from no
cue), nor for a file that records only {cue, core} (prepared before the measure). A generator
whose population is known gives the exact values (`closed_form`: intervals of width 0, floors
0); everywhere else `estimate_separation` (or, for loaders that stream, `SeparationAccumulator`)
estimates them on the train rows.

The estimator, exactly:

1. Group means μ_g and counts n_g over the train rows; pooled within-group covariance
   S = Σ_g Σ_{i∈g} (x_i − μ_g)(x_i − μ_g)ᵀ / (N − G) (G = groups present).
2. Regularised: Σ̂ = (1 − SHRINKAGE)·S + SHRINKAGE·diag(S) + RIDGE·mean(diag S)·I. Shrinking the
   correlations towards zero keeps every feature's own variance (so a diagonal population, like
   the Gaussian toy dataset's, is recovered), and is needed when d is large against n (3×8×8 =
   192 pixels against the 900 train images of the 8×8 digits); the ridge keeps Σ̂ invertible
   where a feature never varies within a group (blank pixels, a marker word): a cue carried by
   such a feature gets a separation bounded only by the ridge — read it as "exact".
3. Per pair of groups (g, h): D² = (μ_g − μ_h)ᵀ Σ̂⁻¹ (μ_g − μ_h), less its finite-sample bias
   tr(Σ̂⁻¹ S)·(1/n_g + 1/n_h) (estimated means scatter by S/n around the true ones: with 22
   images in a minority group of 192-pixel images the bias alone is ~2.3² in D²), clipped at 0;
   a pair's separation is √D².
4. cue and core are the means of their pairs' separations; every pair's D² (the diagonal pairs
   too) places the groups for the population rules.
5. The same on the train rows without each fold (the jackknife), and with the attribute (label)
   shuffled within each class (attribute) for the floors.
6. Everything is rounded to DECIMALS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from stages.evaluation.population import population_rules

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
# The intervals: a delete-one-fold jackknife over this many random folds of the train rows,
# θ ± JACKKNIFE_T · se (JACKKNIFE_T: Student's t at 97.5 % with JACKKNIFE_FOLDS − 1 degrees of freedom).
JACKKNIFE_FOLDS = 20
JACKKNIFE_T = 2.093
# The floors: the largest of this many shuffled estimates, so a cue that is not there exceeds
# it with probability 1 / (NULL_DRAWS + 1) = 5 %.
NULL_DRAWS = 19
SEED = 23  # the folds' and shuffles' stream (the data's own seed is not known here)
# No regime is called while |lda_wga − lr_wga| may be below this: population differences
# smaller than that are beyond what any experiment of this project resolves (a 95 % interval
# of a worst-group accuracy over 200 examples is ±0.07), and the phase panels' measured
# differences are indistinguishable from 0 there (docs/datasets.md, "Separation").
REGIME_MARGIN = 0.02
KEYS = (
    "cue", "core", "cue_low", "cue_high", "core_low", "core_high", "cue_floor", "core_floor",
    "rho", "lda_wga", "lr_wga", "gap", "gap_low", "gap_high",
)


def _round(v: float | None) -> float | None:
    if v is None or not np.isfinite(v):
        return v
    return round(float(v), DECIMALS)


def _population(d2: np.ndarray, y: np.ndarray, prob: np.ndarray) -> tuple[float, float] | None:
    """(lda_wga, lr_wga) of the population rules over every group, or None when a distance is
    infinite (an exact cue: no Gaussian places it) or a class has no group."""
    if not np.all(np.isfinite(d2)) or set(np.unique(y).tolist()) != {0, 1}:
        return None
    return population_rules(d2, y, prob).worst_group()


def closed_form(
    cue: float, core: float, rho: float | None = None, d2: np.ndarray | None = None,
    y: np.ndarray | None = None, prob: np.ndarray | None = None,
) -> dict[str, float | None]:
    """The separation dict of a known population, rounded like an estimate (inf stays inf):
    exact intervals, floors 0, and, given the groups' squared distances `d2`, classes `y` and
    train probabilities `prob`, the population rules' worst-group accuracies."""
    out: dict[str, float | None] = {"cue": cue, "core": core, "cue_low": cue, "cue_high": cue, "core_low": core,
                                    "core_high": core, "cue_floor": 0.0, "core_floor": 0.0, "rho": rho}
    rules = None if d2 is None else _population(np.asarray(d2, dtype=np.float64), np.asarray(y), np.asarray(prob))
    gen, disc = rules if rules is not None else (None, None)
    gap = None if rules is None else gen - disc
    out.update({"lda_wga": gen, "lr_wga": disc, "gap": gap, "gap_low": gap, "gap_high": gap})
    return {k: _round(out[k]) for k in KEYS}


class _Moments:
    """Per group: rows seen, their weight and weighted sum of x (one set per fold or shuffle)."""

    def __init__(self, k: int, n_groups: int, dim: int) -> None:
        self.count = np.zeros((k, n_groups), dtype=np.int64)
        self.weight = np.zeros((k, n_groups))
        self.sums = np.zeros((k, n_groups, dim))

    def add(self, k: int, g: np.ndarray, w: np.ndarray, x: np.ndarray) -> None:
        n_groups = self.count.shape[1]
        self.count[k] += np.bincount(g, minlength=n_groups)
        self.weight[k] += np.bincount(g, weights=w, minlength=n_groups)
        onehot = np.zeros((n_groups, len(g)))
        onehot[g, np.arange(len(g))] = w
        self.sums[k] += onehot @ x


class SeparationAccumulator:
    """Pooled within-group second moments gathered block by block; `result()` is the separation dict.

    Holds a d×d matrix per jackknife fold and a mean per group and fold, and the group sums of
    NULL_DRAWS attribute- and label-shuffled copies, whatever the number of rows. `weights[g]`
    scales group g's rows (a subsampled group counts as its full size); the bias term uses the
    rows actually seen. The shuffles permute the attribute within each class (the label within
    each attribute) among the rows of one `add` call.
    """

    def __init__(self, dim: int, n_classes: int, n_attrs: int, weights: Mapping[int, float] | None = None) -> None:
        self.dim, self.n_classes, self.n_attrs = dim, n_classes, n_attrs
        n_groups = n_classes * n_attrs
        self.weights = np.ones(n_groups) if weights is None else np.array([float(weights.get(g, 1.0)) for g in range(n_groups)])
        self.folds = _Moments(JACKKNIFE_FOLDS, n_groups, dim)
        self.cross = np.zeros((JACKKNIFE_FOLDS, dim, dim))
        self.null_cue = _Moments(NULL_DRAWS, n_groups, dim)
        self.null_core = _Moments(NULL_DRAWS, n_groups, dim)
        self.shift: np.ndarray | None = None  # subtracted from every row, against cancellation
        self.rng = np.random.default_rng(SEED)

    def add(self, x: np.ndarray, y: np.ndarray, a: np.ndarray) -> None:
        """Accumulate rows `x` (n, dim) of labels `y` and attributes `a`."""
        if len(x) == 0:
            return
        x = np.asarray(x, dtype=np.float64).reshape(len(x), self.dim)
        if self.shift is None:
            self.shift = x.mean(axis=0)
        x = x - self.shift
        y, a = np.asarray(y, dtype=np.int64), np.asarray(a, dtype=np.int64)
        w = self.weights[y * self.n_attrs + a]
        fold = self.rng.integers(0, JACKKNIFE_FOLDS, size=len(x))
        for k in np.unique(fold):
            rows = fold == k
            self.folds.add(k, y[rows] * self.n_attrs + a[rows], w[rows], x[rows])
            self.cross[k] += (x[rows] * w[rows, None]).T @ x[rows]
        for r in range(NULL_DRAWS):
            self.null_cue.add(r, y * self.n_attrs + _shuffle_within(a, y, self.rng), w, x)
            self.null_core.add(r, _shuffle_within(y, a, self.rng) * self.n_attrs + a, w, x)

    def result(self) -> dict[str, float | None]:
        """The separation dict (KEYS; None where train holds no pair of that kind)."""
        cross = self.cross.sum(0)
        total = (self.folds.count.sum(0), self.folds.weight.sum(0), self.folds.sums.sum(0))
        point = self._estimate(*total, cross, population=True)
        out = {k: point[k] for k in ("cue", "core", "rho", "lda_wga", "lr_wga", "gap")}
        leave_out = [
            self._estimate(total[0] - self.folds.count[k], total[1] - self.folds.weight[k],
                           total[2] - self.folds.sums[k], cross - self.cross[k], population=point["gap"] is not None)
            for k in range(JACKKNIFE_FOLDS)
        ]
        for key in ("cue", "core", "gap"):
            out[f"{key}_low"], out[f"{key}_high"] = _jackknife(point[key], [r[key] for r in leave_out], key == "gap")
        for key, null in (("cue", self.null_cue), ("core", self.null_core)):
            draws = [self._estimate(null.count[r], null.weight[r], null.sums[r], cross)[key] for r in range(NULL_DRAWS)]
            out[f"{key}_floor"] = None if any(v is None for v in draws) else max(draws)
        return {k: _round(out[k]) for k in KEYS}

    def _estimate(
        self, count: np.ndarray, weight: np.ndarray, sums: np.ndarray, cross: np.ndarray, population: bool = False
    ) -> dict[str, Any]:
        """cue, core (and with `population`: rho, lda_wga, lr_wga, gap) from one set of moments."""
        none = dict.fromkeys(("cue", "core", "rho", "lda_wga", "lr_wga", "gap"))
        present = np.flatnonzero(count > 0)
        if len(present) == 0:
            return none
        means = np.zeros_like(sums)
        means[present] = sums[present] / weight[present, None]
        scatter = cross - sum(weight[g] * np.outer(means[g], means[g]) for g in present)
        cov = scatter / max(float(weight[present].sum()) - len(present), 1.0)
        cov = (cov + cov.T) / 2
        var = np.clip(np.diag(cov), 0.0, None)
        reg = (1 - SHRINKAGE) * cov
        reg[np.diag_indices(self.dim)] = var + RIDGE * max(float(var.mean()), 1e-12)
        all_pairs = [(int(g), int(h)) for i, g in enumerate(present) for h in present[i + 1 :]]
        if not all_pairs:
            return none
        diffs = np.stack([means[g] - means[h] for g, h in all_pairs], axis=1)
        solved = np.linalg.solve(reg, np.concatenate([diffs, cov], axis=1))
        raw = np.einsum("ij,ij->j", diffs, solved[:, : len(all_pairs)])
        trace = float(np.trace(solved[:, len(all_pairs) :]))
        d2 = {p: max(float(raw[k]) - trace * (1 / count[p[0]] + 1 / count[p[1]]), 0.0) for k, p in enumerate(all_pairs)}
        cue_pairs, core_pairs = pairs(count, self.n_classes, self.n_attrs)
        cue = [float(np.sqrt(d2[p])) for p in cue_pairs]
        core = [float(np.sqrt(d2[p])) for p in core_pairs]
        out = {**none, "cue": float(np.mean(cue)) if cue else None, "core": float(np.mean(core)) if core else None}
        if population and self.n_classes == 2:
            y_of = present // self.n_attrs
            share = weight[present] / weight[present].sum()
            out["rho"] = float(sum(share[y_of == c].max() for c in np.unique(y_of)))
            index = {int(g): i for i, g in enumerate(present)}
            dist = np.zeros((len(present), len(present)))
            for (g, h), v in d2.items():
                dist[index[g], index[h]] = dist[index[h], index[g]] = v
            rules = _population(dist, y_of, share)
            if rules is not None:
                out["lda_wga"], out["lr_wga"] = rules
                out["gap"] = rules[0] - rules[1]
        return out


def _shuffle_within(values: np.ndarray, within: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`values` permuted among the rows of each level of `within`."""
    out = values.copy()
    for level in np.unique(within):
        rows = np.flatnonzero(within == level)
        out[rows] = values[rows[rng.permutation(len(rows))]]
    return out


def _jackknife(point: float | None, leave_out: list[float | None], signed: bool) -> tuple[float | None, float | None]:
    """θ ± JACKKNIFE_T·se with se² = (K − 1)/K Σ (θ_(k) − mean)²; clipped at 0 unless `signed`."""
    if point is None or any(v is None for v in leave_out) or not np.isfinite(point):
        return point, point
    values = np.asarray(leave_out, dtype=np.float64)
    k = len(values)
    se = float(np.sqrt((k - 1) / k * ((values - values.mean()) ** 2).sum()))
    low, high = point - JACKKNIFE_T * se, point + JACKKNIFE_T * se
    return (low, high) if signed else (max(low, 0.0), high)


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
    """The separation dict (KEYS) estimated on rows `x` (the train rows) with labels `y` and attributes `a`."""
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
    """File metadata `separation` as a dict of floats (None where unknown): {cue, core} and
    whichever of the other KEYS it records (a file prepared before them has none), or None
    when the file has none; ValueError saying what is wrong with a malformed one."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not {"cue", "core"} <= set(value):
        raise ValueError(f"file metadata 'separation' must be {{cue, core}}, got {value!r}")
    try:
        return {k: None if value[k] is None else float(value[k]) for k in KEYS if k in value}
    except (TypeError, ValueError) as e:
        raise ValueError(f"file metadata 'separation' has a malformed value ({e})") from None


def regime_call(sep: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """("more" | "less" | None, why): the regime the separation dict supports (module docstring).

    "more": the generative classifier is expected to lean on the shortcut more than the
    discriminative one; "less": less; None: no call, and the reason."""
    if sep is None or sep.get("cue") is None or sep.get("core") is None:
        return None, "the separation of the cue or of the core is unknown"
    if "gap" not in sep:
        return None, ("the file records only cue and core separations (prepared before the regime measure); "
                      "re-run `dvc repro -f prepare@<dataset>`")
    low, floor = sep.get("cue_low"), sep.get("cue_floor")
    if low is not None and floor is not None and not low > floor:
        return None, (f"the cue is not distinguishable from a shuffled attribute "
                      f"(its interval reaches {_fmt(low)}, the shuffled-attribute floor is {_fmt(floor)})")
    gap, gap_low, gap_high = sep.get("gap"), sep.get("gap_low"), sep.get("gap_high")
    if gap is None:
        return None, "the population rules are undefined here (an exact cue, or a class without groups)"
    gap_low = gap if gap_low is None else gap_low
    gap_high = gap if gap_high is None else gap_high
    if gap_high < -REGIME_MARGIN:
        return "more", "more"
    if gap_low > REGIME_MARGIN:
        return "less", "less"
    interval = "" if gap_low == gap_high else f" [{gap_low:+.3f}, {gap_high:+.3f}]"
    return None, (f"LDA's and logistic regression's population worst-group accuracies differ by {gap:+.3f}"
                  f"{interval}, not beyond ±{REGIME_MARGIN:g}")


def expected_use(sep: Mapping[str, Any] | None) -> str | None:
    """How much a likelihood classifier is expected to use the shortcut against a discriminative
    one: "more", "less", or None when the separation dict supports no call (`regime_call`)."""
    return regime_call(sep)[0]


def predicted_direction(sep: Mapping[str, Any] | None) -> str:
    """What the separation dict says of the population rules: a description of the data (the
    Bayes-optimal LDA rule against population logistic regression), not a prediction about the
    fitted models, which the evidence compares (docs/metrics.md)."""
    use, why = regime_call(sep)
    if use is None:
        return f"no call: {why}"
    return (f"in the population, the LDA rule uses the cue {use} than logistic regression "
            "(a description of the data, not a prediction about the fitted models)")


def describe(sep: Mapping[str, Any] | None) -> str:
    """One line: the two separations (with intervals and the shuffled-attribute floor where
    recorded), the population rules' worst-group accuracies, and the prediction."""
    if sep is None:
        return "separation not recorded"
    parts = [f"separation cue {_fmt(sep.get('cue'))}{_interval(sep, 'cue')} vs core {_fmt(sep.get('core'))}{_interval(sep, 'core')}"]
    if sep.get("cue_floor"):
        parts.append(f"shuffled-attribute floor {_fmt(sep['cue_floor'])}")
    if sep.get("lda_wga") is not None and sep.get("lr_wga") is not None:
        rho = f" at ρ {float(sep['rho']):.3g}" if sep.get("rho") is not None else ""
        parts.append(f"population worst-group{rho}: LDA {float(sep['lda_wga']):.3f} vs logistic regression {float(sep['lr_wga']):.3f}")
    return f"{'; '.join(parts)}: {predicted_direction(sep)}"


def _interval(sep: Mapping[str, Any], key: str) -> str:
    low, high = sep.get(f"{key}_low"), sep.get(f"{key}_high")
    if low is None or high is None or low == high:
        return ""
    return f" [{_fmt(low)}, {_fmt(high)}]"


def _fmt(v: Any) -> str:
    return "unknown" if v is None else f"{float(v):.3g}"
