"""`camelyon17`: WILDS Camelyon17 patches (v1.0) — tumour detection across hospitals.

Raw folder (`dataset.camelyon17.root`, default data/raw/camelyon17/), the contents of WILDS'
`camelyon17_v1.0/`: `metadata.csv` with columns `patient, node, x_coord, y_coord, tumor,
slide, center, split` (split 0 = train, 1 = in-distribution val, within the train hospitals)
and the 96×96 PNG patches at
`patches/patient_<patient:03>_node_<node>/patch_patient_<patient:03>_node_<node>_x_<x>_y_<y>.png`.

    y = tumor,  a = center (hospital 0..4),  g = 5y + a
    train_centers, split 0 -> train, minus a seeded test_id_frac of each group -> test_id
    train_centers, split 1 -> val (WILDS id_val)
    test_ood_centers       -> test_ood (WILDS test: hospital 2)
    other centers          -> unused (WILDS' OOD validation hospital 1, by default)

The shift is across hospitals, so test_ood holds only the groups of its own centers and
train/val/test_id only those of the train centers: the metadata's `split_groups` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import images, raw
from stages.datasets.images import check_images
from stages.datasets.packages import sha256_file


@dataclass
class Camelyon17Config(raw.RawFolder):
    """Camelyon17 patches (WILDS v1.0) from data/raw: y = tumor, a = hospital (center); test_ood = held-out centers."""

    kind: str = option("dataset loader")
    root: str = option("folder holding metadata.csv and patches/")
    train_centers: list[int] = option("hospitals of train, val and test_id (WILDS: 0, 3, 4)")
    test_ood_centers: list[int] = option("held-out hospitals of test_ood (WILDS test: 2); other centers are unused")
    seed: int = option("seed of the test_id split carved from train")
    resolution: int = option("patches (96²) are resized to resolution²")
    test_id_frac: float = option("fraction of the train-center train split moved to test_id, per group")
    on_bad_image: str = option("an image that fails to decode: error | skip (counted in the metadata)")
    workers: int = option("decoding processes (0 = one per core)")

    def raw_files(self) -> dict[str, tuple[str, ...]]:
        return {"metadata.csv": COLUMNS}

    def where(self) -> str:
        return WHERE

    def check(self, c: Checks) -> None:
        check_images(c, self.resolution, self.on_bad_image, self.workers)
        c.require(0 < self.test_id_frac < 0.5, "test_id_frac", f"must be in (0, 0.5), got {self.test_id_frac}")
        for key in ("train_centers", "test_ood_centers"):
            centers = getattr(self, key)
            c.require(len(centers) > 0 and all(0 <= x <= 4 for x in centers), key, f"must be non-empty, centers 0..4, got {centers}")
        both = set(self.train_centers) & set(self.test_ood_centers)
        c.require(not both, "test_ood_centers", f"overlaps train_centers: {sorted(both)}")


WHERE = (
    "WILDS (https://wilds.stanford.edu/datasets/#camelyon17; `pip install wilds` then "
    "`python -c \"import wilds; wilds.get_dataset('camelyon17', download=True)\"` on a machine "
    "with network access, then copy camelyon17_v1.0/'s contents)"
)
COLUMNS = ("patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split")
N_CENTERS = 5
# Patches per hospital in WILDS camelyon17_v1.0 (455,954 in all). Source: Koh et al., "WILDS:
# A Benchmark of in-the-Wild Distribution Shifts", ICML 2021, Appendix E.1 (train 302,436,
# id_val 33,560 from hospitals 0/3/4; OOD val 34,904 = hospital 1; test 85,054 = hospital 2).
PUBLISHED = {"center": [59436, 34904, 85054, 129838, 146722]}
SOURCE = "Koh et al. 2021 (WILDS), Camelyon17 patches per hospital"


def patch_path(patient: int, node: int, x: int, y: int) -> str:
    """The patch's file name relative to the raw folder, as WILDS lays them out."""
    return f"patches/patient_{patient:03}_node_{node}/patch_patient_{patient:03}_node_{node}_x_{x}_y_{y}.png"


def load(dataset: str, cfg: Camelyon17Config, out: Path) -> str:
    """Read the raw folder, map splits and groups, decode the patches and write `out`."""
    csv = cfg.check_files(dataset)["metadata.csv"]
    root = csv.parent
    df = raw.read_csv(csv, COLUMNS)
    y = raw.int_column(df, "tumor", csv, (0, 1))
    center = raw.int_column(df, "center", csv, tuple(range(N_CENTERS)))
    official = raw.int_column(df, "split", csv, (0, 1))
    patient, node = raw.int_column(df, "patient", csv), raw.int_column(df, "node", csv)
    xs, ys = raw.int_column(df, "x_coord", csv), raw.int_column(df, "y_coord", csv)
    raw.int_column(df, "slide", csv)
    in_train = np.isin(center, cfg.train_centers)
    split = np.full(len(df), "", dtype=object)
    split[in_train & (official == 0)] = "train"
    split[in_train & (official == 1)] = "val"
    split[np.isin(center, cfg.test_ood_centers)] = "test_ood"
    g = y * N_CENTERS + center
    split = raw.carve(split, g, "train", "test_id", cfg.test_id_frac, np.random.default_rng(cfg.seed))
    groups_of = {
        "train_centers": sorted(int(yy * N_CENTERS + c) for yy in (0, 1) for c in cfg.train_centers),
        "test_ood_centers": sorted(int(yy * N_CENTERS + c) for yy in (0, 1) for c in cfg.test_ood_centers),
    }
    observed = {"center": [int((center == c).sum()) for c in range(N_CENTERS)]}
    meta = images.meta_base(
        dataset,
        "camelyon17",
        cfg,
        n_classes=2,
        n_attrs=N_CENTERS,
        classes=["normal", "tumor"],
        attributes=[f"hospital {c}" for c in range(N_CENTERS)],
        split_groups={
            "train": groups_of["train_centers"],
            "val": groups_of["train_centers"],
            "test_id": groups_of["train_centers"],
            "test_ood": groups_of["test_ood_centers"],
        },
        raw_checksums={"metadata.csv": sha256_file(csv)},
        published_counts=raw.published_check(observed, PUBLISHED, SOURCE),
    )
    files = np.array([patch_path(*t) for t in zip(patient, node, xs, ys, strict=True)], dtype=object)
    # One patch (patient, node, x, y) listed twice is one image in two rows, possibly two splits.
    train_centers = set(cfg.train_centers)
    where = [("train" if o == 0 else "val") if c in train_centers else f"center {c}" for o, c in zip(official.tolist(), center.tolist(), strict=True)]
    raw.require_unique(files, "patch file (patient, node, x_coord, y_coord)", csv, where)
    plan = raw.make_plan(np.arange(len(df), dtype=np.int64), split, y, center, meta, {"file": files}, csv)
    return images.write_images(out, plan, root, cfg.resolution, cfg.on_bad_image, cfg.workers)


register_dataset("camelyon17", Camelyon17Config, load=load)
