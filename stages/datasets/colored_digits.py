"""`colored_digits`: scikit-learn's real 8×8 handwritten digits with an injected spurious cue.

y = int(digit < 5); the binary attribute a agrees with y (a == y) with probability rho_train
in train/val/test_id and rho_ood in test_ood. The cue that carries a is one of three forms
(`cfg.spurious`), each with noise of std `cfg.spurious_noise`:

- color:      the stroke is tinted, channel weights TINTS[a] + N(0, noise²) per image;
- marker:     grayscale digit, plus the corner pixel MARKERS[a] set to 1 + N(0, noise²);
- background: grayscale digit composited over a blue background of mean BACKGROUND[a]
              with per-pixel noise of std BACKGROUND_NOISE_GAIN·noise.

Three knobs set the cue's regime (their defaults, 1 / 0 / 0, give exactly the data above):
`cue_gap` scales the gap between the two attribute levels around their midpoint (tints,
background levels; the marker's level above the blank corner), `cue_pixels` sets how many
pixels carry the cue (marker: pixels per attribute; color, background: the first k pixels in
row-major order, the others get the midpoint level; 0 = the form's own footprint), and
`pixel_noise` adds independent N(0, pixel_noise²) to every value of the image.

Images are 3×8×8 (CHW), values clipped to [0, 1], flattened into x. An image's id is its
index in `load_digits()` order. See docs/datasets.md.

Test splits that can carry a verdict (`test_repeats`). scikit-learn ships 1,797 digits, so a
test split of a few hundred images leaves its smallest (class, attribute) group a handful
of images (9 in test_ood at the defaults), and two images decide a worst-group accuracy. With
`test_repeats` R > 1 every test_id and test_ood image appears R times, each copy with its own
attribute draw and its own cue noise (and pixel noise), the way a fresh photograph of the
same digit in another colour would; train and val are untouched. A copy's id is
r·1797 + the image's index (r = 0..R−1; image = id mod 1797). Within each test split and class
the attribute is assigned round by round (stages.datasets.assign_attributes' `rounds`), so a
group no larger than the class's images holds distinct images: at the defaults (R = 1) the
data are exactly those above. The digit itself is not redrawn: copies of one image share
their strokes, so a group's accuracy has the strokes of at most that many distinct images
behind it (its minority groups, the ones that decide worst-group accuracy, are distinct
images up to the class's test images: 134-180 per class at the default fractions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stages.core.artifacts import SPLITS
from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import Generated, assign_attributes, assign_splits


@dataclass
class ColoredDigitsConfig:
    """scikit-learn's 8×8 digits, y = digit < 5, with a spurious attribute agreeing with y w.p. ρ."""

    kind: str = option("dataset generator")
    seed: int = option("split/attribute seed")
    rho_train: float = option("P(attribute == label) in train, val and test_id")
    rho_ood: float = option("P(attribute == label) in test_ood (0.05 = reversed)")
    spurious: str = option("form of the spurious cue: color | marker | background")
    spurious_noise: float = option("std of the noise on the spurious cue (0 = exact)")
    cue_gap: float = option("gap between the two attribute levels, as a multiple of the built-in one (scaled around their midpoint; marker: the marker's level)")
    cue_pixels: int = option(
        "pixels carrying the cue: marker pixels per attribute (1..32) | color, background: the first k "
        "of the 64 pixels in row-major order (the rest get the midpoint level); 0 = the form's own (marker 1, others 64)"
    )
    pixel_noise: float = option("std of independent N(0, ·) noise added to every value of every image (0 = none)")
    test_repeats: int = option(
        "copies of every test_id and test_ood image, each with its own attribute and cue-noise draw "
        "(1 = each image once; the module docstring says why and what copies share)"
    )
    val_frac: float = option("fraction of images in val")
    test_id_frac: float = option("fraction of images in test_id")
    test_ood_frac: float = option("fraction of images in test_ood")

    def check(self, c: Checks) -> None:
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.choice(self.spurious, "spurious", ["color", "marker", "background"])
        c.non_negative(self.spurious_noise, "spurious_noise")
        c.non_negative(self.cue_gap, "cue_gap")
        c.non_negative(self.pixel_noise, "pixel_noise")
        c.require(self.test_repeats >= 1, "test_repeats", f"must be >= 1, got {self.test_repeats}")
        most = MAX_MARKER_PIXELS if self.spurious == "marker" else PIXELS
        c.require(0 <= self.cue_pixels <= most, "cue_pixels", f"must be in 0..{most} for spurious={self.spurious}, got {self.cue_pixels}")
        for k in ("val_frac", "test_id_frac", "test_ood_frac"):
            c.require(0 < getattr(self, k) < 1, k, f"must be in (0, 1), got {getattr(self, k)}")
        total = self.val_frac + self.test_id_frac + self.test_ood_frac
        c.require(total < 0.9, "val_frac", f"val+test fractions must leave >= 10% for train, got {total}")


