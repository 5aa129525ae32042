"""The one metric implementation: accuracy, worst-group, calibration and proper scores.

Pure numpy functions of (logits, labels, groups). Every stage that reports a metric
calls these, and every number they return can be recomputed from a predictions Parquet
(definitions and a recomputation snippet: docs/metrics.md).

Conventions, all deliberate:
- Arithmetic is float64, whatever the logits' dtype (the predictions file stores float32;
  the metrics are computed from exactly those float32 values).
- The prediction is `argmax` over logits; ties go to the lowest class index.
- Confidence is the largest softmax probability; ECE bins are equal-width on [0, 1],
  bin index `min(floor(conf * B), B - 1)`, so every bin is [lower, upper) except the
  last, which also holds conf == 1.0.
- A group or class absent from a split is reported (n = 0, acc = None) but never enters
  a min or a mean; None rather than NaN so the JSON stays strict.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log softmax in float64, stable for any finite logits (subtracts the row max)."""
    z = np.asarray(logits, dtype=np.float64)
    shifted = z - z.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64, stable for any finite logits."""
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def predictions(logits: np.ndarray) -> np.ndarray:
    """Predicted class per row: argmax of the logits, ties to the lowest index (int64)."""
    return np.asarray(logits).argmax(axis=1).astype(np.int64)


def group_accuracies(
    correct: np.ndarray, g: np.ndarray, n_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """(count, accuracy) per group 0..n_groups-1; accuracy is NaN where the count is 0."""
    n = np.bincount(g, minlength=n_groups).astype(np.int64)
    hits = np.bincount(g, weights=correct.astype(np.float64), minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(n > 0, hits / np.maximum(n, 1), np.nan)
    return n, acc


def weighted_group_accuracy(
    group_acc: np.ndarray, group_n: np.ndarray, weights: np.ndarray
) -> float | None:
    """Σ_g w_g acc_g over groups present (n_g > 0), with w renormalised over those groups.

    Returns None when every present group has weight 0 (no training example of any of them).
    """
    present = group_n > 0
    w = np.asarray(weights, dtype=np.float64) * present
    total = w.sum()
    if total <= 0:
        return None
    return float((w[present] * group_acc[present]).sum() / total)


def balanced_accuracy(correct: np.ndarray, y: np.ndarray, n_classes: int) -> float:
    """Mean per-class recall over the classes present in `y`."""
    n = np.bincount(y, minlength=n_classes)
    hits = np.bincount(y, weights=correct.astype(np.float64), minlength=n_classes)
    present = n > 0
    return float((hits[present] / n[present]).mean())


def reliability(confidence: np.ndarray, correct: np.ndarray, n_bins: int) -> list[dict[str, Any]]:
    """Per equal-width confidence bin: {bin_lower, bin_upper, n, conf, acc} (conf/acc None if empty)."""
    idx = np.minimum(np.floor(confidence * n_bins).astype(np.int64), n_bins - 1)
    n = np.bincount(idx, minlength=n_bins)
    conf_sum = np.bincount(idx, weights=confidence, minlength=n_bins)
    hit_sum = np.bincount(idx, weights=correct.astype(np.float64), minlength=n_bins)
    rows = []
    for b in range(n_bins):
        rows.append(
            {
                "bin_lower": b / n_bins,
                "bin_upper": (b + 1) / n_bins,
                "n": int(n[b]),
                "conf": float(conf_sum[b] / n[b]) if n[b] else None,
                "acc": float(hit_sum[b] / n[b]) if n[b] else None,
            }
        )
    return rows


def expected_calibration_error(bins: list[dict[str, Any]]) -> float:
    """ECE = Σ_b (n_b / n) |acc_b − conf_b| over the non-empty bins of `reliability()`."""
    total = sum(b["n"] for b in bins)
    return float(sum(b["n"] / total * abs(b["acc"] - b["conf"]) for b in bins if b["n"]))


def _check_inputs(logits: np.ndarray, y: np.ndarray, g: np.ndarray, n_groups: int) -> None:
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be 2-D (n, n_classes), got shape {logits.shape}")
    n, k = logits.shape
    if n == 0:
        raise ValueError("no examples: metrics of an empty split are undefined")
    if y.shape != (n,) or g.shape != (n,):
        raise ValueError(f"y {y.shape} and g {g.shape} must both have shape ({n},) like the logits")
    if not np.isfinite(logits).all():
        bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
        raise ValueError(f"{len(bad)} rows have non-finite logits (first row {int(bad[0])})")
    if y.min() < 0 or y.max() >= k:
        raise ValueError(f"labels must be in 0..{k - 1}, got range {int(y.min())}..{int(y.max())}")
    if g.min() < 0 or g.max() >= n_groups:
        raise ValueError(
            f"groups must be in 0..{n_groups - 1}, got range {int(g.min())}..{int(g.max())}"
        )


def split_metrics(
    logits: np.ndarray,
    y: np.ndarray,
    g: np.ndarray,
    n_groups: int,
    train_group_props: np.ndarray,
    ece_bins: int,
    bootstrap_resamples: int = 0,
    bootstrap_seed: int | Sequence[int] = 0,
) -> dict[str, Any]:
    """Every metric of one split, as JSON-ready Python values (see docs/metrics.md).

    Args:
        logits: (n, n_classes) scores; only their argmax and softmax are used.
        y, g: int labels and groups (g = y * n_attrs + a), shape (n,).
        n_groups: n_classes * n_attrs; `groups` lists every one of them.
        train_group_props: (n_groups,) fraction of the *train* split in each group,
            the weights of `avg_acc_weighted`.
        ece_bins: number of equal-width confidence bins.
        bootstrap_resamples, bootstrap_seed: with resamples > 0, also 95% percentile
            bootstrap intervals `acc_ci` and `worst_group_acc_ci` (see `bootstrap_ci`).

    Returns a dict with n, acc, worst_group_acc, worst_group_acc_exact (`worst_group_exact`),
    avg_acc_weighted, balanced_acc, ece, nll, brier, confusion (K × K, rows true, columns
    predicted), groups {str(g): {n, acc, ci, pred}} (ci: the group's exact 95% interval,
    `clopper_pearson`; pred: counts of each predicted class in the group), reliability
    (per-bin list) and, with the bootstrap, acc_ci and worst_group_acc_ci.
    """
    logits = np.asarray(logits)
    y = np.asarray(y, dtype=np.int64)
    g = np.asarray(g, dtype=np.int64)
    _check_inputs(logits, y, g, n_groups)
    if ece_bins < 1:
        raise ValueError(f"ece_bins must be >= 1, got {ece_bins}")
    weights = np.asarray(train_group_props, dtype=np.float64)
    if weights.shape != (n_groups,):
        raise ValueError(f"train_group_props must have shape ({n_groups},), got {weights.shape}")

    n, k = logits.shape
    logp = log_softmax(logits)
    p = np.exp(logp)
    pred = predictions(logits)
    correct = pred == y
    rows = np.arange(n)
    # Confidence of the predicted class (== max prob); a tie in logits is a tie in probs.
    confidence = p[rows, pred]
    onehot = np.zeros_like(p)
    onehot[rows, y] = 1.0

    group_n, group_acc = group_accuracies(correct, g, n_groups)
    present = group_n > 0
    group_hits = np.bincount(g, weights=correct.astype(np.float64), minlength=n_groups).round().astype(np.int64)
    bins = reliability(confidence, correct, ece_bins)
    pred_counts = group_prediction_counts(pred, g, n_groups, k)
    out: dict[str, Any] = {
        "n": int(n),
        "acc": float(correct.mean()),
        "worst_group_acc": float(group_acc[present].min()),
        "worst_group_acc_exact": worst_group_exact(group_hits[None], group_n),
        "avg_acc_weighted": weighted_group_accuracy(group_acc, group_n, weights),
        "balanced_acc": balanced_accuracy(correct, y, k),
        "ece": expected_calibration_error(bins),
        "nll": float(-logp[rows, y].mean()),
        "brier": float(((p - onehot) ** 2).sum(axis=1).mean()),
        "confusion": confusion_matrix(y, pred, k).tolist(),
        "groups": {
            str(i): {
                "n": int(group_n[i]),
                "acc": float(group_acc[i]) if present[i] else None,
                "ci": clopper_pearson(int(group_hits[i]), int(group_n[i])) if present[i] else None,
                "pred": pred_counts[i].tolist(),
            }
            for i in range(n_groups)
        },
        "reliability": bins,
    }
    if bootstrap_resamples > 0:
        ci = bootstrap_ci(correct, g, n_groups, bootstrap_resamples, bootstrap_seed)
        out["acc_ci"] = ci["acc"]
        out["worst_group_acc_ci"] = ci["worst_group_acc"]
    return out


def group_proportions(g: np.ndarray, n_groups: int) -> np.ndarray:
    """Fraction of examples in each group 0..n_groups-1 (the train split's gives the weights)."""
    g = np.asarray(g, dtype=np.int64)
    if len(g) == 0:
        raise ValueError("no examples: group proportions of an empty split are undefined")
    return np.bincount(g, minlength=n_groups).astype(np.float64) / len(g)


# ---- per-group confusion ----------------------------------------------------------------------


def confusion_matrix(y: np.ndarray, pred: np.ndarray, n_classes: int) -> np.ndarray:
    """(n_classes, n_classes) counts, rows = true class, columns = predicted class (int64)."""
    y = np.asarray(y, dtype=np.int64)
    pred = np.asarray(pred, dtype=np.int64)
    flat = np.bincount(y * n_classes + pred, minlength=n_classes * n_classes)
    return flat.reshape(n_classes, n_classes).astype(np.int64)


def group_prediction_counts(
    pred: np.ndarray, g: np.ndarray, n_groups: int, n_classes: int
) -> np.ndarray:
    """(n_groups, n_classes) counts of each predicted class within each group.

    A group holds one true class (g = y · n_attrs + a), so row g is that class's row of the
    group's confusion matrix.
    """
    g = np.asarray(g, dtype=np.int64)
    pred = np.asarray(pred, dtype=np.int64)
    flat = np.bincount(g * n_classes + pred, minlength=n_groups * n_classes)
    return flat.reshape(n_groups, n_classes).astype(np.int64)


# ---- bootstrap --------------------------------------------------------------------------------

# Resamples are drawn in chunks so memory stays O(chunk · n) whatever the resample count.
_BOOTSTRAP_CHUNK = 200


def bootstrap_indices(g: np.ndarray, resamples: int, seed: int | Sequence[int]) -> Iterator[np.ndarray]:
    """Seeded resampling stratified by group: chunks of (≤200, n) row indices.

    Every resample keeps every group's size: position i of a resample holds a row drawn
    uniformly with replacement from the n_{g_i} rows of group g_i, so `g[idx] == g` for every
    row of `idx` and no resample ever loses a (small) group. With rows ordered by group
    (`order = argsort(g, stable)`, group k occupying positions start_k .. start_k + n_k − 1),
    a chunk is `order[start[g] + rng.integers(0, n[g], size=(chunk, n))]`.

    The draws depend only on (g, resamples, seed), so anyone can redraw the same resamples.
    """
    g = np.asarray(g, dtype=np.int64)
    if g.ndim != 1 or len(g) == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-D array of groups, got shape {g.shape}")
    if g.min() < 0:
        raise ValueError(f"groups must be >= 0, got {int(g.min())}")
    order = np.argsort(g, kind="stable")
    sizes = np.bincount(g)
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    base, high = start[g], sizes[g]
    rng = np.random.default_rng(seed)
    done = 0
    while done < resamples:
        b = min(_BOOTSTRAP_CHUNK, resamples - done)
        yield order[base + rng.integers(0, high, size=(b, len(g)))]
        done += b


def item_strata(items: np.ndarray, strata: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(item index of every row, the item indices of each stratum) for a cluster bootstrap.

    `items`: (n,) any integer id per row, rows of one source item sharing it (copies of one
    image); `strata`: (n,) the stratum of every row (its class), which must be one per item.
    Items are numbered in order of their first row."""
    items = np.asarray(items, dtype=np.int64)
    strata = np.asarray(strata, dtype=np.int64)
    if items.shape != strata.shape or items.ndim != 1 or len(items) == 0:
        raise ValueError(f"items and strata must be non-empty 1-D arrays of one length, got {items.shape} and {strata.shape}")
    _, first, inverse = np.unique(items, return_index=True, return_inverse=True)
    # number items by first appearance, so the draws do not depend on the ids' values
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    row_item = rank[inverse]
    item_stratum = np.empty(len(first), np.int64)
    item_stratum[row_item] = strata
    if np.any(item_stratum[row_item] != strata):
        bad = int(np.flatnonzero(item_stratum[row_item] != strata)[0])
        raise ValueError(f"item {int(items[bad])} has rows in more than one stratum (class): a cluster bootstrap needs one per item")
    return row_item, [np.flatnonzero(item_stratum == s) for s in np.unique(item_stratum)]


def cluster_weights(
    items: np.ndarray, strata: np.ndarray, resamples: int, seed: int | Sequence[int]
) -> Iterator[np.ndarray]:
    """Seeded cluster bootstrap stratified by `strata`: chunks of (≤200, n) row multiplicities.

    A resample draws, within each stratum of K_s items, K_s items uniformly with replacement
    (`rng.integers(0, K_s, (chunk, K_s))`, strata in increasing order) and takes every row of
    each drawn item as often as it was drawn: row i's weight is its item's count. Used where a
    test item appears several times (`items`: the source image of each copy), so the copies'
    shared noise is resampled together instead of counted as independent rows."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    row_item, by_stratum = item_strata(items, strata)
    n_items = sum(len(s) for s in by_stratum)
    rng = np.random.default_rng(seed)
    done = 0
    while done < resamples:
        b = min(_BOOTSTRAP_CHUNK, resamples - done)
        counts = np.zeros((b, n_items), np.int64)
        for members in by_stratum:
            draw = members[rng.integers(0, len(members), size=(b, len(members)))]
            flat = (draw + n_items * np.arange(b)[:, None]).ravel()
            counts += np.bincount(flat, minlength=b * n_items).reshape(b, n_items)
        yield counts[:, row_item]
        done += b


def resampled_group_hits(
    correct: np.ndarray,
    g: np.ndarray,
    n_groups: int,
    resamples: int,
    seed: int | Sequence[int],
    items: np.ndarray | None = None,
    strata: np.ndarray | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Chunks of (hits (b, S, n_groups), sizes (b, n_groups)) over resamples of the examples of
    `correct` (S, n): rows stratified by group (`bootstrap_indices`) without `items`, else whole
    items stratified by `strata` (`cluster_weights`). Counts are integers (exact, in any order)."""
    c = _as_seeds(correct)
    g = np.asarray(g, dtype=np.int64)
    onehot = np.zeros((len(g), n_groups), np.float64)
    onehot[np.arange(len(g)), g] = 1.0
    per_seed = (c[:, :, None] * onehot[None]).transpose(1, 0, 2).reshape(len(g), -1)  # (n, S·G)
    if items is None:
        sizes = np.bincount(g, minlength=n_groups).astype(np.float64)
        for idx in bootstrap_indices(g, resamples, seed):
            b = len(idx)
            flat = (g[idx] + n_groups * np.arange(b)[:, None]).ravel()
            hits = np.stack([np.bincount(flat, weights=c[s][idx].ravel().astype(np.float64), minlength=b * n_groups)
                             .reshape(b, n_groups) for s in range(c.shape[0])], axis=1)
            yield hits, np.broadcast_to(sizes, (b, n_groups))
        return
    for w in cluster_weights(items, g if strata is None else strata, resamples, seed):
        wf = w.astype(np.float64)
        yield (wf @ per_seed).reshape(len(w), c.shape[0], n_groups), wf @ onehot


def metrics_from_hits(hits: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(acc, worst-group acc) per resample of `resampled_group_hits`' chunks, each the mean over
    the S seeds; a group with no example in a resample never enters the min."""
    with np.errstate(invalid="ignore", divide="ignore"):
        gacc = np.where(sizes[:, None, :] > 0, hits / sizes[:, None, :], np.inf)
    acc = (hits.sum(axis=2) / sizes.sum(axis=1)[:, None]).mean(axis=1)
    return acc, gacc.min(axis=2).mean(axis=1)


def group_accuracy_rows(correct: np.ndarray, g: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `correct` (b, n) with groups `g` (b, n): counts and accuracies (b, n_groups).

    Accuracy is NaN for a group with no example in the row.
    """
    b = correct.shape[0]
    flat = (g + n_groups * np.arange(b)[:, None]).ravel()
    n = np.bincount(flat, minlength=b * n_groups).reshape(b, n_groups)
    hits = np.bincount(flat, weights=correct.ravel().astype(np.float64), minlength=b * n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = hits.reshape(b, n_groups) / n
    return n, acc


def _seed_mean_metrics(correct: np.ndarray, g: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(acc, worst-group acc) per row of a (b, S, n) stack, each averaged over the S seeds."""
    b, s, n = correct.shape
    acc = correct.mean(axis=2).mean(axis=1)
    counts, gacc = group_accuracy_rows(correct.reshape(b * s, n), np.repeat(g, s, axis=0), n_groups)
    gacc = np.where(counts > 0, gacc, np.inf)
    wga = gacc.min(axis=1).reshape(b, s).mean(axis=1)
    return acc, wga


def _as_seeds(correct: np.ndarray) -> np.ndarray:
    c = np.asarray(correct, dtype=bool)
    return c[None, :] if c.ndim == 1 else c


def bootstrap_ci(
    correct: np.ndarray,
    g: np.ndarray,
    n_groups: int,
    resamples: int,
    seed: int | Sequence[int],
    level: float = 0.95,
    items: np.ndarray | None = None,
    strata: np.ndarray | None = None,
) -> dict[str, list[float]]:
    """Percentile bootstrap intervals for accuracy and worst-group accuracy.

    Args:
        correct: (n,) or (S, n) booleans; with S seeds of one model on the same examples,
            each resample scores the seed-mean of the metric (one resample of examples
            is shared by all seeds).
        g: (n,) groups: the resampling is stratified by them (see `bootstrap_indices`), so
            every resample holds every group of the split at its size, its worst-group
            accuracy is over the same groups as the point estimate, and its accuracy is the
            group-size-weighted mean of its group accuracies (the split's own mix).
        resamples, seed: the resampling (see `bootstrap_indices`).
        level: central coverage of the interval.
        items, strata: where a test item appears several times (copies of one image), its
            source item per row and the stratum (class) of each: whole items are resampled
            within each stratum instead (`cluster_weights`; group sizes then vary).

    Returns {"acc": [lo, hi], "worst_group_acc": [lo, hi]}.
    """
    c = _as_seeds(correct)
    g = np.asarray(g, dtype=np.int64)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if c.shape[1] != len(g):
        raise ValueError(f"correct has {c.shape[1]} examples, g has {len(g)}")
    accs, wgas = [], []
    if items is not None:
        for hits, sizes in resampled_group_hits(c, g, n_groups, resamples, seed, items, strata):
            acc, wga = metrics_from_hits(hits, sizes)
            accs.append(acc)
            wgas.append(wga)
        return {"acc": percentile_interval(np.concatenate(accs), level),
                "worst_group_acc": percentile_interval(np.concatenate(wgas), level)}
    for idx in bootstrap_indices(g, resamples, seed):
        # Stratified: g[idx] == g on every row.
        acc, wga = _seed_mean_metrics(c[:, idx].transpose(1, 0, 2), np.broadcast_to(g, idx.shape), n_groups)
        accs.append(acc)
        wgas.append(wga)
    return {
        "acc": percentile_interval(np.concatenate(accs), level),
        "worst_group_acc": percentile_interval(np.concatenate(wgas), level),
    }


def percentile_interval(values: np.ndarray, level: float) -> list[float]:
    """[lo, hi]: the (1 − level)/2 and (1 + level)/2 percentiles (numpy's linear interpolation)."""
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(values, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


def paired_bootstrap(
    correct_a: np.ndarray,
    correct_b: np.ndarray,
    g: np.ndarray,
    n_groups: int,
    resamples: int,
    seed: int | Sequence[int],
    level: float = 0.95,
    items: np.ndarray | None = None,
    strata: np.ndarray | None = None,
) -> dict[str, dict[str, Any]]:
    """Is model A better than model B on the same examples? A paired bootstrap of A − B.

    `correct_a` / `correct_b`: (n,) or (S, n) booleans on the same n examples in the same
    order (seeds averaged as in `bootstrap_ci`). Every resample of examples (stratified by
    group, `bootstrap_indices`; whole source items with `items`, as in `bootstrap_ci`) is
    scored for both models, so the per-example pairing cancels the shared difficulty of examples.

    Returns, for "acc" and "worst_group_acc": {diff, ci: [lo, hi], p_value, significant},
    with diff the point estimate A − B, ci its percentile interval, p_value the two-sided
    bootstrap p-value 2·min(P*(Δ ≤ 0), P*(Δ ≥ 0)) (capped at 1), and significant true
    exactly when the interval excludes 0.
    """
    a, b = _as_seeds(correct_a), _as_seeds(correct_b)
    g = np.asarray(g, dtype=np.int64)
    if a.shape[1] != b.shape[1] or a.shape[1] != len(g):
        raise ValueError(f"paired bootstrap needs the same examples: {a.shape[1]}, {b.shape[1]}, {len(g)}")
    point_a = _seed_mean_metrics(a[None], g[None], n_groups)
    point_b = _seed_mean_metrics(b[None], g[None], n_groups)
    diffs: dict[str, list[np.ndarray]] = {"acc": [], "worst_group_acc": []}
    if items is not None:  # whole source items resampled (`bootstrap_ci`), both models on the same draw
        both = np.concatenate([a, b])
        for hits, sizes in resampled_group_hits(both, g, n_groups, resamples, seed, items, strata):
            ma = metrics_from_hits(hits[:, : len(a)], sizes)
            mb = metrics_from_hits(hits[:, len(a) :], sizes)
            diffs["acc"].append(ma[0] - mb[0])
            diffs["worst_group_acc"].append(ma[1] - mb[1])
    for idx in bootstrap_indices(g, resamples, seed) if items is None else ():
        groups = np.broadcast_to(g, idx.shape)  # stratified: g[idx] == g
        ma = _seed_mean_metrics(a[:, idx].transpose(1, 0, 2), groups, n_groups)
        mb = _seed_mean_metrics(b[:, idx].transpose(1, 0, 2), groups, n_groups)
        diffs["acc"].append(ma[0] - mb[0])
        diffs["worst_group_acc"].append(ma[1] - mb[1])
    out: dict[str, dict[str, Any]] = {}
    for i, key in enumerate(("acc", "worst_group_acc")):
        d = np.concatenate(diffs[key])
        lo, hi = percentile_interval(d, level)
        p = min(1.0, 2.0 * min(float((d <= 0).mean()), float((d >= 0).mean())))
        out[key] = {
            "diff": float(point_a[i][0] - point_b[i][0]),
            "ci": [lo, hi],
            "p_value": p,
            "significant": bool(lo > 0 or hi < 0),
        }
    return out


# ---- exact intervals for a group's accuracy ------------------------------------------------


def clopper_pearson(hits: int, n: int, level: float = 0.95) -> list[float]:
    """The exact (Clopper–Pearson) interval [lo, hi] of a binomial proportion with `hits` of `n`.

    lo is the p at which P(X ≥ hits) = (1 − level)/2 and hi the p at which P(X ≤ hits) =
    (1 − level)/2, X ~ Binomial(n, p): the Beta quantiles lo = B⁻¹((1 − level)/2; hits,
    n − hits + 1), hi = B⁻¹((1 + level)/2; hits + 1, n − hits), with lo = 0 at hits = 0 and
    hi = 1 at hits = n. Unlike a bootstrap, it never collapses to a point: 0 of 9 correct
    gives [0, 0.336], not [0, 0]. Its coverage is at least `level` for every p.
    """
    from scipy.special import betaincinv  # the regularised incomplete Beta's inverse

    if n < 1 or not 0 <= hits <= n:
        raise ValueError(f"need 0 <= hits <= n and n >= 1, got {hits} of {n}")
    tail = (1.0 - level) / 2.0
    lo = 0.0 if hits == 0 else float(betaincinv(hits, n - hits + 1, tail))
    hi = 1.0 if hits == n else float(betaincinv(hits + 1, n - hits, 1.0 - tail))
    return [lo, hi]


def worst_group_exact(hits: np.ndarray, n: np.ndarray, level: float = 0.95) -> list[float]:
    """An exact interval for the (seed-mean) worst-group accuracy, simultaneous over groups.

    `hits`: (S, G) correct counts of S seeds of one model on the same examples; `n`: (G,)
    group sizes (groups with n = 0 are left out). Each of the S·P (P present groups)
    accuracies gets its Clopper–Pearson interval at level 1 − (1 − level)/(S·P) (Bonferroni),
    so with probability ≥ `level` all hold at once, and then, since the worst-group accuracy
    is increasing in every group's accuracy, [mean_s min_g lo_sg, mean_s min_g hi_sg] holds
    mean_s min_g p_sg — whichever group is the worst. Conservative (wider than needed), never
    a point, and free of the bootstrap's downward bias.
    """
    hits = np.atleast_2d(np.asarray(hits, dtype=np.int64))
    n = np.asarray(n, dtype=np.int64)
    present = np.flatnonzero(n > 0)
    if len(present) == 0:
        raise ValueError("no group has an example")
    each = 1.0 - (1.0 - level) / (hits.shape[0] * len(present))
    bounds = np.array([[clopper_pearson(int(row[g]), int(n[g]), each) for g in present] for row in hits])
    worst = bounds.min(axis=1)  # (S, 2): per seed, the lowest lo and the lowest hi
    return [float(worst[:, 0].mean()), float(worst[:, 1].mean())]


# ---- across seeds and across models --------------------------------------------------------


def seed_summary(values: Sequence[float]) -> dict[str, Any]:
    """{mean, sd, n} over seeds: arithmetic mean and sample sd (n − 1; None for one seed)."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("no values to summarise")
    mean = float(np.mean(v))
    sd = float(np.std(v, ddof=1)) if len(v) > 1 else None
    return {"mean": mean, "sd": sd, "n": len(v)}


# ---- effective robustness (Taori et al. 2020) ---------------------------------------------------

# Accuracies are clipped into [LOGIT_EPS, 1 − LOGIT_EPS] before the logit transform.
LOGIT_EPS = 1e-4
# (model, seed) points of the reference family the baseline needs; with fewer it is n/a.
MIN_REFERENCE_POINTS = 3


def logit(p: np.ndarray | float) -> np.ndarray:
    """log(p / (1 − p)) of accuracies clipped into [LOGIT_EPS, 1 − LOGIT_EPS]."""
    q = np.clip(np.asarray(p, dtype=np.float64), LOGIT_EPS, 1.0 - LOGIT_EPS)
    return np.log(q) - np.log1p(-q)


def sigmoid(z: np.ndarray | float) -> np.ndarray:
    """1 / (1 + exp(−z)), the inverse of `logit` (stable for any finite z)."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(z, dtype=np.float64)))


def logit_fit(id_acc: Sequence[float], ood_acc: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares line logit(ood) = intercept + slope · logit(id); None if fewer than two
    points are given or the ID accuracies are all equal (after clipping)."""
    x = logit(np.asarray(id_acc, dtype=np.float64))
    y = logit(np.asarray(ood_acc, dtype=np.float64))
    if len(x) != len(y):
        raise ValueError(f"{len(x)} ID accuracies but {len(y)} OOD accuracies")
    if len(x) < 2 or np.ptp(x) < 1e-12:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


@dataclass(frozen=True)
class RobustnessBaseline:
    """The baseline of effective robustness: the line logit(OOD acc) = intercept + slope ·
    logit(ID acc) fitted (`logit_fit`) on the (model, seed) points of a reference family.

    `fit` is None, and effective robustness n/a, when there are fewer than
    MIN_REFERENCE_POINTS points or their ID accuracies are all equal; `reason` says which.
    """

    n_points: int
    fit: tuple[float, float] | None
    reason: str | None = None

    def predict(self, id_acc: np.ndarray | float) -> np.ndarray:
        """The OOD accuracy the baseline expects at `id_acc`: sigmoid(intercept + slope · logit(id))."""
        if self.fit is None:
            raise ValueError(f"no baseline: {self.reason}")
        return sigmoid(self.fit[0] + self.fit[1] * logit(id_acc))

    def effective_robustness(self, id_acc: float, ood_acc: float) -> float | None:
        """OOD accuracy minus the baseline's prediction at the ID accuracy (None without a fit)."""
        if self.fit is None:
            return None
        return float(ood_acc) - float(self.predict(float(id_acc)))


def robustness_baseline(ref_id_acc: Sequence[float], ref_ood_acc: Sequence[float]) -> RobustnessBaseline:
    """The effective-robustness baseline fitted on a reference family's (ID, OOD) accuracies,
    one pair per (model, seed) — Taori et al. 2020, "Measuring Robustness to Natural Distribution
    Shifts in Image Classification", who fit this line on logit-scaled axes over standard models
    trained without a robustness intervention."""
    ids = [float(v) for v in ref_id_acc]
    oods = [float(v) for v in ref_ood_acc]
    if len(ids) != len(oods):
        raise ValueError(f"{len(ids)} ID accuracies but {len(oods)} OOD accuracies")
    n = len(ids)
    if n < MIN_REFERENCE_POINTS:
        return RobustnessBaseline(n, None, f"{n} reference point{'' if n == 1 else 's'}, needs {MIN_REFERENCE_POINTS}")
    fit = logit_fit(ids, oods)
    if fit is None:
        return RobustnessBaseline(n, None, f"the {n} reference points share one ID accuracy (no line to fit)")
    return RobustnessBaseline(n, fit)


def robustness_bootstrap(
    id_correct: np.ndarray,
    ood_correct: np.ndarray,
    g_id: np.ndarray,
    g_ood: np.ndarray,
    reference: Sequence[int],
    models: Sequence[Sequence[int]],
    resamples: int,
    seed: Sequence[int],
    level: float = 0.95,
) -> tuple[list[list[float] | None], int]:
    """Percentile intervals of each model's effective robustness, resampling the reference
    points and the test examples.

    `id_correct` (P, n_id) / `ood_correct` (P, n_ood): correctness of every (model, seed) run
    on the same test_id / test_ood examples; `reference`: the rows of the reference family's
    runs (the baseline's points); `models`: per model, its rows. One resample: the reference
    rows drawn with replacement (`numpy.random.default_rng([*seed, 0])`), the examples of each
    split resampled within each group (`bootstrap_indices`, streams `[*seed, 1]` for test_id and
    `[*seed, 2]` for test_ood, shared by every run), every run's two accuracies recomputed,
    the logit line refitted by least squares through the drawn reference points, and each
    model's effective robustness = the mean over its runs of OOD acc − the line at its ID acc.
    A resample whose drawn points share one ID accuracy has no line and is left out.

    Returns (per model [lo, hi] or None when every resample was left out, resamples left out).
    """
    ref = np.asarray(reference, dtype=np.int64)
    if not models:
        return [], 0
    if len(ref) < MIN_REFERENCE_POINTS:
        raise ValueError(f"{len(ref)} reference points, needs {MIN_REFERENCE_POINTS}")
    draws = np.random.default_rng([*seed, 0]).integers(0, len(ref), size=(resamples, len(ref)))
    ids = bootstrap_indices(g_id, resamples, [*seed, 1])
    oods = bootstrap_indices(g_ood, resamples, [*seed, 2])
    values: list[np.ndarray] = []
    done = 0
    for idx_id, idx_ood in zip(ids, oods, strict=True):
        b = len(idx_id)
        acc_id = id_correct[:, idx_id].mean(axis=2)  # (P, b)
        acc_ood = ood_correct[:, idx_ood].mean(axis=2)
        rows = ref[draws[done : done + b]]  # (b, k)
        cols = np.arange(b)[:, None]
        x, y = logit(acc_id[rows, cols]), logit(acc_ood[rows, cols])
        xc = x - x.mean(axis=1, keepdims=True)
        sxx = (xc * xc).sum(axis=1)
        ok = np.ptp(x, axis=1) >= 1e-12  # as `logit_fit`: no line through one ID accuracy
        slope = np.where(ok, (xc * (y - y.mean(axis=1, keepdims=True))).sum(axis=1) / np.where(ok, sxx, 1.0), np.nan)
        intercept = y.mean(axis=1) - slope * x.mean(axis=1)
        with np.errstate(invalid="ignore"):  # NaN: the resamples with no line, left out below
            er = acc_ood - sigmoid(intercept[None, :] + slope[None, :] * logit(acc_id))  # (P, b)
        values.append(np.stack([er[list(m)].mean(axis=0) for m in models]))
        done += b
    every = np.concatenate(values, axis=1)  # (models, resamples)
    kept = ~np.isnan(every[0]) if len(models) else np.ones(resamples, dtype=bool)
    out = [percentile_interval(v[kept], level) if kept.any() else None for v in every]
    return out, int((~kept).sum())
