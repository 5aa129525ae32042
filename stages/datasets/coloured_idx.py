"""IRM's colouring of an IDX image set (MNIST, Fashion-MNIST): the construction two kinds share.

The construction of "Invariant Risk Minimization" (Arjovsky et al. 2019, arXiv:1907.02893,
section 5.2) and its public code (facebookresearch/InvariantRiskMinimization,
`make_environment` in its Colored MNIST script):

    image  = the 28×28 image subsampled 2× ([::2, ::2]: 14×14), values / 255
    y      = (class < 5)  XOR  Bernoulli(label_noise)            (label_noise 0.25: the class
                                                                   predicts y at 75 % at best)
    colour = y  XOR  Bernoulli(1 − ρ)                            (ρ = P(colour == y))
    x      = two channels; channel `colour` holds the image, the other is zero (2×14×14)
    a      = colour

ρ per training environment (`rho_train`, IRM's two in its order: 0.8 and 0.9; train rows are dealt to them in
turn, so train's colour agrees with y 85 % of the time, more than the class's 75 %: the shortcut),
and `rho_ood` for test_ood (IRM's test environment: 0.1). val and test_id are drawn like train
(dealt to the environments in turn): they are in-distribution.

Splits. The release's own split: its 60,000 training images give val (a seeded `val_size` of
them) and train (the rest, or a seeded `train_size` of the rest when set: a documented
subsample to meet a time budget, never a silent one); its 10,000 test images are test_id and
test_ood, each all 10,000 images with its own colour draw (ids 60,000 + i and 70,000 + i: the
training file's size, then again the test file's), drawn from `test_seed` alone. So a replicate (`seed`, run.redraw_data) redraws the train/val split,
the train subsample and their label noise and colours; the test splits stay fixed, as the
field's do. The label noise of a test image is drawn once and shared by its two copies.

IRM's code also shuffles MNIST's training set and keeps 50,000 of it; here the val/train draw
plays that part. Data: stage fetch@<source.name> (stages/datasets/packages.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.core.io import ArtifactError
from stages.core.schema import Checks, option
from stages.datasets import Generated, raw
from stages.datasets.packages import Source, check_source, read_idx, require_fetched

SHAPE = (2, 14, 14)
TRAIN_IMAGES, TRAIN_LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
TEST_IMAGES, TEST_LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"
# The published sizes of MNIST (LeCun et al. 1998) and Fashion-MNIST (Xiao et al. 2017): 60,000 / 10,000.
PUBLISHED_SIZES = {"train": 60000, "test": 10000}


@dataclass
class ColouredIdxConfig:
    """IRM's colouring of an image set: y = class < 5 with label noise, a colour agreeing with y w.p. ρ."""

    kind: str = option("dataset kind")
    source: Source = option("the registry package holding the images (stages/datasets/packages.py)")
    seed: int = option("seed of the val/train draw, the train subsample and their label noise and colours")
    test_seed: int = option("seed of the test splits' label noise and colours (fixed across replicates)")
    label_noise: float = option("P(y is flipped) (IRM: 0.25)")
    rho_train: list[float] = option("P(colour == y) in each training environment; train, val and test_id rows are dealt to them in turn (IRM: [0.8, 0.9], its even rows then its odd rows)")
    rho_ood: float = option("P(colour == y) in test_ood (IRM's test environment: 0.1)")
    val_size: int = option("images of MNIST's training set drawn into val")
    train_size: int | None = option("train images: a seeded subsample of the rest (null = all of them)")

    def check(self, c: Checks) -> None:
        check_source(c, self.source)
        c.prob(self.label_noise, "label_noise")
        c.require(len(self.rho_train) >= 1, "rho_train", "must list at least one environment")
        for i, rho in enumerate(self.rho_train):
            c.prob(rho, f"rho_train[{i}]")
        c.prob(self.rho_ood, "rho_ood")
        c.require(100 <= self.val_size <= 30000, "val_size", f"must be in [100, 30000], got {self.val_size}")
        if self.train_size is not None:
            c.require(100 <= self.train_size <= PUBLISHED_SIZES["train"] - self.val_size, "train_size",
                      f"must be in [100, {PUBLISHED_SIZES['train'] - self.val_size}] (or null: all), got {self.train_size}")


