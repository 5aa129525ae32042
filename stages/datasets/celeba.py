"""`celeba`: CelebA aligned faces with a target and a spurious attribute (default Blond_Hair / Male).

Raw folder (`dataset.celeba.root`, default data/raw/celeba/), the CSV form of the release
(as on Kaggle, "jessicali9530/celeba-dataset"): `list_attr_celeba.csv` (`image_id` and 40
attribute columns valued -1/1), `list_eval_partition.csv` (`image_id, partition`, 0/1/2 =
train/val/test) and the JPEGs in `img_align_celeba/` (or `img_align_celeba/img_align_celeba/`,
as the Kaggle zip unpacks).

    y = (target == 1),  a = (attribute == 1),  g = 2y + a
    official train -> train
    official val   -> val
    official test  -> per group, a seeded (1 - test_ood_frac) -> test_id (the training
                      correlation); from the rest, the same number of images of every group
                      -> test_ood (group-balanced: the correlation is broken); leftovers unused
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.core.io import ArtifactError
from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import images, raw
from stages.datasets.images import check_images
from stages.datasets.packages import sha256_file


@dataclass
class CelebAConfig(raw.RawFolder):
    """CelebA from data/raw (attribute + partition CSVs): y = target attribute, a = spurious attribute."""

    kind: str = option("dataset loader")
    root: str = option("folder holding list_attr_celeba.csv, list_eval_partition.csv, img_align_celeba/")
    target: str = option("attribute column used as the label y")
    attribute: str = option("attribute column used as the spurious attribute a")
    seed: int = option("seed of the test_id / test_ood split of the official test split")
    resolution: int = option("images are resized (shorter side) and centre-cropped to resolution²")
    test_ood_frac: float = option("fraction of the official test split (per group) from which the group-balanced test_ood is drawn")
    on_bad_image: str = option("an image that fails to decode: error | skip (counted in the metadata)")
    workers: int = option("decoding processes (0 = one per core)")

    def raw_files(self) -> dict[str, tuple[str, ...]]:
        return {ATTR_FILE: ("image_id", self.target, self.attribute), PARTITION_FILE: ("image_id", "partition")}

    def where(self) -> str:
        return WHERE

    def check(self, c: Checks) -> None:
        check_images(c, self.resolution, self.on_bad_image, self.workers)
        c.require(self.target != self.attribute, "attribute", f"must differ from target '{self.target}'")
        c.require(0 < self.test_ood_frac < 1, "test_ood_frac", f"must be in (0, 1), got {self.test_ood_frac}")


WHERE = (
    "https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html (Align&Cropped images) or the CSV "
    "version at https://www.kaggle.com/datasets/jessicali9530/celeba-dataset"
)
ATTR_FILE, PARTITION_FILE = "list_attr_celeba.csv", "list_eval_partition.csv"
OFFICIAL_SPLITS = {0: "train", 1: "val", 2: "test"}
def image_dir(root: Path) -> Path:
    """The folder holding the JPEGs: img_align_celeba/, or the Kaggle zip's nested copy."""
    nested = root / "img_align_celeba" / "img_align_celeba"
    return nested if nested.is_dir() else root / "img_align_celeba"


def load(dataset: str, cfg: CelebAConfig, out: Path) -> str:
    """Read the raw folder, map splits and groups, decode the images and write `out`."""
    files = cfg.check_files(dataset)
    attr_csv, part_csv = files[ATTR_FILE], files[PARTITION_FILE]
    root = attr_csv.parent
    attrs = raw.read_csv(attr_csv, cfg.raw_files()[ATTR_FILE])
    parts = raw.read_csv(part_csv, cfg.raw_files()[PARTITION_FILE])
    y = (raw.int_column(attrs, cfg.target, attr_csv, (-1, 1)) == 1).astype(np.int64)
    a = (raw.int_column(attrs, cfg.attribute, attr_csv, (-1, 1)) == 1).astype(np.int64)
    part_ids = raw.file_names(raw.text_column(parts, "image_id"))
    part_splits = raw.int_column(parts, "partition", part_csv, tuple(OFFICIAL_SPLITS))
    # An image listed twice (in either file) is one face in two rows, possibly two splits.
    raw.require_unique(part_ids, "image_id", part_csv, [OFFICIAL_SPLITS[int(p)] for p in part_splits])
    partition = dict(zip(part_ids, part_splits, strict=True))
    files = raw.file_names(raw.text_column(attrs, "image_id"))
    raw.require_unique(files, "image_id", attr_csv, [OFFICIAL_SPLITS.get(int(partition.get(f, -1)), "?") for f in files])
    missing = [i for i, f in enumerate(files) if f not in partition]
    if missing:
        raise ArtifactError(
            f"{part_csv}: no partition for image '{files[missing[0]]}' (row {missing[0] + 1} of {attr_csv}); "
            f"{len(missing)} image(s) like this. Both files must come from the same release (see {raw.DOCS})"
        )
    names = np.array([OFFICIAL_SPLITS[int(partition[f])] for f in files], dtype=object)
    g = y * 2 + a
    observed = raw.group_counts(names, g, 4, list(raw.CELEBA_PUBLISHED))
    published = (
        raw.published_check(observed, raw.CELEBA_PUBLISHED, raw.CELEBA_SOURCE)
        if (cfg.target, cfg.attribute) == raw.CELEBA_PUBLISHED_FOR
        else raw.published_check(
            {s: [sum(c)] for s, c in observed.items()},
            {s: [sum(c)] for s, c in raw.CELEBA_PUBLISHED.items()},
            "CelebA split sizes (Liu et al. 2015)",
        )
    )
    split = raw.balanced_ood(names, g, 4, "test", cfg.test_ood_frac, np.random.default_rng(cfg.seed))
    meta = images.meta_base(
        dataset,
        "celeba",
        cfg,
        n_classes=2,
        n_attrs=2,
        classes=[f"not {cfg.target}", cfg.target],
        attributes=[f"not {cfg.attribute}", cfg.attribute],
        raw_checksums={ATTR_FILE: sha256_file(attr_csv), PARTITION_FILE: sha256_file(part_csv)},
        published_counts=published,
    )
    plan = raw.make_plan(np.arange(len(files), dtype=np.int64), split, y, a, meta, {"file": files}, attr_csv)
    folder = image_dir(root)
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: image folder not found; unpack img_align_celeba.zip into {root}/ (see {raw.DOCS})")
    return images.write_images(out, plan, folder, cfg.resolution, cfg.on_bad_image, cfg.workers)


register_dataset("celeba", CelebAConfig, load=load)
