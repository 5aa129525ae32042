"""The one config loader: a stage's own section of params.yaml, validated against a typed schema.

`conf/` (Hydra groups) is composed by DVC into `params.yaml`; stages never read `conf/`.
Each stage asks for its section (`dataset.gaussian_shortcut`, `method.erm`, ...), which is
merged into the section's dataclass: an unknown key, a wrong type or an out-of-range value
raises `ConfigError` naming the full key before any work starts.

    python -m stages.config check      # validate the whole params.yaml
    python -m stages.config compose    # regenerate params.yaml from conf/ (as `dvc exp run` does)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")
PARAMS = Path("params.yaml")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def _help(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": text})
    return field(default=default, metadata={"help": text}, **kw)


class _Checks:
    """Collects range checks; `key` is relative to the section."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def require(self, ok: bool, key: str, msg: str) -> None:
        if not ok:
            self.errors.append((key, msg))

    def prob(self, value: float, key: str) -> None:
        self.require(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value}")

    def positive(self, value: float, key: str) -> None:
        self.require(value > 0, key, f"must be > 0, got {value}")

    def non_negative(self, value: float, key: str) -> None:
        self.require(value >= 0, key, f"must be >= 0, got {value}")

    def choice(self, value: str, key: str, options: Sequence[str]) -> None:
        self.require(value in options, key, f"must be one of {list(options)}, got '{value}'")

    def minibatch(self, cfg: Any) -> None:
        """The optimisation keys every minibatch-trained section shares: lr, epochs and
        batch_size, and weight_decay and selection where the section has them."""
        self.positive(cfg.lr, "lr")
        if hasattr(cfg, "weight_decay"):
            self.non_negative(cfg.weight_decay, "weight_decay")
        self.require(cfg.epochs >= 1, "epochs", f"must be >= 1, got {cfg.epochs}")
        self.require(cfg.batch_size >= 1, "batch_size", f"must be >= 1, got {cfg.batch_size}")
        if hasattr(cfg, "selection"):
            self.choice(cfg.selection, "selection", SELECTIONS)


# ---- schemas ------------------------------------------------------------------------------


@dataclass
class GaussianShortcutConfig:
    """Two classes y∈{±1}: core feature N(y, σ²), spurious feature ±B agreeing with y w.p. ρ."""

    kind: str = _help("dataset generator", "gaussian_shortcut")
    seed: int = _help("generator seed", 0)
    sigma: float = _help("std of the core feature around ±1", 1.0)
    spurious_scale: float = _help("B: the spurious feature is ±B (plus noise)", 1.0)
    spurious_noise: float = _help("std of the noise added to the spurious feature", 0.2)
    rho_train: float = _help("P(spurious sign agrees with y) in train, val and test_id", 0.95)
    rho_ood: float = _help("P(spurious sign agrees with y) in test_ood", 0.05)
    d_noise: int = _help("number of pure-noise N(0,1) dimensions", 8)
    n_train: int = _help("train examples", 4000)
    n_val: int = _help("validation examples", 1000)
    n_test_id: int = _help("in-distribution test examples", 2000)
    n_test_ood: int = _help("shifted test examples", 2000)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["gaussian_shortcut"])
        c.positive(self.sigma, "sigma")
        c.non_negative(self.spurious_scale, "spurious_scale")
        c.non_negative(self.spurious_noise, "spurious_noise")
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.non_negative(self.d_noise, "d_noise")
        for k in ("n_train", "n_val", "n_test_id", "n_test_ood"):
            c.require(getattr(self, k) >= 8, k, f"must be >= 8, got {getattr(self, k)}")


@dataclass
class ColoredDigitsConfig:
    """scikit-learn's 8×8 digits, y = digit < 5, with a spurious attribute agreeing with y w.p. ρ."""

    kind: str = _help("dataset generator", "colored_digits")
    seed: int = _help("split/attribute seed", 0)
    rho_train: float = _help("P(attribute == label) in train, val and test_id", 0.95)
    rho_ood: float = _help("P(attribute == label) in test_ood (0.05 = reversed)", 0.05)
    spurious: str = _help("form of the spurious cue: color | marker | background", "color")
    spurious_noise: float = _help("std of the noise on the spurious cue (0 = exact)", 0.1)
    val_frac: float = _help("fraction of images in val", 0.15)
    test_id_frac: float = _help("fraction of images in test_id", 0.15)
    test_ood_frac: float = _help("fraction of images in test_ood", 0.2)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["colored_digits"])
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.choice(self.spurious, "spurious", ["color", "marker", "background"])
        c.non_negative(self.spurious_noise, "spurious_noise")
        for k in ("val_frac", "test_id_frac", "test_ood_frac"):
            c.require(0 < getattr(self, k) < 1, k, f"must be in (0, 1), got {getattr(self, k)}")
        total = self.val_frac + self.test_id_frac + self.test_ood_frac
        c.require(total < 0.9, "val_frac", f"val+test fractions must leave >= 10% for train, got {total}")


