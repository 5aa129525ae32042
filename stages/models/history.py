"""A model's training history and what is read from it: the selection rules, the record of
what each would have picked, and the under-training check.

History (`artifacts.HISTORY_SCHEMA`, one row per epoch and split; stages/models/training.py
writes it): `loss`, `acc`, `worst_group_acc` where the split was scored, `objective` (the
training objective) on train and val every epoch. A checkpoint is chosen by a named criterion
(`SELECTION_METRIC`); `selection_summary` records what every criterion would have picked, so
each model's config.json reports all three while only the configured one chose the saved
weights; `convergence` turns the val objective curve into the under-training flag
(docs/metrics.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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

UNDERTRAINED_WINDOW = 0.2
"""The window of the under-training check: the last 20 % of the epochs (rounded up) ..."""
UNDERTRAINED_MIN_EPOCHS = 2
"""... and at least 2 epochs."""
UNDERTRAINED_GAIN = 0.01
"""A val objective that improved by more than 1 % (relative) within the window is flagged."""
UNDER_TRAINED, PLATEAUED, NOT_APPLICABLE = "may be under-trained", "plateaued", "n/a"


def convergence(
    history: pa.Table | list[dict[str, Any]],
    window: float = UNDERTRAINED_WINDOW,
    min_epochs: int = UNDERTRAINED_MIN_EPOCHS,
    gain: float = UNDERTRAINED_GAIN,
) -> dict[str, Any]:
    """The under-training check of a history (docs/metrics.md, "Training objective and the under-training flag").

    Over the val rows with an objective, epochs 1..E in order: the window is the last
    w = max(`min_epochs`, ceil(`window` · E)) epochs, its start value v0 the val objective at
    epoch E − w (the model the window's training started from), and

        improvement = (v0 − min over the window) / |v0|

    (0 when v0 is 0). improvement > `gain` -> "may be under-trained", else "plateaued"; no
    val objective (closed-form and other epoch-less models) or E <= w -> "n/a". Returns
    {"flag", "epochs": E, "window": [first, last epoch] or None, "improvement" or None, "why",
    "val_objective": the curve, epochs 1..E} (train and distill keep it in config.json, evaluate
    passes it on to the report, which draws the curves).
    """
    rows = history.to_pylist() if isinstance(history, pa.Table) else history
    curve = sorted((int(r["epoch"]), float(r["objective"])) for r in rows
                   if r["split"] == "val" and r.get("objective") is not None and r["epoch"] >= 1)
    n = len(curve)
    w = max(int(min_epochs), math.ceil(float(window) * n - 1e-9))
    out: dict[str, Any] = {"flag": NOT_APPLICABLE, "epochs": n, "window": None, "improvement": None,
                           "val_objective": [v for _, v in curve]}
    if n == 0:
        return {**out, "why": "no epochs: no per-epoch val objective (fitted in closed form, or no val split)"}
    if n <= w:
        return {**out, "why": f"too few epochs: {n}, the check needs more than {w}"}
    start = curve[n - w - 1][1]
    best = min(v for _, v in curve[n - w :])
    improvement = (start - best) / abs(start) if start != 0 else 0.0
    flagged = improvement > gain
    return {
        **out,
        "flag": UNDER_TRAINED if flagged else PLATEAUED,
        "window": [curve[n - w][0], curve[-1][0]],
        "improvement": improvement,
        "why": f"val objective {'improved' if improvement > 0 else 'changed'} by {improvement:+.1%} over the last "
               f"{w} of {n} epochs ({'more' if flagged else 'not more'} than {gain:.0%})",
    }


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
