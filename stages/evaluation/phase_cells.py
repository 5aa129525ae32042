"""The phase stage's cells (data/phase/phase.json) as the report reads them, who wins each, and
the interval a cell's winner is read from."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stages.core.io import ArtifactError, read_json

PHASE_PATH = Path("data") / "phase" / "phase.json"
WINNERS = ("generative", "discriminative", "tie")
# The panels support the regime's population measure below this many dimensions per train
# example and not above it (docs/datasets.md, "Separation"): the report counts the two apart.
D_OVER_N_SPLIT = 1.0


class Wins(NamedTuple):
    """Cells won by each side (interval above / below 0) and ties (interval holds 0)."""

    generative: int
    discriminative: int
    tie: int


def seed_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float | None, float | None]:
    """(mean, low, high) of per-seed values: the Student t interval mean ± t_{S−1}·sd/√S.

    Each seed of a phase cell redraws the data (train and test) and refits both classifiers, so
    the S per-seed differences are independent replicates; with S ≈ 10 the t quantile (2.26 at
    S = 10) rather than the normal one (1.96) keeps the coverage at `level`. (None, None) for
    one seed: no interval."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return mean, None, None
    from scipy.stats import t  # scikit-learn's dependency (requirements.lock); only here

    half = float(t.ppf(0.5 + level / 2, len(v) - 1)) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return mean, mean - half, mean + half


def winner(low: float | None, high: float | None) -> str:
    """"generative" when the interval of generative − discriminative lies above 0,
    "discriminative" when below, else "tie" (no interval is a tie too)."""
    if low is not None and low > 0:
        return "generative"
    if high is not None and high < 0:
        return "discriminative"
    return "tie"


def phase_wins(cells: list[dict[str, Any]]) -> Wins:
    """How many cells each classifier wins and how many are ties (`winner` of each cell)."""
    return Wins(*(sum(c["winner"] == w for c in cells) for w in WINNERS))


def load_phase(path: Path = PHASE_PATH) -> list[dict[str, Any]]:
    """The phase stage's cells ([] when the file is absent or empty)."""
    if not path.is_file():
        return []
    cells = read_json(path)
    if not isinstance(cells, list):
        raise ArtifactError(f"{path}: expected a JSON list of cells")
    return cells


SIDE = {"more": "discriminative", "less": "generative"}  # the regime's word -> the side it says wins


class Agreement(NamedTuple):
    """The regime's call (`predicted`: regime.expected_use of each cell's dataset) against the
    measured winner, over a set of cells. "more" predicts the discriminative side wins (the
    generative classifier leans on the shortcut more), "less" the generative side."""

    called: int  # cells with a call
    right: int  # ... whose measured winner is the predicted side
    tie: int  # ... measured as ties
    wrong: int  # ... won by the other side
    uncalled: int  # cells without a call
    uncalled_tie: int  # ... measured as ties
    uncalled_generative: int
    uncalled_discriminative: int


def prediction_agreement(cells: list[dict[str, Any]]) -> Agreement:
    """How the regime's calls in `cells` fared (see `Agreement`)."""
    called = [c for c in cells if c.get("predicted") in SIDE]
    uncalled = [c for c in cells if c.get("predicted") not in SIDE]
    return Agreement(
        len(called),
        sum(c["winner"] == SIDE[c["predicted"]] for c in called),
        sum(c["winner"] == "tie" for c in called),
        sum(c["winner"] not in ("tie", SIDE[c["predicted"]]) for c in called),
        len(uncalled),
        *(sum(c["winner"] == w for c in uncalled) for w in ("tie", "generative", "discriminative")),
    )