@dataclass
class Mnist1DShortcutConfig:
    """MNIST-1D (generated offline by `mnist1d`), y = digit < 5, a marker agreeing with y w.p. ρ."""

    kind: str = _help("dataset generator", "mnist1d_shortcut")
    seed: int = _help("seed of the signals, splits, attributes and marker noise", 0)
    num_samples: int = _help("MNIST-1D examples generated (split over train/val/test_id/test_ood)", 4000)
    rho_train: float = _help("P(attribute == label) in train, val and test_id", 0.95)
    rho_ood: float = _help("P(attribute == label) in test_ood", 0.05)
    spurious_scale: float = _help("marker height: ±scale added to the first marker_width samples", 1.0)
    spurious_noise: float = _help("std of the noise on the marker", 0.1)
    marker_width: int = _help("how many leading samples of the 40 carry the marker", 4)
    val_frac: float = _help("fraction of examples in val", 0.15)
    test_id_frac: float = _help("fraction of examples in test_id", 0.15)
    test_ood_frac: float = _help("fraction of examples in test_ood", 0.2)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["mnist1d_shortcut"])
        c.require(self.num_samples >= 200, "num_samples", f"must be >= 200, got {self.num_samples}")
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.non_negative(self.spurious_scale, "spurious_scale")
        c.non_negative(self.spurious_noise, "spurious_noise")
        c.require(1 <= self.marker_width <= 40, "marker_width", f"must be in 1..40, got {self.marker_width}")
        _check_fracs(c, self.val_frac, self.test_id_frac, self.test_ood_frac)


@dataclass
class ShortcutTextConfig:
    """Templated sentences, label = polarity of the content (with negation), plus a marker word agreeing w.p. ρ."""

    kind: str = _help("dataset generator", "shortcut_text")
    seed: int = _help("generator seed", 0)
    rho_train: float = _help("P(marker word == label's marker) in train, val and test_id", 0.95)
    rho_ood: float = _help("P(marker word == label's marker) in test_ood", 0.05)
    negation_rate: float = _help("fraction of sentences whose adjective is negated ('not'), flipping its polarity", 0.2)
    vocab_size: int = _help("most frequent train words kept as bag-of-words features in x", 256)
    n_train: int = _help("train examples", 2000)
    n_val: int = _help("validation examples", 500)
    n_test_id: int = _help("in-distribution test examples", 500)
    n_test_ood: int = _help("shifted test examples", 500)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["shortcut_text"])
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.require(0 <= self.negation_rate < 0.5, "negation_rate", f"must be in [0, 0.5), got {self.negation_rate}")
        c.require(self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")
        for k in ("n_train", "n_val", "n_test_id", "n_test_ood"):
            c.require(getattr(self, k) >= 8, k, f"must be >= 8, got {getattr(self, k)}")


BAD_IMAGE = ("error", "skip")


@dataclass
class WaterbirdsConfig:
    """Waterbirds (waterbird_complete95_forest2water2) from data/raw: y = waterbird, a = water background."""

    kind: str = _help("dataset loader", "waterbirds")
    root: str = _help("folder holding metadata.csv and the image folders", "data/raw/waterbirds")
    seed: int = _help("seed of the test_id split carved from train", 0)
    resolution: int = _help("images are resized (shorter side) and centre-cropped to resolution²", 32)
    test_id_frac: float = _help("fraction of the official train split moved to test_id, per group", 0.1)
    on_bad_image: str = _help("an image that fails to decode: error | skip (counted in the metadata)", "error")
    workers: int = _help("decoding processes (0 = one per core)", 0)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["waterbirds"])
        _check_images(c, self.resolution, self.on_bad_image, self.workers)
        c.require(0 < self.test_id_frac < 0.5, "test_id_frac", f"must be in (0, 0.5), got {self.test_id_frac}")


@dataclass
class CelebAConfig:
    """CelebA from data/raw (attribute + partition CSVs): y = target attribute, a = spurious attribute."""

    kind: str = _help("dataset loader", "celeba")
    root: str = _help("folder holding list_attr_celeba.csv, list_eval_partition.csv, img_align_celeba/", "data/raw/celeba")
    target: str = _help("attribute column used as the label y", "Blond_Hair")
    attribute: str = _help("attribute column used as the spurious attribute a", "Male")
    seed: int = _help("seed of the test_id / test_ood split of the official test split", 0)
    resolution: int = _help("images are resized (shorter side) and centre-cropped to resolution²", 32)
    test_ood_frac: float = _help("fraction of the official test split (per group) from which the group-balanced test_ood is drawn", 0.5)
    on_bad_image: str = _help("an image that fails to decode: error | skip (counted in the metadata)", "error")
    workers: int = _help("decoding processes (0 = one per core)", 0)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["celeba"])
        _check_images(c, self.resolution, self.on_bad_image, self.workers)
        c.require(self.target != self.attribute, "attribute", f"must differ from target '{self.target}'")
        c.require(0 < self.test_ood_frac < 1, "test_ood_frac", f"must be in (0, 1), got {self.test_ood_frac}")


