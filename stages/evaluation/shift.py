"""Accuracy along a shift axis: from the training label–attribute agreement to fully reversed.

A single `test_ood` number is one point of a curve. This module draws the curve two ways:

- **reweight** (any dataset, from a predictions file): the test examples of `test_id` and
  `test_ood` are pooled and re-weighted so that, at step t ∈ [0, 1], each class y keeps its
  training prior π_y and its agreement rate P(a = y | y) moves linearly from the training
  value ρ_y to the fully reversed value (0, or 1 when training agreement is below one half):

      ρ_y(t) = (1 − t) ρ_y + t ρ_end,     mass(y, agree) = π_y ρ_y(t),
      mass(y, disagree) = π_y (1 − ρ_y(t)),

  split over the groups of a (class, agreement) cell in proportion to their pooled counts.
  Accuracy at t is Σ_g mass_g acc_g (pooled group accuracies); worst-group accuracy is the
  lowest acc_g over the groups with mass > 0. At t = 0 the masses are the training group
  proportions, so the first point is the expected accuracy under the training distribution
  (what `test_id` estimates); at t = 1 it is the prior-weighted accuracy on the examples
  whose attribute disagrees with the label. Intervals: percentile bootstrap over the pooled
  examples, stratified by group (seeded; `stages.evaluation.metrics.bootstrap_indices`), every step
  scored on the same resamples.
- **regenerate** (a generated dataset whose kind registers a `regenerate` route,
  stages/core/registry.py): fresh examples are drawn from the dataset's own generator at each
  step's agreement rate and scored by the model.

Both estimate the same population curve; tests/test_shift.py checks that they agree.
Group accuracies do not change along the axis — only their mix does — so worst-group
accuracy stays flat between the endpoints (it changes where a group's mass reaches 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.evaluation.metrics import bootstrap_indices, group_accuracy_rows, percentile_interval

# Stream index of the regenerate route's draws, kept apart from the generator's split streams.
REGENERATE_STREAM = 1000

# The two routes' names in evaluate's plot rows and the report. (The first shares its word
# with the `reweight` method kind; the route reweights test examples, not training losses.)
REWEIGHT_ROUTE = "reweight"
REGENERATE_ROUTE = "regenerate"


def agrees(y: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Whether each example's attribute agrees with its label (a == y)."""
    return np.asarray(a, dtype=np.int64) == np.asarray(y, dtype=np.int64)


@dataclass(frozen=True)
class ShiftAxis:
    """The axis: per-class training prior and agreement, the reversed end, and the steps."""

    class_prior: tuple[float, ...]
    start_agreement: tuple[float, ...]
    end_agreement: float
    steps: int

    @property
    def ts(self) -> np.ndarray:
        """Step positions t_k = k / (steps − 1), from 0 (training mix) to 1 (fully reversed)."""
        return np.linspace(0.0, 1.0, self.steps)

    def class_agreement(self, t: float) -> np.ndarray:
        """ρ_y(t) for every class."""
        return (1.0 - t) * np.asarray(self.start_agreement) + t * self.end_agreement

    def rho(self, t: float) -> float:
        """Overall agreement P(a = y) at step t: Σ_y π_y ρ_y(t)."""
        return float(np.dot(self.class_prior, self.class_agreement(t)))


def shift_axis(y_train: np.ndarray, a_train: np.ndarray, n_classes: int, steps: int) -> ShiftAxis:
    """The axis of a dataset from its train split's labels and attributes.

    A class absent from train gets prior 0 (and agreement 0, which then does not matter).
    """
    if steps < 2:
        raise ValueError(f"a shift curve needs >= 2 steps, got {steps}")
    y = np.asarray(y_train, dtype=np.int64)
    if len(y) == 0:
        raise ValueError("the train split is empty: no training agreement to start from")
    n = np.bincount(y, minlength=n_classes).astype(np.float64)
    agree = np.bincount(y, weights=agrees(y, a_train).astype(np.float64), minlength=n_classes)
    rho_y = np.where(n > 0, agree / np.maximum(n, 1), 0.0)
    prior = n / n.sum()
    overall = float(np.dot(prior, rho_y))
    return ShiftAxis(
        class_prior=tuple(float(v) for v in prior),
        start_agreement=tuple(float(v) for v in rho_y),
        end_agreement=0.0 if overall >= 0.5 else 1.0,
        steps=int(steps),
    )


