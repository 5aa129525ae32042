"""The shortcut-robust baselines' own pieces, and the selection record every method shares.

    reweight  cross-entropy with per-example weights ∝ 1 / frequency of the example's class
              or group in train (`balanced_weights`, `weighted_cross_entropy`)
    jtt       Just Train Twice (Liu et al. 2021): a short ERM run identifies the train
              examples it gets wrong (`identify_errors`); a fresh model of the same
              backbone is retrained with those examples' weight multiplied by λ
              (`jtt_weights`, `weighted_cross_entropy`)
    dfr       Deep Feature Reweighting (Kirichenko et al. 2023): logistic regression on
              frozen embeddings, fitted on a group-balanced half of the validation split,
              its inverse regularisation strength C chosen on the other half
              (`fit_dfr`, `dfr_classifier`)

Per-example weights are normalised to mean 1 over train, so a weighted loss has the scale of
plain cross-entropy and the same learning rate suits every method.

`selection_summary` turns a training history into the epoch (and its metrics) each named
criterion — val_avg, val_worst_group, oracle — would pick, so every model's config.json
reports all three while only the configured one chose the saved weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from stages.models.training import (
    SELECTION_METRIC,
    Batch,
    FitOptions,
    SplitData,
    cross_entropy,
    fit_classifier,
)

if TYPE_CHECKING:
    from stages.models.nets import MLPClassifier, MLPEncoder, Standardize


# ---- weighted losses (reweight, jtt) ---------------------------------------------------------


def weighted_cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """mean_i w_i · CE(logits_i, y_i) with the per-example weights in the batch under "w"."""
    losses = F.cross_entropy(logits, batch["y"], reduction="none")
    return (losses * batch["w"].to(losses.dtype)).mean()


def normalised(weights: torch.Tensor) -> torch.Tensor:
    """`weights` (float32) scaled to mean 1."""
    w = weights.double()
    return (w * (len(w) / w.sum())).float()


def balanced_weights(labels: torch.Tensor, n_values: int) -> torch.Tensor:
    """Per-example weights ∝ 1 / count of the example's label (class or group) in `labels`.

    Every value present then carries the same total weight; weights have mean 1.
    """
    counts = torch.bincount(labels, minlength=n_values).double()
    if len(counts) > n_values:
        raise ValueError(f"labels go up to {int(labels.max())} but there are {n_values} values")
    return normalised(1.0 / counts[labels])


def jtt_weights(errors: torch.Tensor, upweight: float) -> torch.Tensor:
    """Weight λ = `upweight` for the identified errors, 1 for the rest, then scaled to mean 1."""
    return normalised(torch.where(errors, float(upweight), 1.0).double())


@torch.no_grad()
def misclassified(model: torch.nn.Module, split: SplitData, batch_size: int = 4096) -> torch.Tensor:
    """Boolean mask of the examples of `split` that `model` (in eval mode) gets wrong."""
    was_training = model.training
    model.eval()
    try:
        pred = torch.cat([model(split.x[i : i + batch_size]).argmax(1) for i in range(0, len(split), batch_size)])
    finally:
        model.train(was_training)
    return pred != split.y


@dataclass
class Identification:
    """JTT's first run: which train examples its ERM model got wrong, and a summary for config.json."""

    errors: torch.Tensor
    summary: dict[str, Any] = field(default_factory=dict)