@dataclass
class Camelyon17Config:
    """Camelyon17 patches (WILDS v1.0) from data/raw: y = tumor, a = hospital (center); test_ood = held-out centers."""

    kind: str = _help("dataset loader", "camelyon17")
    root: str = _help("folder holding metadata.csv and patches/", "data/raw/camelyon17")
    train_centers: list[int] = _help("hospitals of train, val and test_id (WILDS: 0, 3, 4)", [0, 3, 4])
    test_ood_centers: list[int] = _help("held-out hospitals of test_ood (WILDS test: 2); other centers are unused", [2])
    seed: int = _help("seed of the test_id split carved from train", 0)
    resolution: int = _help("patches (96²) are resized to resolution²", 32)
    test_id_frac: float = _help("fraction of the train-center train split moved to test_id, per group", 0.1)
    on_bad_image: str = _help("an image that fails to decode: error | skip (counted in the metadata)", "error")
    workers: int = _help("decoding processes (0 = one per core)", 0)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["camelyon17"])
        _check_images(c, self.resolution, self.on_bad_image, self.workers)
        c.require(0 < self.test_id_frac < 0.5, "test_id_frac", f"must be in (0, 0.5), got {self.test_id_frac}")
        for key in ("train_centers", "test_ood_centers"):
            centers = getattr(self, key)
            c.require(len(centers) > 0 and all(0 <= x <= 4 for x in centers), key, f"must be non-empty, centers 0..4, got {centers}")
        both = set(self.train_centers) & set(self.test_ood_centers)
        c.require(not both, "test_ood_centers", f"overlaps train_centers: {sorted(both)}")


@dataclass
class CivilCommentsConfig:
    """CivilComments (WILDS CSV) from data/raw: y = toxic, a = any configured identity mentioned."""

    kind: str = _help("dataset loader", "civilcomments")
    root: str = _help("folder holding all_data_with_identities.csv", "data/raw/civilcomments")
    identities: list[str] = _help(
        "identity columns; a = 1 when any is >= threshold",
        ["male", "female", "LGBTQ", "christian", "muslim", "other_religions", "black", "white"],
    )
    threshold: float = _help("toxicity and identity scores >= threshold count as 1", 0.5)
    seed: int = _help("seed of the test_id / test_ood split of the official test split", 0)
    test_ood_frac: float = _help("fraction of the official test split (per group) from which the group-balanced test_ood is drawn", 0.5)
    vocab_size: int = _help("most frequent train words kept as bag-of-words features in x", 512)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["civilcomments"])
        c.require(len(self.identities) > 0, "identities", "must not be empty")
        c.prob(self.threshold, "threshold")
        c.require(0 < self.test_ood_frac < 1, "test_ood_frac", f"must be in (0, 1), got {self.test_ood_frac}")
        c.require(self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")


def _check_images(c: _Checks, resolution: int, on_bad_image: str, workers: int) -> None:
    c.require(4 <= resolution <= 512, "resolution", f"must be in 4..512, got {resolution}")
    c.choice(on_bad_image, "on_bad_image", BAD_IMAGE)
    c.non_negative(workers, "workers")


def _check_fracs(c: _Checks, *fracs: float) -> None:
    for k, v in zip(("val_frac", "test_id_frac", "test_ood_frac"), fracs, strict=True):
        c.require(0 < v < 1, k, f"must be in (0, 1), got {v}")
    c.require(sum(fracs) < 0.9, "val_frac", f"val+test fractions must leave >= 10% for train, got {sum(fracs)}")


DATASET_SCHEMAS: dict[str, type] = {
    "gaussian_shortcut": GaussianShortcutConfig,
    "colored_digits": ColoredDigitsConfig,
    "mnist1d_shortcut": Mnist1DShortcutConfig,
    "shortcut_text": ShortcutTextConfig,
    "waterbirds": WaterbirdsConfig,
    "celeba": CelebAConfig,
    "camelyon17": Camelyon17Config,
    "civilcomments": CivilCommentsConfig,
}

SELECTIONS = ("val_avg", "val_worst_group", "oracle")
# The split each criterion scores (the metric is in stages.models.training.SELECTION_METRIC).
SELECTION_SPLIT = {"val_avg": "val", "val_worst_group": "val", "oracle": "test_ood"}


def train_and_selection_splits(selection: str) -> tuple[str, ...]:
    """What a minibatch-trained method reads: train, and the split its selection criterion scores."""
    return tuple(dict.fromkeys(("train", SELECTION_SPLIT.get(selection, "val"))))


@dataclass
class ErmConfig:
    """Empirical risk minimisation with an MLP."""

    kind: str = _help("method family", "erm")
    init: str = _help("scratch | pretrained (encoder from the pretrain stage)", "scratch")
    hidden: list[int] = _help("hidden layer widths (ignored with init=pretrained)", [64])
    lr: float = _help("Adam learning rate", 1e-3)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    epochs: int = _help("training epochs", 30)
    batch_size: int = _help("minibatch size", 128)
    selection: str = _help("checkpoint selection: val_avg | val_worst_group | oracle", "val_worst_group")

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split."""
        return train_and_selection_splits(self.selection)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))
        c.choice(self.init, "init", ["scratch", "pretrained"])
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.minibatch(self)


@dataclass
class GroupDROConfig(ErmConfig):
    """Group DRO (Sagawa et al. 2020): exponentiated-gradient weights on the worst groups."""

    kind: str = _help("method family", "groupdro")
    eta: float = _help("step size of the group-weight update", 0.1)

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.positive(self.eta, "eta")


@dataclass
class ReweightConfig(ErmConfig):
    """Cross-entropy with weights ∝ 1/frequency, so every class (or group) of train weighs the same."""

    kind: str = _help("method family", "reweight")
    balance: str = _help("what the inverse-frequency weights balance: class | group", "group")

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.choice(self.balance, "balance", ["class", "group"])


@dataclass
class JTTConfig(ErmConfig):
    """Just Train Twice: an ERM run's train errors get weight λ in a second run of the same backbone."""

    kind: str = _help("method family", "jtt")
    id_epochs: int = _help("epochs of the ERM identification run (its last epoch is used)", 2)
    upweight: float = _help("λ: loss weight of the identification run's train errors (1 = plain ERM)", 20.0)

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.require(self.id_epochs >= 1, "id_epochs", f"must be >= 1, got {self.id_epochs}")
        c.require(self.upweight >= 1, "upweight", f"must be >= 1 (1 = plain ERM), got {self.upweight}")


@dataclass
class ProbeConfig(ErmConfig):
    """Linear probe: the pretrained encoder frozen, a linear head trained on train (hidden is ignored)."""

    kind: str = _help("method family", "probe")
    init: str = _help("must be pretrained: the frozen encoder comes from the pretrain stage", "pretrained")

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.require(self.init == "pretrained", "init", f"a linear probe needs init 'pretrained', got '{self.init}'")


@dataclass
class DFRConfig:
    """Deep feature reweighting: logistic regression on the pretrained embeddings of a
    group-balanced half of val; C tuned on the other half. Reads val rows only (plus test_ood
    under the oracle selection)."""

    kind: str = _help("method family", "dfr")
    c_grid: list[float] = _help("inverse L2 regularisation strengths C to try", [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0])
    balance: str = _help("group balance of the fit half: subsample (DFR paper) | weight (all rows, 1/group-count weights)", "subsample")
    n_fits: int = _help("with balance=subsample: balanced subsamples whose heads are averaged", 10)
    selection: str = _help("C chosen by: val_worst_group | val_avg (tune half) | oracle (test_ood)", "val_worst_group")

    def reads_splits(self) -> tuple[str, ...]:
        """val only (test_ood too under the oracle criterion)."""
        return ("val", "test_ood") if self.selection == "oracle" else ("val",)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))
        c.require(len(self.c_grid) > 0 and all(v > 0 for v in self.c_grid), "c_grid", f"needs values > 0, got {self.c_grid}")
        c.choice(self.balance, "balance", ["subsample", "weight"])
        c.require(self.n_fits >= 1, "n_fits", f"must be >= 1, got {self.n_fits}")
        c.choice(self.selection, "selection", SELECTIONS)


