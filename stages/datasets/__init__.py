"""Datasets: one module per `dataset.<name>.kind`, plus the sampling they share.

Each module `stages/datasets/<kind>.py` declares its kind once, at the bottom, with
`stages.core.registry.register_dataset` (schema, `generate` or `load`, capabilities);
`stages.core.registry.dataset(kind)` imports just that module. Nothing here imports a dataset
module, and nothing under stages/datasets imports a stage entrypoint.

A generated dataset's function is `generate(cfg) -> (columns, meta)`:

- `columns`: numpy arrays `id` (int64), `split` (str), `y` (int64), `a` (int64) and
  `x` (float32, n × dim), one row per example, already in the order they are written;
- `meta`: `kind`, `n_classes`, `n_attrs`, `shape`, `rho_train`, `rho_ood`, `params`,
  `split_sizes` (and `layout` for images), and `separation` where the generator knows it in
  closed form — `stages.prepare` adds the dataset name, the group column and, when the
  generator gave none, `separation` estimated on the train rows (stages/evaluation/regime.py), and
  writes the file.

Generators draw only from `numpy.random.default_rng` seeded by `cfg.seed`, never from a
global RNG, so the same config gives byte-identical output. Real benchmarks read
data/raw/<dataset>/ and stream their own file: `load(dataset, cfg, out_path) -> summary
line` (stages/datasets/raw.py). See docs/datasets.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.core.artifacts import SPLITS
from stages.core.schema import ConfigError

Columns = dict[str, np.ndarray]
Generated = tuple[Columns, dict[str, Any]]

# The smallest minority group a split gets when 0 < rho < 1 (if the class has room for it),
# so every (y, a) group is present in every split even at extreme rho.
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


def assign_splits(y: np.ndarray, cfg: Any, rng: np.random.Generator) -> np.ndarray:
    """Split name per example, stratified by binary y: per class, round(n_class·frac) examples
    each to val, test_id and test_ood (`cfg.val_frac`, `cfg.test_id_frac`, `cfg.test_ood_frac`,
    from a seeded permutation), the rest to train."""
    split = np.empty(len(y), dtype=object)
    for c in (0, 1):
        idx = rng.permutation(np.flatnonzero(y == c))
        sizes = [round_half_up(len(idx) * f) for f in (cfg.val_frac, cfg.test_id_frac, cfg.test_ood_frac)]
        bounds = np.cumsum([0, *sizes])
        split[idx] = "train"
        for name, lo, hi in zip(("val", "test_id", "test_ood"), bounds[:-1], bounds[1:], strict=True):
            split[idx[lo:hi]] = name
    return split


def assign_attributes(
    y: np.ndarray,
    split: np.ndarray,
    cfg: Any,
    rng: np.random.Generator,
    rounds: np.ndarray | None = None,
    copies_rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Binary attribute per example with exact counts: in each split and class, `agreement_counts`
    at `cfg.rho_ood` (test_ood) or `cfg.rho_train` (elsewhere) decides how many examples agree,
    and a seeded permutation decides which.

    `rounds` (the copy number of each row, when a source example appears several times)
    permutes each round on its own and puts them one after the other, so the agreeing examples
    (the first) and the disagreeing ones (the last) come from as many distinct sources as the
    round holds: a small group gets distinct examples, not repeats. Round 0 is permuted by
    `rng` exactly as without copies, rounds 1.. by `copies_rng`, so `rng` ends where it would
    without them (what it draws next, e.g. the uncopied rows' noise, is unchanged)."""
    agree = np.zeros(len(y), dtype=bool)
    rounds = np.zeros(len(y), dtype=np.int64) if rounds is None else np.asarray(rounds)
    for name in SPLITS:
        rho = cfg.rho_ood if name == "test_ood" else cfg.rho_train
        for c in (0, 1):
            rows = (split == name) & (y == c)
            last = int(rounds[rows].max(initial=0))
            idx = np.concatenate([(rng if r == 0 else copies_rng).permutation(np.flatnonzero(rows & (rounds == r)))  # type: ignore[union-attr]
                                  for r in range(last + 1)])
            n_agree, _ = agreement_counts(len(idx), rho)
            agree[idx[:n_agree]] = True
    return attribute_from_agreement(y, agree)


def group_ids(y: np.ndarray, a: np.ndarray, n_attrs: int) -> np.ndarray:
    """Group of each example: g = y·n_attrs + a."""
    return (np.asarray(y, dtype=np.int64) * n_attrs + np.asarray(a, dtype=np.int64)).astype(np.int64)


def check_groups(
    dataset: str,
    split: np.ndarray,
    y: np.ndarray,
    a: np.ndarray,
    n_classes: int,
    n_attrs: int,
    split_groups: dict[str, list[int]] | None = None,
    source: Any = None,
) -> None:
    """Raise an error naming the split and group if any (y, a) group is absent from a split
    (train included: a class or group missing from train cannot be learnt, and the methods
    would train and evaluate without a word).

    `split_groups` (metadata of domain-shift datasets) lists the groups each split can hold;
    by default every split must hold every group. A generated dataset gets a ConfigError
    (its config made the split too small); with `source` (a real benchmark's raw file) an
    ArtifactError naming that file.
    """
    for name in SPLITS:
        in_split = split == name
        for yy in range(n_classes):
            for aa in range(n_attrs):
                if split_groups is not None and yy * n_attrs + aa not in split_groups[name]:
                    continue
                if np.any(in_split & (y == yy) & (a == aa)):
                    continue
                what = f"split '{name}' has no example of group g={yy * n_attrs + aa} (y={yy}, a={aa})"
                if source is not None:
                    from stages.core.io import ArtifactError

                    raise ArtifactError(
                        f"{source}: {what} for dataset.{dataset}; the file looks edited or is not the whole "
                        f"release: re-download it (see docs/datasets.md)"
                    )
                raise ConfigError(
                    f"dataset.{dataset}: {what}; use a larger split or a rho strictly between 0 and 1 "
                    f"(rho_train for train/val/test_id, rho_ood for test_ood)"
                )
