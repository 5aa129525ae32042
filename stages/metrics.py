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
) -> dict[str, Any]:
    """Every metric of one split, as JSON-ready Python values (see docs/metrics.md).

    Args:
        logits: (n, n_classes) scores; only their argmax and softmax are used.
        y, g: int labels and groups (g = y * n_attrs + a), shape (n,).
        n_groups: n_classes * n_attrs; `groups` lists every one of them.
        train_group_props: (n_groups,) fraction of the *train* split in each group,
            the weights of `avg_acc_weighted`.
        ece_bins: number of equal-width confidence bins.

    Returns a dict with n, acc, worst_group_acc, avg_acc_weighted, balanced_acc, ece, nll,
    brier, groups {str(g): {n, acc}} and reliability (per-bin list).
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
    bins = reliability(confidence, correct, ece_bins)
    return {
        "n": int(n),
        "acc": float(correct.mean()),
        "worst_group_acc": float(group_acc[present].min()),
        "avg_acc_weighted": weighted_group_accuracy(group_acc, group_n, weights),
        "balanced_acc": balanced_accuracy(correct, y, k),
        "ece": expected_calibration_error(bins),
        "nll": float(-logp[rows, y].mean()),
        "brier": float(((p - onehot) ** 2).sum(axis=1).mean()),
        "groups": {
            str(i): {"n": int(group_n[i]), "acc": float(group_acc[i]) if present[i] else None}
            for i in range(n_groups)
        },
        "reliability": bins,
    }


def group_proportions(g: np.ndarray, n_groups: int) -> np.ndarray:
    """Fraction of examples in each group 0..n_groups-1 (the train split's gives the weights)."""
    g = np.asarray(g, dtype=np.int64)
    if len(g) == 0:
        raise ValueError("no examples: group proportions of an empty split are undefined")
    return np.bincount(g, minlength=n_groups).astype(np.float64) / len(g)