def _cell_masses(axis: ShiftAxis, n_attrs: int, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, G) mass of each group's (class, agreement) cell at every step, and cell ids (G,)."""
    gy = np.arange(n_groups) // n_attrs
    ga = np.arange(n_groups) % n_attrs
    agree = ga == gy
    cell = gy * 2 + agree.astype(np.int64)
    prior = np.asarray(axis.class_prior)[gy]
    masses = np.stack(
        [
            prior * np.where(agree, axis.class_agreement(t)[gy], 1.0 - axis.class_agreement(t)[gy])
            for t in axis.ts
        ]
    )
    return masses, cell


def _curves(
    counts: np.ndarray, gacc: np.ndarray, cell_mass: np.ndarray, cell: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and worst-group accuracy (R, T) from group counts/accuracies (R, G).

    NaN where a cell with positive mass has no examples.
    """
    n_cells = int(cell.max()) + 1
    cell_n = np.stack([counts[:, cell == c].sum(axis=1) for c in range(n_cells)], axis=1)  # (R, C)
    per_group_cell_n = cell_n[:, cell]  # (R, G)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(per_group_cell_n > 0, counts / np.maximum(per_group_cell_n, 1), 0.0)
    mass = cell_mass[None, :, :] * share[:, None, :]  # (R, T, G)
    safe_acc = np.where(counts > 0, gacc, 0.0)
    acc = (mass * safe_acc[:, None, :]).sum(axis=2)
    live = mass > 0
    wga = np.where(live, safe_acc[:, None, :], np.inf).min(axis=2)
    # A cell that should carry mass but has no examples leaves the curve undefined.
    empty = (cell_mass[None, :, :] > 0) & (per_group_cell_n[:, None, :] == 0)
    undefined = empty.any(axis=2)
    acc = np.where(undefined, np.nan, acc)
    wga = np.where(undefined | ~live.any(axis=2), np.nan, wga)
    return acc, wga


def _seed_curves(
    correct: np.ndarray, g: np.ndarray, n_groups: int, cell_mass: np.ndarray, cell: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Seed-mean curves for a (R, S, n) stack of correctness with groups (R, n)."""
    r, s, n = correct.shape
    counts, gacc = group_accuracy_rows(correct.reshape(r * s, n), np.repeat(g, s, axis=0), n_groups)
    acc, wga = _curves(counts, gacc, cell_mass, cell)
    return acc.reshape(r, s, -1).mean(axis=1), wga.reshape(r, s, -1).mean(axis=1)


def _num(v: float) -> float | None:
    return None if not np.isfinite(v) else float(v)


def reweighted_curve(
    correct: np.ndarray,
    y: np.ndarray,
    a: np.ndarray,
    axis: ShiftAxis,
    n_attrs: int,
    resamples: int,
    seed: int | Sequence[int],
    level: float = 0.95,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The reweight route on pooled test examples (see the module docstring).

    Args:
        correct: (n,) or (S, n) booleans (S seeds of one model, seed-averaged).
        y, a: labels and attributes of the n pooled examples.
        axis: from `shift_axis` on the train split.
        resamples, seed: bootstrap; 0 resamples gives no intervals (lo/hi None).

    Returns (rows, summary): one row per step {step, t, rho, acc, acc_lo, acc_hi,
    worst_group_acc, worst_group_acc_lo, worst_group_acc_hi}; summary {rho_start, rho_end,
    acc_start, acc_end, gap, gap_ci} where gap = acc_start − acc_end is how much accuracy
    the model loses when the shortcut reverses (its reliance on the shortcut).
    """
    c = np.asarray(correct, dtype=bool)
    c = c[None, :] if c.ndim == 1 else c
    y = np.asarray(y, dtype=np.int64)
    n_classes = len(axis.class_prior)
    n_groups = n_classes * n_attrs
    g = y * n_attrs + np.asarray(a, dtype=np.int64)
    if c.shape[1] != len(y):
        raise ValueError(f"correct has {c.shape[1]} examples, y has {len(y)}")
    cell_mass, cell = _cell_masses(axis, n_attrs, n_groups)
    acc, wga = _seed_curves(c[None], g[None], n_groups, cell_mass, cell)
    acc, wga = acc[0], wga[0]
    boot_acc, boot_wga = [], []
    if resamples > 0:
        for idx in bootstrap_indices(g, resamples, seed):  # stratified by group: g[idx] == g
            ra, rw = _seed_curves(c[:, idx].transpose(1, 0, 2), np.broadcast_to(g, idx.shape), n_groups, cell_mass, cell)
            boot_acc.append(ra)
            boot_wga.append(rw)
    bands: dict[str, np.ndarray] = {}
    if boot_acc:
        bands = {"acc": np.concatenate(boot_acc), "worst_group_acc": np.concatenate(boot_wga)}

    def interval(key: str, k: int) -> list[float | None]:
        if key not in bands:
            return [None, None]
        col = bands[key][:, k]
        col = col[np.isfinite(col)]
        return [None, None] if len(col) == 0 else percentile_interval(col, level)  # type: ignore[return-value]

    rows = []
    for k, t in enumerate(axis.ts):
        acc_ci, wga_ci = interval("acc", k), interval("worst_group_acc", k)
        rows.append(
            {
                "step": k,
                "t": float(t),
                "rho": axis.rho(float(t)),
                "acc": _num(acc[k]),
                "acc_lo": acc_ci[0],
                "acc_hi": acc_ci[1],
                "worst_group_acc": _num(wga[k]),
                "worst_group_acc_lo": wga_ci[0],
                "worst_group_acc_hi": wga_ci[1],
            }
        )
    gap_ci: list[float | None] = [None, None]
    if bands:
        d = bands["acc"][:, 0] - bands["acc"][:, -1]
        d = d[np.isfinite(d)]
        if len(d):
            gap_ci = percentile_interval(d, level)  # type: ignore[assignment]
    summary = {
        "rho_start": axis.rho(0.0),
        "rho_end": axis.rho(1.0),
        "acc_start": _num(acc[0]),
        "acc_end": _num(acc[-1]),
        "gap": _num(acc[0] - acc[-1]),
        "gap_ci": gap_ci,
    }
    return rows, summary


def regenerated_curve(
    cfg: Any,
    logits_fn: Callable[[np.ndarray], np.ndarray],
    rhos: Sequence[float],
    n: int,
    n_attrs: int = 2,
) -> list[dict[str, Any]]:
    """The regenerate route: n fresh examples per agreement rate from generator config `cfg`.

    The draws come from the `regenerate(cfg, n, rho, rng) -> (y, a, x)` route that `cfg.kind`
    registered (stages/core/registry.py); step k uses `default_rng([cfg.seed, REGENERATE_STREAM, k])`,
    so the draws are reproducible and independent of the stored splits. Returns one row per
    step {step, rho, n, acc, worst_group_acc} (worst group over the groups present in the draw).
    """
    from stages.core import registry
    regenerate = registry.dataset(cfg.kind).regenerate
    if regenerate is None:
        raise ValueError(f"dataset kind '{cfg.kind}' has no regenerate route (use the reweight route)")
    rows = []
    for k, rho in enumerate(rhos):
        y, a, x = regenerate(cfg, n, float(rho), np.random.default_rng([cfg.seed, REGENERATE_STREAM, k]))
        logits = np.asarray(logits_fn(x))
        correct = logits.argmax(axis=1) == y
        n_groups = logits.shape[1] * n_attrs
        counts, gacc = group_accuracy_rows(correct[None], (y * n_attrs + a)[None], n_groups)
        wga = float(np.where(counts[0] > 0, gacc[0], np.inf).min())
        rows.append({"step": k, "rho": float(rho), "n": int(n), "acc": float(correct.mean()), "worst_group_acc": wga})
    return rows
