"""`colored_digits`: scikit-learn's real 8×8 handwritten digits with an injected spurious cue.

y = int(digit < 5); the binary attribute a agrees with y (a == y) with probability rho_train
in train/val/test_id and rho_ood in test_ood. The cue that carries a is one of three forms
(`cfg.spurious`), each with noise of std `cfg.spurious_noise`:

- color:      the stroke is tinted, channel weights TINTS[a] + N(0, noise²) per image;
- marker:     grayscale digit, plus the corner pixel MARKERS[a] set to 1 + N(0, noise²);
- background: grayscale digit composited over a blue background of mean BACKGROUND[a]
              with per-pixel noise of std BACKGROUND_NOISE_GAIN·noise.

Images are 3×8×8 (CHW), values clipped to [0, 1], flattened into x. An image's id is its
index in `load_digits()` order. See docs/datasets.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.artifacts import SPLITS
from stages.config import ColoredDigitsConfig
from stages.datasets import Generated, agreement_counts, attribute_from_agreement, round_half_up

SHAPE = (3, 8, 8)
# Red-ish stroke for a=0, green-ish for a=1: a cue with tiny within-group variance.
TINTS = np.array([[1.0, 0.2, 0.2], [0.2, 1.0, 0.2]])
# (row, col) of the marker pixel; both corners are (nearly, <= 1/16) blank in every load_digits image.
MARKERS = ((0, 0), (7, 0))
# Mean blue background level per attribute, and per-pixel noise std = gain × spurious_noise:
# at the default noise 0.1 each pixel's std (0.3) exceeds the gap between the levels (0.2).
BACKGROUND = (0.25, 0.45)
BACKGROUND_NOISE_GAIN = 3.0


def load_images() -> tuple[np.ndarray, np.ndarray]:
    """(images in [0, 1], shape (1797, 8, 8); digits) from scikit-learn, offline."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images / 16.0).astype(np.float64), digits.target.astype(np.int64)


def assign_splits(y: np.ndarray, cfg: ColoredDigitsConfig, rng: np.random.Generator) -> np.ndarray:
    """Split name per image, stratified by y: per class, round(n_class·frac) images each to
    val, test_id and test_ood (from a seeded permutation), the rest to train."""
    split = np.empty(len(y), dtype=object)
    for c in (0, 1):
        idx = rng.permutation(np.flatnonzero(y == c))
        sizes = [
            round_half_up(len(idx) * f) for f in (cfg.val_frac, cfg.test_id_frac, cfg.test_ood_frac)
        ]
        bounds = np.cumsum([0, *sizes])
        split[idx] = "train"
        for name, lo, hi in zip(
            ("val", "test_id", "test_ood"), bounds[:-1], bounds[1:], strict=True
        ):
            split[idx[lo:hi]] = name
    return split


def assign_attributes(
    y: np.ndarray, split: np.ndarray, cfg: ColoredDigitsConfig, rng: np.random.Generator
) -> np.ndarray:
    """Attribute per image with exact counts: in each split and class, `agreement_counts`
    decides how many images agree, and a seeded permutation decides which."""
    agree = np.zeros(len(y), dtype=bool)
    for name in SPLITS:
        rho = cfg.rho_ood if name == "test_ood" else cfg.rho_train
        for c in (0, 1):
            idx = rng.permutation(np.flatnonzero((split == name) & (y == c)))
            n_agree, _ = agreement_counts(len(idx), rho)
            agree[idx[:n_agree]] = True
    return attribute_from_agreement(y, agree)


def render(
    images: np.ndarray, a: np.ndarray, spurious: str, noise: float, rng: np.random.Generator
) -> np.ndarray:
    """3-channel images (n, 3, 8, 8) in [0, 1] carrying attribute `a` in the given form."""
    n = len(images)
    gray = np.repeat(images[:, None], 3, axis=1)
    if spurious == "color":
        weights = TINTS[a] + noise * rng.standard_normal((n, 3))
        out = gray * weights[:, :, None, None]
    elif spurious == "marker":
        out = gray.copy()
        values = 1.0 + noise * rng.standard_normal(n)
        for attr, (row, col) in enumerate(MARKERS):
            rows = np.flatnonzero(a == attr)
            out[rows, :, row, col] = values[rows, None]
    elif spurious == "background":
        out = gray.copy()
        level = np.asarray(BACKGROUND)[a][:, None, None]
        background = level + BACKGROUND_NOISE_GAIN * noise * rng.standard_normal((n, 8, 8))
        # The stroke occludes the background: alpha-composite with the ink as alpha.
        out[:, 2] = images + (1.0 - images) * background
    else:
        raise ValueError(f"unknown spurious form '{spurious}'")
    return np.clip(out, 0.0, 1.0)


def generate(cfg: ColoredDigitsConfig) -> Generated:
    """All four splits, rows ordered by split (train, val, test_id, test_ood) then id.

    One stream `default_rng(seed)` draws, in order: the split permutation, the attribute
    permutation, then the cue noise for every image in id order.
    """
    images, digits = load_images()
    y = (digits < 5).astype(np.int64)
    rng = np.random.default_rng(cfg.seed)
    split = assign_splits(y, cfg, rng)
    a = assign_attributes(y, split, cfg, rng)
    x = (
        render(images, a, cfg.spurious, cfg.spurious_noise, rng)
        .reshape(len(y), -1)
        .astype(np.float32)
    )
    rank = {name: i for i, name in enumerate(SPLITS)}
    order = np.lexsort((np.arange(len(y)), np.array([rank[s] for s in split])))
    columns = {
        "id": order.astype(np.int64),
        "split": split[order],
        "y": y[order],
        "a": a[order],
        "x": x[order],
    }
    meta = {
        "kind": "colored_digits",
        "n_classes": 2,
        "n_attrs": 2,
        "shape": list(SHAPE),
        "layout": "CHW",
        "rho_train": cfg.rho_train,
        "rho_ood": cfg.rho_ood,
        "params": dataclasses.asdict(cfg),
        "split_sizes": {name: int((split == name).sum()) for name in SPLITS},
    }
    return columns, meta
