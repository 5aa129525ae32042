"""A model's training history and what is read from it: the selection rules, the record of
what each would have picked, and the under-training check.

History (`artifacts.HISTORY_SCHEMA`, one row per epoch and split; stages/models/training.py
writes it): `loss`, `acc`, `worst_group_acc` where the split was scored, `objective` (the
training objective) on train and val every epoch. A checkpoint is chosen by a named criterion
(`SELECTION_METRIC`); `selection_summary` records what every criterion would have picked, so
each model's config.json reports all three while only the configured one chose the saved
weights; `convergence` turns the val objective curve into the under-training and over-fitting
flags (a plateau test with a stated false-alarm rate, docs/metrics.md), and `plateau_stop` is the
same test as a stopping rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from stages.core.artifacts import HISTORY_SCHEMA, SPLITS

SELECTION_METRIC: dict[str, tuple[str, str]] = {
    "val_avg": ("val", "acc"),
    "val_worst_group": ("val", "worst_group_acc"),
    "oracle": ("test_ood", "worst_group_acc"),
}


HISTORY_METRICS = ("loss", "acc", "worst_group_acc")
"""The history columns an epoch has only where the split was scored (null elsewhere)."""


def history_table(rows: list[dict[str, Any]]) -> pa.Table:
    """History rows (epoch, split, loss, acc, worst_group_acc, objective) as a HISTORY_SCHEMA table."""
    return pa.Table.from_pylist(rows, schema=HISTORY_SCHEMA)


def history_rows(
    epoch: int, metrics: Mapping[str, Mapping[str, float]], objective: Mapping[str, float | None] | None = None
) -> list[dict[str, Any]]:
    """One row per split scored (`metrics`) or with an objective value, in SPLITS order (then any
    other split in the order given); a column a split lacks is null."""
    objective = objective or {}
    given = list(dict.fromkeys([*metrics, *objective]))
    names = [n for n in SPLITS if n in given] + [n for n in given if n not in SPLITS]
    return [
        {"epoch": epoch, "split": name, **dict.fromkeys(HISTORY_METRICS), **metrics.get(name, {}),
         "objective": objective.get(name)}
        for name in names
    ]


# ---- convergence -----------------------------------------------------------------------------

PLATEAU_WINDOW = 0.25
"""The plateau test's window: the last quarter of the epochs run (rounded up) ..."""
PLATEAU_MIN_EPOCHS = 8
"""... and at least 8 epochs (a slope's t-test on fewer points has little power at this level);
a run of fewer epochs is not judged ("n/a")."""
PLATEAU_ALPHA = 0.01
"""One-sided level of each slope test: on a flat val objective with independent Gaussian noise the
under-training flag fires with probability at most 1 % (the over-fitting flag likewise); noise
correlated from epoch to epoch raises it (AR(1) with lag-1 correlation 0.5: 4.5-8 %, measured in
tests/test_convergence.py)."""
PLATEAU_GAIN = 0.01
"""... and only for a change that matters: the fitted line must fall (rise) by more than 1 % of its
value at the window's start over the window."""
UNDER_TRAINED, PLATEAUED, NOT_APPLICABLE = "may be under-trained", "plateaued", "n/a"


@dataclass(frozen=True)
class Trend:
    """The least-squares line through a window of the val objective (epochs 0..w-1 of the window):
    its slope per epoch, fitted values at the window's ends, and the slope's one-sided p-values."""

    slope: float
    start: float
    end: float
    t: float
    p_falling: float
    p_rising: float

    @property
    def change(self) -> float:
        """(fitted end − fitted start) / |fitted start|: < 0 fell, > 0 rose (0 when the start is 0)."""
        return (self.end - self.start) / abs(self.start) if self.start != 0 else 0.0