def identify_errors(
    model: torch.nn.Module,
    splits: Mapping[str, SplitData],
    opts: FitOptions,
    id_epochs: int,
    generator: torch.Generator,
    n_groups: int,
    desc: str = "jtt identify",
) -> Identification:
    """Train `model` with plain cross-entropy for `id_epochs` epochs; its last-epoch errors on train.

    JTT uses the identification model as it stands after `id_epochs` epochs (no checkpoint
    selection). The summary has the error-set size, its share of train and its group counts.
    """
    id_opts = FitOptions(opts.lr, id_epochs, opts.batch_size, opts.selection, opts.weight_decay)
    fit_classifier(model, splits, cross_entropy, id_opts, generator, desc=desc)  # model keeps its last epoch
    train = splits["train"]
    errors = misclassified(model, train)
    by_group = torch.bincount(train.g[errors], minlength=n_groups).tolist()
    summary = {
        "id_epochs": id_epochs,
        "n_errors": int(errors.sum()),
        "n_train": len(train),
        "error_rate": float(errors.double().mean()),
        "errors_by_group": {str(g): int(n) for g, n in enumerate(by_group)},
    }
    return Identification(errors, summary)


# ---- DFR -------------------------------------------------------------------------------------


def halves(g: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices into (fit, tune) halves stratified by group: per group, a seeded
    permutation gives the first ceil(n/2) rows to fit and the rest to tune. Sorted indices."""
    fit, tune = [], []
    for value in np.unique(g):
        idx = rng.permutation(np.flatnonzero(g == value))
        cut = (len(idx) + 1) // 2
        fit.append(idx[:cut])
        tune.append(idx[cut:])
    return np.sort(np.concatenate(fit)), np.sort(np.concatenate(tune))


def balanced_subsample(g: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices of a group-balanced subset: every group present, down-sampled to the smallest."""
    values, counts = np.unique(g, return_counts=True)
    m = int(counts.min())
    return np.sort(np.concatenate([rng.choice(np.flatnonzero(g == v), m, replace=False) for v in values]))


def logistic_regression(
    z: np.ndarray, y: np.ndarray, n_classes: int, c: float, sample_weight: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """L2-regularised logistic regression, fitted exactly by Newton's method (float64).

    Minimises C·Σ_i s_i·CE_i + ½‖W‖² (s = `sample_weight`, default 1; the bias is not
    penalised) — scikit-learn's LogisticRegression objective: two classes use one score
    s = w·z + b (binary logistic), more classes a softmax over K rows. Returns (weight (K, d),
    bias (K,)) whose softmax is the fitted p(y | z); a binary score becomes the rows
    (−s/2, +s/2). Every class must occur in `y`. Deterministic (CPU torch, float64).
    """
    present = np.unique(y)
    if list(present) != list(range(n_classes)):
        raise ValueError(f"DFR fit set has classes {present.tolist()}, needs all of 0..{n_classes - 1}")
    n, d = np.shape(z)
    x = torch.cat([torch.as_tensor(np.asarray(z), dtype=torch.float64), torch.ones(n, 1, dtype=torch.float64)], 1)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64)
    s = torch.ones(n, dtype=torch.float64) if sample_weight is None else torch.as_tensor(sample_weight, dtype=torch.float64)
    total = float(s.sum())
    s, lam = s * (float(c) / total), 1.0 / total  # the objective / Σs: same minimiser, scale-free tolerances
    rows = 1 if n_classes == 2 else n_classes
    penalty = torch.full((d + 1,), lam, dtype=torch.float64)
    penalty[d] = 0.0  # the bias is not penalised
    onehot = yt.double()[:, None] if rows == 1 else F.one_hot(yt, rows).double()

    def value_grad_hess(theta: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        scores = x @ theta.T  # (n, rows)
        if rows == 1:
            losses = F.binary_cross_entropy_with_logits(scores[:, 0], onehot[:, 0], reduction="none")
            p = torch.sigmoid(scores)
        else:
            losses = -(F.log_softmax(scores, 1) * onehot).sum(1)
            p = torch.softmax(scores, 1)
        value = float((s * losses).sum() + 0.5 * (penalty * theta * theta).sum())
        grad = ((s[:, None] * (p - onehot)).T @ x + penalty * theta).reshape(-1)
        if rows == 1:
            hess = (x * (s * p[:, 0] * (1 - p[:, 0]))[:, None]).T @ x
        else:
            # H[(k,i),(l,j)] = Σ_n s_n p_nk (δ_kl − p_nl) x_ni x_nj
            cov = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # (n, K, K)
            hess = torch.einsum("nkl,ni,nj->kilj", cov * s[:, None, None], x, x).reshape(rows * (d + 1), -1)
        hess = hess + torch.diag(penalty.repeat(rows)) + 1e-12 * torch.eye(rows * (d + 1), dtype=torch.float64)
        return value, grad, hess

    theta = torch.zeros(rows, d + 1, dtype=torch.float64)
    for _ in range(200):
        value, grad, hess = value_grad_hess(theta)
        if float(grad.abs().max()) < 1e-12:
            break
        step = torch.linalg.solve(hess, grad).reshape(rows, d + 1)
        t, decrease = 1.0, float(grad @ step.reshape(-1))
        while t > 1e-10 and value_grad_hess(theta - t * step)[0] > value - 1e-4 * t * decrease:
            t *= 0.5
        theta = theta - t * step
        if t * float(step.abs().max()) < 1e-14:
            break
    weight, bias = theta[:, :d].numpy().copy(), theta[:, d].numpy().copy()
    if rows == 1:
        weight, bias = np.concatenate([-weight / 2, weight / 2]), np.array([-bias[0] / 2, bias[0] / 2])
    return weight, bias


def group_scores(logits: np.ndarray, y: np.ndarray, g: np.ndarray) -> dict[str, float]:
    """Accuracy and worst-group accuracy (over the groups present) of logits."""
    correct = logits.argmax(1) == y
    wga = min(float(correct[g == v].mean()) for v in np.unique(g))
    return {"acc": float(correct.mean()), "worst_group_acc": wga}


@dataclass
class Embedded:
    """A split's embeddings with labels and groups (numpy)."""

    z: np.ndarray
    y: np.ndarray
    g: np.ndarray


@dataclass
class DFRCandidate:
    """One value of C: its head (on raw embeddings) and its scores on the tune half."""

    c: float
    weight: np.ndarray
    bias: np.ndarray
    tune: dict[str, float]


@dataclass
class DFRResult:
    """The chosen head and everything config.json records about the fit."""

    weight: np.ndarray
    bias: np.ndarray
    c: float
    candidates: list[DFRCandidate]
    summary: dict[str, Any]


# The tune-half score each criterion maximises over C (oracle: test_ood worst-group).
DFR_CRITERIA = {"val_avg": "acc", "val_worst_group": "worst_group_acc", "oracle": "worst_group_acc"}


def fit_dfr(
    val: Embedded,
    n_classes: int,
    c_grid: Sequence[float],
    n_fits: int,
    selection: str,
    seed: int,
    oracle: Embedded | None = None,
    balance: str = "subsample",
) -> DFRResult:
    """DFR on validation embeddings only (plus test_ood embeddings when `selection` is oracle).

    val is split into halves stratified by group (`halves`). For each C in `c_grid`
    (ascending), logistic regressions are fitted on the fit half's embeddings, standardised
    with the fit half's mean and std, balanced over groups either by `balance="subsample"`
    (as in the DFR paper: `n_fits` independent group-balanced subsamples, `balanced_subsample`,
    whose heads are averaged) or by `balance="weight"` (one fit on the whole fit half with
    sample weights ∝ 1 / group count, so each group weighs the same). The C whose head scores best on the
    tune half (selection val_worst_group: worst-group accuracy; val_avg: accuracy; oracle:
    test_ood worst-group accuracy) wins; ties go to the smaller C (stronger regularisation).
    The returned head acts on raw embeddings (the standardisation is folded in).
    """
    if selection not in DFR_CRITERIA:
        raise ValueError(f"unknown selection '{selection}'")
    if selection == "oracle" and oracle is None:
        raise ValueError("selection 'oracle' needs the test_ood embeddings")
    if balance not in ("subsample", "weight"):
        raise ValueError(f"unknown balance '{balance}'")
    rng = np.random.default_rng(seed)
    fit_idx, tune_idx = halves(val.g, rng)
    g_fit, y_fit = val.g[fit_idx], val.y[fit_idx]
    if balance == "subsample":
        subsets = [(balanced_subsample(g_fit, rng), None) for _ in range(n_fits)]
    else:
        values, inverse, counts = np.unique(g_fit, return_inverse=True, return_counts=True)
        weight = len(g_fit) / (len(values) * counts[inverse])  # mean 1, equal total per group
        subsets = [(np.arange(len(fit_idx)), weight)]
    z_fit = val.z[fit_idx].astype(np.float64)
    mean = z_fit.mean(0)
    std = z_fit.std(0)
    std = np.where(std < 1e-6, 1.0, std)
    candidates = []
    for c in sorted(float(c) for c in c_grid):
        heads = [logistic_regression((z_fit[s] - mean) / std, y_fit[s], n_classes, c, w) for s, w in subsets]
        w = np.mean([h[0] for h in heads], axis=0) / std  # fold the standardisation in
        b = np.mean([h[1] for h in heads], axis=0) - w @ mean
        tune = group_scores(val.z[tune_idx] @ w.T + b, val.y[tune_idx], val.g[tune_idx])
        if oracle is not None and selection == "oracle":
            tune["oracle"] = group_scores(oracle.z @ w.T + b, oracle.y, oracle.g)["worst_group_acc"]
        candidates.append(DFRCandidate(c, w, b, tune))
    key = "oracle" if selection == "oracle" else DFR_CRITERIA[selection]
    best = max(candidates, key=lambda cand: cand.tune[key])  # max keeps the first (smallest C) of ties
    summary = {
        "c": best.c,
        "n_val_fit": int(len(fit_idx)),
        "n_val_tune": int(len(tune_idx)),
        "balance": balance,
        "n_fit_rows": int(len(subsets[0][0])),
        "n_fits": len(subsets),
        "tuned_on": "test_ood" if selection == "oracle" else "val (tune half)",
        "grid": [{"c": cand.c, **{f"tune_{k}": v for k, v in cand.tune.items()}} for cand in candidates],
    }
    return DFRResult(best.weight, best.bias, best.c, candidates, summary)


def dfr_classifier(standardize: Standardize, encoder: MLPEncoder, weight: np.ndarray, bias: np.ndarray) -> MLPClassifier:
    """The frozen encoder with the DFR head: an ordinary MLPClassifier mapping raw x to logits."""
    from stages.models.nets import MLPClassifier

    model = MLPClassifier(encoder, len(bias), standardize)
    with torch.no_grad():
        model.head.weight.copy_(torch.from_numpy(weight).float())
        model.head.bias.copy_(torch.from_numpy(bias).float())
    return model.eval()


# ---- selection record ------------------------------------------------------------------------


def selection_summary(history: pa.Table) -> dict[str, dict[str, Any]]:
    """For each criterion whose split is in `history`, the epoch it picks and that epoch's metrics.

    Ties go to the earlier epoch, as in `training.fit_classifier`. Only the configured
    criterion chose the saved weights; the others (oracle above all) are for the report.
    """
    rows = history.to_pylist()
    out: dict[str, dict[str, Any]] = {}
    for criterion, (split, metric) in SELECTION_METRIC.items():
        candidates = [r for r in rows if r["split"] == split]
        if not candidates:
            continue
        best = max(candidates, key=lambda r: (r[metric], -r["epoch"]))
        epoch = best["epoch"]
        out[criterion] = {
            "epoch": epoch,
            "metrics": {
                r["split"]: {"acc": r["acc"], "worst_group_acc": r["worst_group_acc"]} for r in rows if r["epoch"] == epoch
            },
        }
    return out