def load_images(source: Source, dataset: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train" | "test": (uint8 images (n, 28, 28), int64 classes)} from the fetched IDX files
    (raw or .gz, as `source.files` names them), each pair's shapes checked (the published sizes
    are the metadata's `published_counts`, which validate compares)."""
    require_fetched(source, dataset)
    by_stem = {source.file(p).name.removesuffix(".gz"): source.file(p) for p in source.files}
    out = {}
    for split, (imgs, labels) in {"train": (TRAIN_IMAGES, TRAIN_LABELS), "test": (TEST_IMAGES, TEST_LABELS)}.items():
        x, y = read_idx(by_stem[imgs]), read_idx(by_stem[labels]).astype(np.int64)
        if x.ndim != 3 or x.shape[1:] != (28, 28) or len(x) != len(y):
            raise ArtifactError(f"{by_stem[imgs]}: expected n×28×28 images matching {len(y)} labels, got shape {list(x.shape)}")
        out[split] = (x, y)
    return out


def colour(images: np.ndarray, digits: np.ndarray, rho: np.ndarray, label_noise: float, rng: np.random.Generator,
           flips: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IRM's `make_environment` on (n, 28, 28) uint8 `images`: (x (n, 392) float32, y, a).

    Draws, in order, the label flips (unless given) then the colour flips from `rng`; `rho` is
    each row's P(colour == y)."""
    n = len(images)
    flip = rng.random(n) < label_noise if flips is None else flips
    y = ((digits < 5) ^ flip).astype(np.int64)
    a = (y ^ (rng.random(n) >= rho)).astype(np.int64)
    small = images[:, ::2, ::2].astype(np.float32) / np.float32(255.0)
    x = np.zeros((n, *SHAPE), dtype=np.float32)
    x[np.arange(n), a] = small
    return x.reshape(n, -1), y, a


def generate(cfg: ColouredIdxConfig, classes: list[str]) -> Generated:
    """All four splits, rows ordered by split (train, val, test_id, test_ood) then id; `classes`
    names y = 0 and y = 1 in the metadata.

    `default_rng(seed)` draws the val permutation, the train subsample, then (rows in id order)
    the label and colour flips of train and val; `default_rng(test_seed)` the test images'
    label flips, then test_id's colours, then test_ood's."""
    data = load_images(cfg.source, cfg.kind)
    train_x, train_d = data["train"]
    test_x, test_d = data["test"]
    wanted = cfg.val_size + (cfg.train_size or 1)
    if wanted > len(train_x):
        raise ArtifactError(f"{cfg.source.folder}: {len(train_x)} training images, fewer than dataset.{cfg.kind}.val_size "
                            f"+ train_size = {wanted}; lower them (the release has {PUBLISHED_SIZES['train']})")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(train_x))
    val_idx = np.sort(order[: cfg.val_size])
    rest = order[cfg.val_size:]
    train_idx = np.sort(rest if cfg.train_size is None else rng.choice(rest, cfg.train_size, replace=False))
    envs = np.asarray(cfg.rho_train, dtype=np.float64)
    parts = []
    for name, idx in (("train", train_idx), ("val", val_idx)):
        rho = envs[np.arange(len(idx)) % len(envs)]
        x, y, a = colour(train_x[idx], train_d[idx], rho, cfg.label_noise, rng)
        parts.append((name, idx.astype(np.int64), x, y, a))
    test_rng = np.random.default_rng(cfg.test_seed)
    flips = test_rng.random(len(test_x)) < cfg.label_noise
    n_train = len(train_x)  # test ids follow the training file's: 60,000 + i and 70,000 + i in the release
    for k, name in enumerate(("test_id", "test_ood")):
        rho = envs[np.arange(len(test_x)) % len(envs)] if name == "test_id" else np.full(len(test_x), cfg.rho_ood)
        x, y, a = colour(test_x, test_d, rho, cfg.label_noise, test_rng, flips)
        parts.append((name, n_train + k * len(test_x) + np.arange(len(test_x), dtype=np.int64), x, y, a))
    split = np.concatenate([np.full(len(p[1]), p[0], dtype=object) for p in parts])
    columns = {
        "id": np.concatenate([p[1] for p in parts]),
        "split": split,
        "y": np.concatenate([p[3] for p in parts]),
        "a": np.concatenate([p[4] for p in parts]),
        "x": np.concatenate([p[2] for p in parts]),
    }
    # the observed P(a == y) (raw.fetched_meta): the colours are Bernoulli draws, as in IRM's code
    meta = raw.fetched_meta(
        cfg, columns, list(SHAPE), {"range": [0.0, 1.0]},
        layout="CHW", classes=classes,
        attributes=["colour 0 (the digit in channel 0)", "colour 1 (the digit in channel 1)"],
        published_counts={
            "source": "MNIST (LeCun et al. 1998) and Fashion-MNIST (Xiao et al. 2017): 60,000 training and 10,000 test images",
            "expected": {k: [v] for k, v in PUBLISHED_SIZES.items()},
            "observed": {"train": [len(train_x)], "test": [len(test_x)]},
        },
    )
    return columns, meta