def trend(values: list[float]) -> Trend:
    """`Trend` of `values` (at least 3): t = slope / se(slope) on Student's t with n − 2 degrees of
    freedom, se from the residuals of the line. A curve that still bends inside the window leaves
    larger residuals, so its fall has to be clearer to count; no correction for serially
    correlated noise (it would take most of the degrees of freedom of a short window and hide a
    curve that is plainly still falling). A window with no residual noise gives p = 0 on the side
    its slope points to (1 on the other; 0.5 both for an exactly flat window)."""
    from scipy import stats

    n = len(values)
    if n < 3:
        raise ValueError(f"a trend needs at least 3 values, got {n}")
    xm, ym = (n - 1) / 2.0, math.fsum(values) / n
    sxx = math.fsum((i - xm) ** 2 for i in range(n))
    slope = math.fsum((i - xm) * (v - ym) for i, v in enumerate(values)) / sxx
    intercept = ym - slope * xm
    ssr = math.fsum((v - intercept - slope * i) ** 2 for i, v in enumerate(values))
    se = math.sqrt(ssr / (n - 2) / sxx)
    # Residuals within rounding of zero are no noise (an exactly linear window): the sign decides.
    if se <= 1e-12 * max(abs(ym), 1e-300):
        t = 0.0 if slope == 0 else math.copysign(math.inf, slope)
    else:
        t = slope / se
    p_falling = float(stats.t.cdf(t, n - 2))  # P(T <= t) under a flat trend: small when clearly falling
    p_rising = float(stats.t.sf(t, n - 2))
    return Trend(slope, intercept, intercept + slope * (n - 1), t, p_falling, p_rising)


def plateau_window(epochs: int, window: float = PLATEAU_WINDOW, min_epochs: int = PLATEAU_MIN_EPOCHS) -> int:
    """Epochs in the test's window for a run of `epochs`: max(`min_epochs`, ceil(`window` · epochs))."""
    return max(int(min_epochs), math.ceil(float(window) * epochs - 1e-9))


def val_objective_curve(history: pa.Table | list[dict[str, Any]]) -> list[float]:
    """The val objective of epochs 1..E in order (rows without one are skipped)."""
    rows = history.to_pylist() if isinstance(history, pa.Table) else history
    return [v for _, v in sorted((int(r["epoch"]), float(r["objective"])) for r in rows
                                 if r["split"] == "val" and r.get("objective") is not None and r["epoch"] >= 1)]