SHAPE = (3, 8, 8)
# Red-ish stroke for a=0, green-ish for a=1: a cue with tiny within-group variance.
TINTS = np.array([[1.0, 0.2, 0.2], [0.2, 1.0, 0.2]])
# (row, col) of the marker pixel; both corners are (nearly, <= 1/16) blank in every load_digits image.
MARKERS = ((0, 0), (7, 0))
# Mean blue background level per attribute, and per-pixel noise std = gain × spurious_noise:
# at the default noise 0.1 each pixel's std (0.3) exceeds the gap between the levels (0.2).
BACKGROUND = (0.25, 0.45)
BACKGROUND_NOISE_GAIN = 3.0
PIXELS = 64
# cue_pixels > 1 markers grow in row-major order from their corner: a = 0 through rows 0..3,
# a = 1 through rows 7, 6, 5, 4 — the two never overlap.
MAX_MARKER_PIXELS = 32
MARKER_PIXELS = (
    tuple((r, c) for r in range(4) for c in range(8)),
    tuple((r, c) for r in range(7, 3, -1) for c in range(8)),
)


def levels(base: np.ndarray, gap: float) -> np.ndarray:
    """The two attribute levels (rows of `base`) with their difference scaled by `gap` around
    their midpoint; `base` itself at gap 1 (so the default data keeps its exact bytes)."""
    base = np.asarray(base, dtype=np.float64)
    if gap == 1.0:
        return base
    mid = base.mean(axis=0)
    return mid + gap * (base - mid)


def cue_mask(cue_pixels: int) -> np.ndarray:
    """(8, 8) bool: the pixels carrying a color or background cue (first k in row-major order; 0 = all)."""
    k = PIXELS if cue_pixels == 0 else cue_pixels
    return (np.arange(PIXELS) < k).reshape(8, 8)