@dataclass
class LDAConfig:
    """Generative classifier: class-conditional Gaussians with a shared, shrunk covariance."""

    kind: str = _help("method family", "lda")
    shrinkage: float = _help("covariance shrinkage towards a scaled identity, in [0, 1]", 0.1)

    def reads_splits(self) -> tuple[str, ...]:
        """Fitted in closed form on train."""
        return ("train",)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))
        c.prob(self.shrinkage, "shrinkage")


@dataclass
class QDAConfig(LDAConfig):
    """Generative classifier: class-conditional Gaussians, one shrunk covariance per class."""

    kind: str = _help("method family", "qda")
    shrinkage: float = _help("per-class covariance shrinkage towards a scaled identity, in [0, 1]", 0.1)


@dataclass
class _GenerativeFit:
    """Optimisation and selection keys shared by the trained generative classifiers."""

    kind: str = _help("method family", "")
    lr: float = _help("AdamW learning rate", 2e-3)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    epochs: int = _help("training epochs", 40)
    batch_size: int = _help("minibatch size", 128)
    selection: str = _help("checkpoint selection: val_avg | val_worst_group | oracle", "val_worst_group")
    eval_every: int = _help("score the splits (for selection and history) every N epochs and at the last", 10)

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split."""
        return train_and_selection_splits(self.selection)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))  # type: ignore[attr-defined]
        c.minibatch(self)
        c.require(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")


@dataclass
class DiffusionConfig(_GenerativeFit):
    """Class-conditional DDPM classifier: class score = −mean w(t)·‖ε_θ(x_t, t, y) − ε‖² + log prior."""

    kind: str = _help("method family", "diffusion")
    denoiser: str = _help("auto (conv for C×H×W data, else mlp) | mlp | conv", "auto")
    width: int = _help("hidden width of the mlp denoiser", 128)
    channels: int = _help("channels of the conv denoiser", 32)
    depth: int = _help("residual hidden layers of the denoiser", 2)
    steps: int = _help("T: diffusion timesteps", 100)
    schedule: str = _help("noise schedule: cosine | linear", "cosine")
    class_dropout: float = _help("P(label replaced by the null class) in training (classifier-free), in [0, 1)", 0.0)
    weighting: str = _help("score weighting w(t): simple (1) | elbo", "simple")
    draws: int = _help("(t, ε) draws per example when scoring, shared by every class", 32)
    select_draws: int = _help("draws per example when scoring the splits for checkpoint selection", 8)
    prune_keep: int = _help("adaptive pruning: classes kept after the first prune_draws draws (0 = off)", 0)
    prune_draws: int = _help("draws that score every class before pruning", 8)
    score_seed: int = _help("seed of the scoring draws (scores depend only on it, the model and x)", 0)
    score_rows: int = _help("denoiser rows per scoring forward pass (memory; fixes the draw chunks)", 8192)

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.choice(self.denoiser, "denoiser", ["auto", "mlp", "conv"])
        c.require(self.width >= 1, "width", f"must be >= 1, got {self.width}")
        c.require(self.channels >= 1, "channels", f"must be >= 1, got {self.channels}")
        c.require(self.depth >= 0, "depth", f"must be >= 0, got {self.depth}")
        c.require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        c.choice(self.schedule, "schedule", ["cosine", "linear"])
        c.require(0 <= self.class_dropout < 1, "class_dropout", f"must be in [0, 1), got {self.class_dropout}")
        c.choice(self.weighting, "weighting", ["simple", "elbo"])
        c.require(self.draws >= 1, "draws", f"must be >= 1, got {self.draws}")
        c.require(self.select_draws >= 1, "select_draws", f"must be >= 1, got {self.select_draws}")
        c.require(self.prune_keep >= 0, "prune_keep", f"must be >= 0 (0 = no pruning), got {self.prune_keep}")
        if self.prune_keep:
            c.require(1 <= self.prune_draws < self.draws, "prune_draws",
                      f"must be in [1, draws={self.draws}) when prune_keep > 0, got {self.prune_draws}")
        c.require(self.score_rows >= 1, "score_rows", f"must be >= 1, got {self.score_rows}")

    def check_data(self, key: str, n_classes: int) -> None:
        """Checks that need the dataset: pruning must keep fewer classes than there are."""
        if self.prune_keep and self.prune_keep >= n_classes:
            raise ConfigError(
                f"params.yaml: {key}.prune_keep: must be < the dataset's n_classes ({n_classes}) "
                f"when pruning, got {self.prune_keep}"
            )


@dataclass
class AutoregressiveConfig(_GenerativeFit):
    """Class-conditional causal transformer over quantised features: class score = Σ log p(token | prefix, y) + log prior."""

    kind: str = _help("method family", "autoregressive")
    bins: int = _help("quantisation bins per feature (the token vocabulary)", 16)
    bin_edges: str = _help("bin edges per feature: quantile (train quantiles) | uniform (over the train range)", "quantile")
    d_model: int = _help("transformer width", 32)
    layers: int = _help("transformer blocks", 2)
    heads: int = _help("attention heads (must divide d_model)", 2)
    ff: int = _help("hidden width of each block's MLP", 64)
    input: str = _help("tokens from: auto (text when the dataset has a text column, else x) | x (quantised features) | text (UTF-8 bytes)", "auto")
    max_len: int = _help("text input: byte tokens per example incl. the end token (longer text is truncated)", 64)

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.choice(self.input, "input", ["auto", "x", "text"])
        c.require(self.max_len >= 2, "max_len", f"must be >= 2, got {self.max_len}")
        c.require(self.bins >= 2, "bins", f"must be >= 2, got {self.bins}")
        c.choice(self.bin_edges, "bin_edges", ["quantile", "uniform"])
        c.require(self.d_model >= 1, "d_model", f"must be >= 1, got {self.d_model}")
        c.require(self.layers >= 1, "layers", f"must be >= 1, got {self.layers}")
        c.require(self.heads >= 1 and self.d_model % max(self.heads, 1) == 0, "heads",
                  f"must be >= 1 and divide d_model={self.d_model}, got {self.heads}")
        c.require(self.ff >= 1, "ff", f"must be >= 1, got {self.ff}")


@dataclass
class TextErmConfig:
    """Discriminative text baseline: ERM of a bag-of-embeddings classifier over the word tokens of
    a text dataset's `text` column (vocabulary from the train split); needs a text dataset."""

    kind: str = _help("method family", "text_erm")
    vocab_size: int = _help("most frequent train words given an embedding (others share the unknown token)", 10000)
    max_len: int = _help("word tokens read per example (longer text is truncated)", 128)
    dim: int = _help("embedding width", 32)
    hidden: list[int] = _help("ReLU layer widths between the mean embedding and the linear head ([] = linear)", [])
    lr: float = _help("AdamW learning rate", 1e-2)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    epochs: int = _help("training epochs", 20)
    batch_size: int = _help("minibatch size", 64)
    selection: str = _help("checkpoint selection: val_avg | val_worst_group | oracle", "val_worst_group")

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split."""
        return train_and_selection_splits(self.selection)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))
        c.require(self.vocab_size >= 1, "vocab_size", f"must be >= 1, got {self.vocab_size}")
        c.require(self.max_len >= 1, "max_len", f"must be >= 1, got {self.max_len}")
        c.require(self.dim >= 1, "dim", f"must be >= 1, got {self.dim}")
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.minibatch(self)


METHOD_SCHEMAS: dict[str, type] = {"erm": ErmConfig, "groupdro": GroupDROConfig, "lda": LDAConfig}
METHOD_SCHEMAS.update(reweight=ReweightConfig, jtt=JTTConfig, probe=ProbeConfig, dfr=DFRConfig)
METHOD_SCHEMAS.update(qda=QDAConfig, diffusion=DiffusionConfig, autoregressive=AutoregressiveConfig)
METHOD_SCHEMAS.update(text_erm=TextErmConfig)
# Method kinds that read the prepared `text` column, and the dataset kinds whose prepared file has one.
TEXT_METHODS = ("text_erm",)
TEXT_DATASETS = ("shortcut_text", "civilcomments")


@dataclass
class PretrainConfig:
    """Denoising autoencoder fitted on train inputs only, without labels."""

    kind: str = _help("pretraining objective", "dae")
    seed: int = _help("seed", 0)
    hidden: list[int] = _help("encoder widths; the last is the embedding size", [64])
    noise_std: float = _help("std of the Gaussian corruption", 0.3)
    lr: float = _help("Adam learning rate", 1e-3)
    epochs: int = _help("epochs", 20)
    batch_size: int = _help("minibatch size", 128)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["dae"])
        c.require(len(self.hidden) >= 1 and all(h > 0 for h in self.hidden), "hidden", f"need >= 1 width > 0, got {self.hidden}")
        c.non_negative(self.noise_std, "noise_std")
        c.minibatch(self)


@dataclass
class DistillConfig:
    """A student MLP trained on a teacher's temperature-softened predictions."""

    hidden: list[int] = _help("student hidden widths", [64])
    temperature: float = _help("softmax temperature applied to the teacher's logits", 2.0)
    alpha: float = _help("weight of the soft (teacher) loss; 1-alpha goes to the hard labels", 1.0)
    lr: float = _help("Adam learning rate", 1e-3)
    epochs: int = _help("epochs", 30)
    batch_size: int = _help("minibatch size", 128)
    selection: str = _help("checkpoint selection: val_avg | val_worst_group | oracle", "val_avg")

    def check(self, c: _Checks) -> None:
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.positive(self.temperature, "temperature")
        c.prob(self.alpha, "alpha")
        c.minibatch(self)