def convergence(
    history: pa.Table | list[dict[str, Any]],
    window: float = PLATEAU_WINDOW,
    min_epochs: int = PLATEAU_MIN_EPOCHS,
    alpha: float = PLATEAU_ALPHA,
    gain: float = PLATEAU_GAIN,
    budget: int | None = None,
    stopped: str | None = None,
) -> dict[str, Any]:
    """The plateau test of a history (docs/metrics.md, "Training objective and the under-training flag").

    Over the val objective v_1..v_E (the val rows with an objective, epochs 1..E in order), the
    window is the last w = max(`min_epochs`, ceil(`window` · E)) epochs; the smoothed objective
    is the least-squares line through them (`trend`), and

        improvement = (fitted start − fitted end) / |fitted start|     (> 0: still falling)

    Flags: "may be under-trained" when the line falls significantly (one-sided t-test of the
    slope, p < `alpha`) by more than `gain` and the window reaches a new low (a fall whose every
    value stays above the lowest one before the window — the best epoch came earlier and was
    not regained — is "plateaued"); `overfitting` when it rises significantly (p <
    `alpha`) by more than `gain` (the flag is then "plateaued": more epochs would not help);
    else "plateaued". No val objective, or E < w -> "n/a". `budget` (the epochs allowed) and
    `stopped` ("plateau": training stopped on this test; "budget": it ran every epoch allowed)
    are recorded as given (None for a run without early stopping).

    Returns {"flag", "overfitting", "epochs": E, "window": [first, last epoch] | None,
    "improvement" | None, "p_falling" | None, "p_rising" | None, "best_epoch" | None, "why",
    "test": {window, min_epochs, alpha, gain}, "budget", "stopped", "val_objective": [v_1..v_E]}
    (train and distill keep it in config.json, evaluate passes it on to the report).
    """
    curve = val_objective_curve(history)
    n = len(curve)
    w = plateau_window(n, window, min_epochs)
    out: dict[str, Any] = {
        "flag": NOT_APPLICABLE, "overfitting": False, "epochs": n, "window": None, "improvement": None,
        "p_falling": None, "p_rising": None, "best_epoch": (min(range(n), key=lambda i: (curve[i], i)) + 1) if n else None,
        "test": {"window": window, "min_epochs": int(min_epochs), "alpha": alpha, "gain": gain},
        "budget": budget, "stopped": stopped, "val_objective": curve,
    }
    if n == 0:
        return {**out, "why": "no epochs: no per-epoch val objective (fitted in closed form, or no val split)"}
    if n < w:
        return {**out, "why": f"too few epochs: {n}, the plateau test needs at least {w}"}
    fit = trend(curve[n - w :])
    improvement = -fit.change
    falling = fit.p_falling < alpha and improvement > gain
    rising = fit.p_rising < alpha and -improvement > gain
    span = f"the last {w} of {n} epochs"
    # A fall that does not get back to the lowest value seen before the window is a recovery from
    # a later rise, not a model short of epochs: more of them have not beaten that epoch so far.
    before = min(curve[: n - w], default=math.inf)
    not_regained = falling and min(curve[n - w :]) > before
    if not_regained:
        falling = False
        why = (f"no new low: the val objective's line over {span} fell {improvement:.1%} "
               f"(one-sided p = {fit.p_falling:.2g}), but its lowest value, at epoch {out['best_epoch']}, "
               "came before the window and was not regained")
    elif falling:
        why = (f"val objective still falling: its least-squares line over {span} fell {improvement:.1%} "
               f"(one-sided p = {fit.p_falling:.2g} < {alpha:g}, more than {gain:.0%})")
    elif rising:
        why = (f"over-fitting: the val objective's least-squares line over {span} rose {-improvement:.1%} "
               f"(one-sided p = {fit.p_rising:.2g} < {alpha:g}); lowest at epoch {out['best_epoch']}")
    else:
        why = (f"no significant fall over {span}: fitted change {-improvement:+.1%} "
               f"(one-sided p = {fit.p_falling:.2g}; flagged below {alpha:g} with more than {gain:.0%})")
    if stopped == "plateau":
        why += f"; training stopped here on this test (budget {budget} epochs)"
    elif stopped == "budget" and budget is not None:
        why += f"; ran the whole budget of {budget} epochs"
    return {
        **out,
        "flag": UNDER_TRAINED if falling else PLATEAUED,
        "overfitting": rising,
        "window": [n - w + 1, n],
        "improvement": improvement,
        "p_falling": fit.p_falling,
        "p_rising": fit.p_rising,
        "why": why,
    }


def plateau_stop(curve: list[float], patience: int, **test: Any) -> bool:
    """Whether training should stop after the last value of `curve` (the val objective so far):
    on each of the last `patience` prefixes curve[:E−patience+1] .. curve[:E], the plateau test
    (`convergence`, the same parameters) could judge, and its smoothed objective fell by at most
    `gain` over the window (improvement <= gain: flat, or rising) — a stricter condition than
    "not flagged", which a noisy curve still falling meets by chance. `patience` 0 never stops.
    A run stopped here is "plateaued" by the same test (the flag needs improvement > gain)."""
    if patience < 1 or len(curve) < patience:
        return False
    rows = [{"epoch": e, "split": "val", "objective": v} for e, v in enumerate(curve, 1)]
    gain = test.get("gain", PLATEAU_GAIN)
    for k in range(len(curve) - patience + 1, len(curve) + 1):
        c = convergence(rows[:k], **test)
        if c["flag"] == NOT_APPLICABLE or c["improvement"] > gain:
            return False
    return True


# ---- selection record ------------------------------------------------------------------------


def selection_summary(history: pa.Table) -> dict[str, dict[str, Any]]:
    """For each criterion whose split is in `history`, the epoch it picks and that epoch's metrics.

    Ties go to the earlier epoch, as in `training.fit_classifier`. Only the configured
    criterion chose the saved weights; the others (oracle above all) are for the report.
    Only scored rows count (a generative model's unscored epochs have null metrics).
    """
    rows = [r for r in history.to_pylist() if r["acc"] is not None]
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
