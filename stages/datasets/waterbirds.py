"""`waterbirds`: the Waterbirds release `waterbird_complete95_forest2water2` (Sagawa et al., 2020).

Raw folder (`dataset.waterbirds.root`, default data/raw/waterbirds/): `metadata.csv` with
columns `img_id, img_filename, y, split, place` (y = 1 waterbird, place = 1 water background,
split 0/1/2 = train/val/test) and the images at the paths `img_filename` gives. `img_id` and
`img_filename` must each be unique (a row listed twice would put one image in two splits).

    y = y,  a = place,  g = 2y + a
    official train -> train, minus a seeded test_id_frac of each group -> test_id
    official val   -> val     (group-balanced within each class, as released)
    official test  -> test_ood (group-balanced within each class: the correlation is broken)
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
class WaterbirdsConfig(raw.RawFolder):
    """Waterbirds (waterbird_complete95_forest2water2) from data/raw: y = waterbird, a = water background."""

    kind: str = option("dataset loader")
    root: str = option("folder holding metadata.csv and the image folders")
    seed: int = option("seed of the test_id split carved from train")
    resolution: int = option("images are resized (shorter side) and centre-cropped to resolution²")
    test_id_frac: float = option("fraction of the official train split moved to test_id, per group")
    on_bad_image: str = option("an image that fails to decode: error | skip (counted in the metadata)")
    workers: int = option("decoding processes (0 = one per core)")

    def raw_files(self) -> dict[str, tuple[str, ...]]:
        return {"metadata.csv": COLUMNS}

    def where(self) -> str:
        return WHERE

    def check(self, c: Checks) -> None:
        check_images(c, self.resolution, self.on_bad_image, self.workers)
        c.require(0 < self.test_id_frac < 0.5, "test_id_frac", f"must be in (0, 0.5), got {self.test_id_frac}")


WHERE = (
    "https://github.com/kohpangwei/group_DRO (the 'waterbird_complete95_forest2water2' tarball, "
    "https://nlp.stanford.edu/data/dro/waterbird_complete95_forest2water2.tar.gz)"
)
COLUMNS = ("img_id", "img_filename", "y", "split", "place")
OFFICIAL_SPLITS = {0: "train", 1: "val", 2: "test"}
# Group counts of the release, per official split, groups g = 2y + place
# (landbird/land, landbird/water, waterbird/land, waterbird/water).
# Source: Sagawa et al., "Distributionally Robust Neural Networks", ICLR 2020, Appendix C.1
# (train 3498/184/56/1057; val and test balanced by place within each class).
PUBLISHED = {
    "train": [3498, 184, 56, 1057],
    "val": [467, 466, 133, 133],
    "test": [2255, 2255, 642, 642],
}
SOURCE = "Sagawa et al. 2020 (group DRO), Waterbirds group counts"


def load(dataset: str, cfg: WaterbirdsConfig, out: Path) -> str:
    """Read the raw folder, map splits and groups, decode the images and write `out`."""
    csv = cfg.check_files(dataset)["metadata.csv"]
    root = csv.parent
    df = raw.read_csv(csv, COLUMNS)
    y = raw.int_column(df, "y", csv, (0, 1))
    a = raw.int_column(df, "place", csv, (0, 1))
    official = raw.int_column(df, "split", csv, tuple(OFFICIAL_SPLITS))
    names = np.array([OFFICIAL_SPLITS[s] for s in official], dtype=object)
    files = raw.file_names(raw.text_column(df, "img_filename"))
    raw.require_unique(raw.int_column(df, "img_id", csv), "img_id", csv, names)
    raw.require_unique(files, "img_filename", csv, names)
    g = y * 2 + a
    observed = raw.group_counts(names, g, 4, list(PUBLISHED))
    split = np.where(names == "test", "test_ood", names).astype(object)
    split = raw.carve(split, g, "train", "test_id", cfg.test_id_frac, np.random.default_rng(cfg.seed))
    meta = images.meta_base(
        dataset,
        "waterbirds",
        cfg,
        n_classes=2,
        n_attrs=2,
        classes=["landbird", "waterbird"],
        attributes=["land", "water"],
        raw_checksums={"metadata.csv": sha256_file(csv)},
        published_counts=raw.published_check(observed, PUBLISHED, SOURCE),
    )
    plan = raw.make_plan(np.arange(len(df), dtype=np.int64), split, y, a, meta, {"file": files}, csv)
    return images.write_images(out, plan, root, cfg.resolution, cfg.on_bad_image, cfg.workers)


register_dataset("waterbirds", WaterbirdsConfig, load=load)