@dataclass
class TrainConfig:
    """Checkpoints of the minibatch training loop (scratch/checkpoints/<stage>/); outputs never depend on them."""

    checkpoint_every: int = _help("write a resumable checkpoint every N epochs (0 = only on SIGINT/SIGTERM)", 1)
    resume: bool = _help("resume from the latest valid checkpoint of the same stage, params and code", True)

    def check(self, c: _Checks) -> None:
        c.non_negative(self.checkpoint_every, "checkpoint_every")


@dataclass
class ValidateConfig:
    """Great Expectations suite thresholds."""

    min_group_count: int = _help("minimum examples of every group in val, test_id and test_ood", 3)
    rho_tolerance: float = _help("allowed |observed - configured| train agreement rate", 0.05)
    min_shift: float = _help("test_ood agreement must differ from train's by at least this", 0.2)

    def check(self, c: _Checks) -> None:
        c.require(self.min_group_count >= 1, "min_group_count", f"must be >= 1, got {self.min_group_count}")
        c.prob(self.rho_tolerance, "rho_tolerance")
        c.prob(self.min_shift, "min_shift")


@dataclass
class EvaluateConfig:
    """Evaluation settings."""

    ece_bins: int = _help("equal-width confidence bins for ECE and the reliability curve", 15)
    batch_size: int = _help("examples scored per forward pass", 2048)
    bootstrap_resamples: int = _help("bootstrap resamples for 95% intervals and paired tests (0 = none)", 1000)
    bootstrap_seed: int = _help("seed of the bootstrap resampling", 0)
    shift_steps: int = _help("points of the shift curve, training agreement to fully reversed", 11)
    shift_regenerate_n: int = _help("examples drawn per shift step for generated datasets (0 = off)", 1000)

    def check(self, c: _Checks) -> None:
        c.require(self.ece_bins >= 1, "ece_bins", f"must be >= 1, got {self.ece_bins}")
        c.require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        c.non_negative(self.bootstrap_resamples, "bootstrap_resamples")
        c.require(self.shift_steps >= 2, "shift_steps", f"must be >= 2, got {self.shift_steps}")
        c.require(
            self.shift_regenerate_n == 0 or self.shift_regenerate_n >= 8,
            "shift_regenerate_n",
            f"must be 0 or >= 8, got {self.shift_regenerate_n}",
        )


