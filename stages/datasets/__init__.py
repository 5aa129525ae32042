"""Dataset generators: one pure function per `dataset.<name>.kind`, plus the sampling they share.

A generator is `generate(cfg) -> (columns, meta)`:

- `columns`: numpy arrays `id` (int64), `split` (str), `y` (int64), `a` (int64) and
  `x` (float32, n × dim), one row per example, already in the order they are written;
- `meta`: `kind`, `n_classes`, `n_attrs`, `shape`, `rho_train`, `rho_ood`, `params`,
  `split_sizes` (and `layout` for images) — `stages.prepare` adds the dataset name and
  the group column and writes the file.

Generators draw only from `numpy.random.default_rng` seeded by `cfg.seed`, never from a
global RNG, so the same config gives byte-identical output. See docs/datasets.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Columns = dict[str, np.ndarray]
Generated = tuple[Columns, dict[str, Any]]

# The smallest minority group a split gets when 0 < rho < 1 (if the class has room for it),
# so every (y, a) group is present in val, test_id and test_ood even at extreme rho.
MIN_MINORITY = 2


def round_half_up(value: float) -> int:
    """`value` rounded to the nearest integer, halves up (numpy rounds halves to even)."""
    return int(np.floor(value + 0.5))


def agreement_counts(n: int, rho: float, min_minority: int = MIN_MINORITY) -> tuple[int, int]:
    """(agreeing, disagreeing) example counts for `n` examples of one class at agreement rate `rho`.

    disagreeing = round(n·(1−rho)); when 0 < rho < 1 each side gets at least
    `min(min_minority, n // 2)` examples, so neither group is empty. rho = 0 or 1 is exact.
    """
    disagree = round_half_up(n * (1.0 - rho))
    if 0.0 < rho < 1.0:
        floor = min(min_minority, n // 2)
        disagree = min(max(disagree, floor), n - floor)
    return n - disagree, disagree


def attribute_from_agreement(y: np.ndarray, agree: np.ndarray) -> np.ndarray:
    """Binary attribute `a`: equal to the binary label `y` where `agree`, else `1 - y`."""
    return np.where(agree, y, 1 - y).astype(np.int64)


# Imported after the helpers above, which the generator modules use.
from stages.datasets import (  # noqa: E402
    camelyon17,
    celeba,
    civilcomments,
    colored_digits,
    gaussian_shortcut,
    mnist1d_shortcut,
    shortcut_text,
    waterbirds,
)

GENERATORS: dict[str, Callable[[Any], Generated]] = {
    "gaussian_shortcut": gaussian_shortcut.generate,
    "colored_digits": colored_digits.generate,
    "mnist1d_shortcut": mnist1d_shortcut.generate,
    "shortcut_text": shortcut_text.generate,
}

# Real benchmarks read from data/raw/<dataset>/ and stream their own file (they may not fit
# in memory): `load(dataset, cfg, out_path) -> summary line`. See stages/datasets/raw.py.
LOADERS: dict[str, Callable[[str, Any, Path], str]] = {
    "waterbirds": waterbirds.load,
    "celeba": celeba.load,
    "camelyon17": camelyon17.load,
    "civilcomments": civilcomments.load,
}