def load_images() -> tuple[np.ndarray, np.ndarray]:
    """(images in [0, 1], shape (1797, 8, 8); digits) from scikit-learn, offline."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images / 16.0).astype(np.float64), digits.target.astype(np.int64)


def render(
    images: np.ndarray,
    a: np.ndarray,
    spurious: str,
    noise: float,
    rng: np.random.Generator,
    cue_gap: float = 1.0,
    cue_pixels: int = 0,
    pixel_noise: float = 0.0,
) -> np.ndarray:
    """3-channel images (n, 3, 8, 8) in [0, 1] carrying attribute `a` in the given form.

    Draws the cue noise, then (pixel_noise > 0 only) the per-value noise, from `rng`.
    """
    n = len(images)
    gray = np.repeat(images[:, None], 3, axis=1)
    if spurious == "color":
        tints = levels(TINTS, cue_gap)
        draw = noise * rng.standard_normal((n, 3))
        weights = tints[a] + draw
        if cue_pixels == 0:
            out = gray * weights[:, :, None, None]
        else:  # pixels outside the cue's footprint get the midpoint tint, whatever a
            plain = tints.mean(axis=0) + draw
            out = gray * np.where(cue_mask(cue_pixels), weights[:, :, None, None], plain[:, :, None, None])
    elif spurious == "marker":
        out = gray.copy()
        values = cue_gap + noise * rng.standard_normal(n)
        for attr in (0, 1):
            rows = np.flatnonzero(a == attr)
            pixels = (MARKERS[attr],) if cue_pixels == 0 else MARKER_PIXELS[attr][:cue_pixels]
            for row, col in pixels:
                out[rows, :, row, col] = values[rows, None]
    elif spurious == "background":
        out = gray.copy()
        bands = levels(np.asarray(BACKGROUND)[:, None], cue_gap)[:, 0]
        level = bands[a][:, None, None]
        if cue_pixels != 0:
            level = np.where(cue_mask(cue_pixels), level, bands.mean())
        background = level + BACKGROUND_NOISE_GAIN * noise * rng.standard_normal((n, 8, 8))
        # The stroke occludes the background: alpha-composite with the ink as alpha.
        out[:, 2] = images + (1.0 - images) * background
    else:
        raise ValueError(f"unknown spurious form '{spurious}'")
    if pixel_noise > 0:
        out = out + pixel_noise * rng.standard_normal(out.shape)
    return np.clip(out, 0.0, 1.0)


TEST_SPLITS = ("test_id", "test_ood")


def test_copies(split: np.ndarray, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """(image index, round) of every row in id order: each image in round 0, then rounds
    1..repeats−1 of the test_id and test_ood images."""
    test = np.flatnonzero(np.isin(split, TEST_SPLITS))
    source = np.concatenate([np.arange(len(split)), *([test] * (repeats - 1))])
    rounds = np.concatenate([np.zeros(len(split), np.int64), *(np.full(len(test), r, np.int64) for r in range(1, repeats))])
    return source, rounds


def generate(cfg: ColoredDigitsConfig) -> Generated:
    """All four splits, rows ordered by split (train, val, test_id, test_ood) then id.

    One stream `default_rng(seed)` draws, in order: the split permutation, the attribute
    permutation, then the cue noise for every image in id order (and, when pixel_noise > 0,
    the per-value noise after it). The test copies of test_repeats > 1 (rounds 1..) draw their
    attribute permutations and noise from a second stream, `default_rng([seed, 1])`, so train
    and val are the same bytes whatever test_repeats is.
    """
    images, digits = load_images()
    y = (digits < 5).astype(np.int64)
    rng = np.random.default_rng(cfg.seed)
    copies_rng = np.random.default_rng([cfg.seed, 1])
    split = assign_splits(y, cfg, rng)
    # rows in id order: every image once (round 0), then each further round's test images
    source, rounds = test_copies(split, cfg.test_repeats)
    ids = rounds * len(images) + source
    images, y, split = images[source], y[source], split[source]
    a = assign_attributes(y, split, cfg, rng, rounds, copies_rng)
    x = np.empty((len(y), int(np.prod(SHAPE))), dtype=np.float32)
    for rows, stream in ((rounds == 0, rng), (rounds > 0, copies_rng)):
        x[rows] = render(
            images[rows], a[rows], cfg.spurious, cfg.spurious_noise, stream, cfg.cue_gap, cfg.cue_pixels, cfg.pixel_noise
        ).reshape(int(rows.sum()), x.shape[1])
    rank = {name: i for i, name in enumerate(SPLITS)}
    order = np.lexsort((ids, np.array([rank[s] for s in split])))
    columns = {
        "id": ids[order].astype(np.int64),
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
    if cfg.test_repeats > 1:  # copies of one image share id mod this: the report resamples them as one item
        meta["source_item_modulus"] = int((rounds == 0).sum())
    return columns, meta


register_dataset("colored_digits", ColoredDigitsConfig, generate=generate)