PHASE_KNOBS = ("sigma", "spurious_scale", "rho_train", "d_noise", "n_train")


@dataclass
class PhasePanel:
    """One heatmap of the phase diagram: two gaussian_shortcut knobs on the axes."""

    x: str = _help("knob on the x axis (one of PHASE_KNOBS)", "n_train")
    x_values: list[float] = _help("values of the x knob", [])
    y: str = _help("knob on the y axis (one of PHASE_KNOBS)", "spurious_scale")
    y_values: list[float] = _help("values of the y knob", [])


@dataclass
class PhaseConfig:
    """experiment=toy_phase_diagram: lda vs logistic regression over gaussian_shortcut knobs.

    Every panel sweeps two knobs with the others at `base`; no panels = nothing to compute.
    """

    panels: list[PhasePanel] = field(default_factory=list, metadata={"help": "heatmaps to compute (empty = none)"})
    base: GaussianShortcutConfig = field(default_factory=GaussianShortcutConfig, metadata={"help": "the other knobs"})
    seeds: list[int] = _help("data/training seeds per cell; the cell reports the mean", [0])
    shrinkage: float = _help("LDA covariance shrinkage", 0.1)
    lr: float = _help("logistic regression: Adam learning rate", 0.01)
    epochs: int = _help("logistic regression: epochs", 30)
    batch_size: int = _help("logistic regression: minibatch size", 128)
    weight_decay: float = _help("logistic regression: AdamW weight decay", 0.0)
    selection: str = _help("logistic regression: checkpoint selection", "val_avg")

    def check(self, c: _Checks) -> None:
        for i, p in enumerate(self.panels):
            for axis in ("x", "y"):
                c.choice(getattr(p, axis), f"panels[{i}].{axis}", PHASE_KNOBS)
                c.require(len(getattr(p, f"{axis}_values")) >= 1, f"panels[{i}].{axis}_values", "must not be empty")
            c.require(p.x != p.y, f"panels[{i}]", f"x and y must be different knobs, both are '{p.x}'")
        base = _Checks()
        self.base.check(base)
        c.errors += [(f"base.{k}", m) for k, m in base.errors]
        c.require(len(self.seeds) >= 1, "seeds", "must not be empty")
        c.prob(self.shrinkage, "shrinkage")
        c.minibatch(self)


@dataclass
class RunConfig:
    """What `dvc repro` runs: the matrix over datasets × methods × seeds."""

    datasets: list[str] = _help("datasets to prepare (names under `dataset`)", ["gaussian_shortcut", "colored_digits"])
    methods: list[str] = _help("methods to train (names under `method`)", ["erm", "lda", "groupdro"])
    teachers: list[str] = _help("methods distilled into a student named <teacher>_student", ["lda"])
    models: list[str] = _help("models to evaluate: methods and <teacher>_student names", ["erm", "lda", "groupdro", "lda_student"])
    seeds: list[int] = _help("training seeds", [0])

    def check(self, c: _Checks) -> None:
        for key in ("datasets", "methods", "models", "seeds"):
            c.require(len(getattr(self, key)) > 0, key, "must not be empty")
            values = getattr(self, key)
            c.require(len(set(values)) == len(values), key, f"has duplicates: {values}")
        for t in self.teachers:
            c.require(t in self.methods, "teachers", f"teacher '{t}' is not in run.methods {self.methods}")
        producible = set(self.methods) | {student_name(t) for t in self.teachers}
        for m in self.models:
            c.require(m in producible, "models", f"'{m}' is neither a trained method nor a student of run.teachers")
        for m in self.methods:
            c.require(m in self.models, "models", f"trained method '{m}' is not evaluated; add it to run.models")


def student_name(teacher: str) -> str:
    """The model name of the student distilled from `teacher`."""
    return f"{teacher}_student"


# ---- loading --------------------------------------------------------------------------------


def load_params(path: str | Path = PARAMS, overrides: Sequence[str] = ()) -> DictConfig:
    """Read params.yaml and apply `key=value` overrides (the hand-run path)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: not found (run `make params` to compose it from conf/)")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in many classes
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    for ov in overrides:
        if "=" not in ov or ov.startswith("="):
            raise ConfigError(f"override '{ov}': expected key=value")
        key, value = ov.split("=", 1)
        key = key.lstrip("+")
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__" and not ov.startswith("+"):
            raise ConfigError(f"override '{ov}': unknown key '{key}' (prefix with + to add a new key)")
        try:
            OmegaConf.update(cfg, key, OmegaConf.create({"v": _parse_value(value)}).v, merge=False, force_add=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"override '{ov}': {e.msg if hasattr(e, 'msg') else e}") from e
    return cfg


def _parse_value(text: str) -> Any:
    """Parse an override value the way Hydra does for plain values (YAML scalars and lists)."""
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def section(params: DictConfig, key: str, schema: type[T]) -> T:
    """Validate `params[key]` against `schema`; errors name the full key."""
    node = OmegaConf.select(params, key)
    if node is None:
        raise ConfigError(f"params.yaml: missing section '{key}'")
    if not isinstance(node, DictConfig):
        raise ConfigError(f"params.yaml: '{key}' must be a mapping, got {type(node).__name__}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        sub = getattr(e, "full_key", "") or ""
        reason = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"params.yaml: {key}{'.' + sub if sub else ''}: {reason}") from None
    checks = _Checks()
    obj.check(checks)  # type: ignore[attr-defined]
    if checks.errors:
        lines = [f"params.yaml: {key}.{k}: {m}" for k, m in checks.errors]
        raise ConfigError("\n".join(lines))
    return obj


def dataset_config(params: DictConfig, name: str) -> Any:
    """The validated config of dataset `name` (schema chosen by its `kind`)."""
    kind = _kind(params, f"dataset.{name}", DATASET_SCHEMAS)
    return section(params, f"dataset.{name}", DATASET_SCHEMAS[kind])


def method_config(params: DictConfig, name: str) -> Any:
    """The validated config of method `name` (schema chosen by its `kind`)."""
    kind = _kind(params, f"method.{name}", METHOD_SCHEMAS)
    return section(params, f"method.{name}", METHOD_SCHEMAS[kind])


def _kind(params: DictConfig, key: str, schemas: dict[str, type]) -> str:
    node = OmegaConf.select(params, key)
    if node is None:
        parent = OmegaConf.select(params, key.rsplit(".", 1)[0])
        known = list(parent.keys()) if isinstance(parent, DictConfig) else []
        raise ConfigError(f"params.yaml: no section '{key}' (known: {known})")
    kind = node.get("kind") if isinstance(node, DictConfig) else None
    if kind not in schemas:
        raise ConfigError(f"params.yaml: {key}.kind: must be one of {list(schemas)}, got '{kind}'")
    return str(kind)


def check_all(params: DictConfig) -> RunConfig:
    """Validate every section `dvc repro` will read; raises on the first section with errors."""
    run = section(params, "run", RunConfig)
    datasets = {name: dataset_config(params, name) for name in run.datasets}
    for name in run.methods:
        cfg = method_config(params, name)
        # The train matrix runs every method on every dataset: a text method needs text everywhere.
        for dataset, dcfg in datasets.items():
            check_text_input(name, cfg, dataset, dcfg.kind)
    for key, schema in (("pretrain", PretrainConfig), ("distill", DistillConfig), ("train", TrainConfig), ("validate", ValidateConfig), ("evaluate", EvaluateConfig), ("phase", PhaseConfig)):
        section(params, key, schema)
    return run


def check_text_input(method: str, cfg: Any, dataset: str, dataset_kind: str | None, has_text: bool | None = None) -> None:
    """ConfigError when method `method` (config `cfg`) reads text and dataset `dataset` has none.

    `has_text` (known once the prepared file is read) overrides the guess from `dataset_kind`.
    """
    if cfg.kind not in TEXT_METHODS:
        return
    if has_text is None:
        has_text = dataset_kind in TEXT_DATASETS
    if not has_text:
        raise ConfigError(
            f"params.yaml: method.{method} (kind {cfg.kind}) reads the prepared `text` column, but dataset "
            f"'{dataset}' (kind {dataset_kind}) has none; run it on a text dataset ({', '.join(TEXT_DATASETS)}), "
            f"e.g. `dvc exp run -S experiment=shortcut_text`"
        )


def describe(schema: type, prefix: str) -> str:
    """Human-readable list of a schema's keys, types, defaults and meaning (for --help)."""
    lines = [f"{prefix}  ({schema.__doc__.strip() if schema.__doc__ else schema.__name__})"]
    for f in dataclasses.fields(schema):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        lines.append(f"  {prefix}.{f.name}: {type_name} = {default!r}  — {f.metadata.get('help', '')}")
    return "\n".join(lines)


# ---- stage command lines --------------------------------------------------------------------


def stage_main(
    name: str,
    doc: str,
    positionals: Sequence[str],
    help_sections: Callable[[], str],
    run: Callable[..., str],
    argv: Sequence[str] | None = None,
) -> int:
    """Shared `main()` of every stage: parse args, load params, run, print one summary line.

    `run(params, *positionals)` returns the summary line. Config and artifact errors
    print one clear line on stderr and exit 2 without a traceback.
    """
    from stages.io import ArtifactError, StageInterrupted

    parser = argparse.ArgumentParser(
        prog=f"python -m stages.{name}",
        description=doc,
        epilog="params read:\n" + help_sections(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for p in positionals:
        parser.add_argument(p)
    parser.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides of params.yaml")
    parser.add_argument("--params", default=str(PARAMS), help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params, args.overrides)
        summary = run(params, *[getattr(args, p) for p in positionals])
    except (ConfigError, ArtifactError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except StageInterrupted as e:  # stopped cleanly, resumable (see stages/checkpoint.py)
        print(f"{name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every output is written atomically, so none is half-written", file=sys.stderr)
        return 130
    print(f"{name}: {summary}")
    return 0


def compose(config_dir: str | Path = "conf", output: str | Path = PARAMS, overrides: Sequence[str] = ()) -> Path:
    """Compose conf/ into params.yaml exactly as `dvc exp run` does (DVC's own function)."""
    from dvc.utils.hydra import compose_and_dump
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose_and_dump(Path(output), str(Path(config_dir).resolve()), None, "config", str(Path.cwd()), list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"{config_dir}/ with overrides {list(overrides)}: {_one_line(e)}") from None
    return Path(output)


def _one_line(e: Exception) -> str:
    """A Hydra error on one line: its message and the options it lists, without the search path."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keep = []
    for ln in lines:
        if ln.startswith("Config search path"):
            break
        keep.append(ln)
    return " ".join(keep) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "compose", "show"])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--params", default=str(PARAMS))
    args = parser.parse_args(argv)
    try:
        if args.command == "compose":
            print(f"config: wrote {compose(output=args.params, overrides=args.overrides)}")
            return 0
        params = load_params(args.params, args.overrides)
        run = check_all(params)
        if args.command == "show":
            print(OmegaConf.to_yaml(params))
        print(f"config: {args.params} is valid ({len(run.datasets)} datasets × {len(run.models)} models × {len(run.seeds)} seeds)")
        return 0
    except ConfigError as e:
        print(f"config: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
