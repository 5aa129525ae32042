"""`gaussian_shortcut`: a core feature, a spurious cue over `cue_dims` features and pure noise, all Gaussian.

With y± = 2y − 1 ∈ {−1, +1}, a± = 2a − 1 and k = cue_dims:

    x[0]              = y± + N(0, sigma²)                          core feature
    x[1 : 1+k]        = a±·spurious_scale + N(0, spurious_noise²)   spurious cue, each independently
    x[1+k : 1+k+d_noise] ~ N(0, s²)                                 noise, s = noise_std
                                                                    (per_dim: noise_std/sqrt(d_noise))

a agrees with y (a == y) with probability rho_train in train/val/test_id and rho_ood in
test_ood. Because every group is a Gaussian with known mean and covariance, the population
answer of any Gaussian classifier is closed-form (`population_groups`, `population_lda`), and
so is the regime (`separation`): cue 2·spurious_scale·sqrt(k)/spurious_noise, core 2/sigma, and
the population LDA's and logistic regression's worst-group accuracies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import Generated, agreement_counts, attribute_from_agreement
from stages.evaluation.regime import closed_form


@dataclass
class GaussianShortcutConfig:
    """Two classes y∈{±1}: core feature N(y, σ²), spurious feature ±B agreeing with y w.p. ρ."""

    kind: str = option("dataset generator")
    seed: int = option("generator seed")
    sigma: float = option("std of the core feature around ±1")
    spurious_scale: float = option("B: the spurious feature is ±B (plus noise)")
    spurious_noise: float = option("std of the noise added to the spurious feature")
    rho_train: float = option("P(spurious sign agrees with y) in train, val and test_id")
    rho_ood: float = option("P(spurious sign agrees with y) in test_ood")
    d_noise: int = option("number of pure-noise dimensions (no cap: d_noise >> n_train is allowed)")
    noise_std: float = option("std of each pure-noise dimension (with noise_scaling none)")
    noise_scaling: str = option(
        "none: each noise dimension has std noise_std | per_dim: std noise_std/sqrt(d_noise), "
        "so the total noise energy stays noise_std² as d_noise grows"
    )
    cue_dims: int = option("dimensions carrying the spurious cue, each ±spurious_scale + its own noise")
    n_train: int = option("train examples")
    n_val: int = option("validation examples")
    n_test_id: int = option("in-distribution test examples")
    n_test_ood: int = option("shifted test examples")

    def check(self, c: Checks) -> None:
        c.positive(self.sigma, "sigma")
        c.non_negative(self.spurious_scale, "spurious_scale")
        c.non_negative(self.spurious_noise, "spurious_noise")
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.non_negative(self.d_noise, "d_noise")
        c.non_negative(self.noise_std, "noise_std")
        c.choice(self.noise_scaling, "noise_scaling", NOISE_SCALINGS)
        c.require(self.cue_dims >= 1, "cue_dims", f"must be >= 1, got {self.cue_dims}")
        for k in ("n_train", "n_val", "n_test_id", "n_test_ood"):
            c.require(getattr(self, k) >= 8, k, f"must be >= 8, got {getattr(self, k)}")


NOISE_SCALINGS = ("none", "per_dim")
SPLIT_SIZES = (
    ("train", "n_train"),
    ("val", "n_val"),
    ("test_id", "n_test_id"),
    ("test_ood", "n_test_ood"),
)


class GroupParams(NamedTuple):
    """One group's population: label, attribute, x ~ N(mean, cov), and its probability."""

    y: int
    a: int
    mean: np.ndarray
    cov: np.ndarray
    prob: float


def dim(cfg: GaussianShortcutConfig) -> int:
    """Length of x: core + cue + noise dimensions."""
    return 1 + cfg.cue_dims + cfg.d_noise


def cue_slice(cfg: GaussianShortcutConfig) -> slice:
    """Where the spurious cue sits in x: right after the core feature."""
    return slice(1, 1 + cfg.cue_dims)


def noise_std(cfg: GaussianShortcutConfig) -> float:
    """Std of each pure-noise dimension."""
    if cfg.noise_scaling == "per_dim" and cfg.d_noise > 0:
        return cfg.noise_std / float(np.sqrt(cfg.d_noise))
    return cfg.noise_std


def separation(cfg: GaussianShortcutConfig) -> dict[str, float | None]:
    """The regime in closed form (stages/evaluation/regime.py): Mahalanobis distance between the means of
    groups differing only in a (cue) or only in y (core), under the shared diagonal covariance,
    and the worst-group accuracies of the population LDA and logistic regression on the four
    groups at rho_train (stages/evaluation/population.py).

    The cue's means differ by 2·spurious_scale in each of cue_dims independent dimensions of std
    spurious_noise; the core's by 2 in one dimension of std sigma; noise dimensions have equal
    means and add nothing. spurious_noise 0 makes an exact cue: inf (0 when spurious_scale is 0),
    and no population rules (the groups are no Gaussians of one covariance); nor with
    rho_train 0 or 1 (two groups are empty).
    """
    gap = 2.0 * cfg.spurious_scale * float(np.sqrt(cfg.cue_dims))
    exact = float("inf") if gap > 0 else 0.0
    cue = gap / cfg.spurious_noise if cfg.spurious_noise > 0 else exact
    groups = population_groups(cfg)
    rho = max(cfg.rho_train, 1.0 - cfg.rho_train)
    if cfg.spurious_noise == 0 or cfg.rho_train in (0.0, 1.0):  # a cue of variance 0 / an empty group
        return closed_form(cue, 2.0 / cfg.sigma, rho)
    means = np.stack([g.mean[: 1 + cfg.cue_dims] for g in groups])  # noise dimensions: equal means, independent
    cov = groups[0].cov[: 1 + cfg.cue_dims, : 1 + cfg.cue_dims]
    d2 = np.array([[float((m - n) @ ((m - n) / np.diag(cov))) for n in means] for m in means])
    return closed_form(cue, 2.0 / cfg.sigma, rho, d2, np.array([g.y for g in groups]), np.array([g.prob for g in groups]))


def split_rho(cfg: GaussianShortcutConfig, split: str) -> float:
    """Agreement rate of a split: rho_ood in test_ood, rho_train everywhere else."""
    return cfg.rho_ood if split == "test_ood" else cfg.rho_train


def group_mean(cfg: GaussianShortcutConfig, y: int, a: int) -> np.ndarray:
    """Mean of x in group (y, a)."""
    mean = np.zeros(dim(cfg))
    mean[0] = 2 * y - 1
    mean[cue_slice(cfg)] = (2 * a - 1) * cfg.spurious_scale
    return mean


def group_std(cfg: GaussianShortcutConfig) -> np.ndarray:
    """Per-dimension std of x within any group (the same diagonal covariance for all groups)."""
    std = np.full(dim(cfg), noise_std(cfg))
    std[0] = cfg.sigma
    std[cue_slice(cfg)] = cfg.spurious_noise
    return std


def population_groups(cfg: GaussianShortcutConfig, rho: float | None = None) -> list[GroupParams]:
    """The four groups (y, a) of the population at agreement rate `rho` (default rho_train).

    P(y) = 1/2 and P(a == y | y) = rho, so P(y, a) is rho/2 for agreeing and (1−rho)/2
    for disagreeing groups; within a group x ~ N(group_mean, diag(group_std²)).
    """
    rho = cfg.rho_train if rho is None else rho
    cov = np.diag(group_std(cfg) ** 2)
    return [
        GroupParams(y, a, group_mean(cfg, y, a), cov.copy(), 0.5 * (rho if a == y else 1.0 - rho))
        for y in (0, 1)
        for a in (0, 1)
    ]


def population_lda(
    cfg: GaussianShortcutConfig, rho: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Population LDA fit at agreement rate `rho` (default rho_train): (means (2, d), shared cov (d, d), priors (2,)).

    Each class is a two-component mixture over a; its mean on every cue dimension is
    (2rho−1)·B·y± and the mixture adds 4rho(1−rho)·B² to every entry of the cue block of the
    covariance (the cue dimensions move together with a, so with cue_dims > 1 they are
    correlated within a class). Both classes have the same covariance, so the shared
    within-class covariance is exactly this one.
    """
    rho = cfg.rho_train if rho is None else rho
    scale = np.zeros(dim(cfg))
    scale[0] = 1.0
    scale[cue_slice(cfg)] = 2 * rho - 1
    means = np.stack([group_mean(cfg, y, y) * scale for y in (0, 1)])
    cov = np.diag(group_std(cfg) ** 2)
    cov[cue_slice(cfg), cue_slice(cfg)] += 4 * rho * (1 - rho) * cfg.spurious_scale**2
    return means, cov, np.array([0.5, 0.5])


def sample_split(
    cfg: GaussianShortcutConfig, n: int, rho: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, a, x) for one split of `n` examples, with exact stratified group counts, in random order.

    Class 0 gets ceil(n/2) examples and class 1 floor(n/2); within a class the agreeing /
    disagreeing counts come from `agreement_counts(n_class, rho)`.
    """
    ys, agrees = [], []
    for y, n_class in ((0, (n + 1) // 2), (1, n // 2)):
        n_agree, n_disagree = agreement_counts(n_class, rho)
        ys.append(np.full(n_class, y, dtype=np.int64))
        agrees.append(np.r_[np.ones(n_agree, dtype=bool), np.zeros(n_disagree, dtype=bool)])
    order = rng.permutation(n)
    y = np.concatenate(ys)[order]
    a = attribute_from_agreement(y, np.concatenate(agrees)[order])
    # In place, one n×dim float64 array at a time (d_noise may be thousands); the sums are the
    # same as mean + noise·std, so the defaults' bytes are unchanged.
    x = rng.standard_normal((n, dim(cfg)))
    x *= group_std(cfg)
    x[:, 0] += 2 * y - 1
    x[:, cue_slice(cfg)] += ((2 * a - 1) * cfg.spurious_scale)[:, None]
    return y, a, x.astype(np.float32)


def generate(cfg: GaussianShortcutConfig) -> Generated:
    """All four splits, rows ordered by split (train, val, test_id, test_ood) then id.

    Each split draws from its own stream `default_rng([seed, split_index])`, so changing
    one split's size leaves the others unchanged. Ids run 0..N−1 in row order.
    """
    ys, as_, xs, splits = [], [], [], []
    for index, (split, size_key) in enumerate(SPLIT_SIZES):
        n = getattr(cfg, size_key)
        y, a, x = sample_split(
            cfg, n, split_rho(cfg, split), np.random.default_rng([cfg.seed, index])
        )
        ys.append(y)
        as_.append(a)
        xs.append(x)
        splits.append(np.full(n, split, dtype=object))
    y = np.concatenate(ys)
    columns = {
        "id": np.arange(len(y), dtype=np.int64),
        "split": np.concatenate(splits),
        "y": y,
        "a": np.concatenate(as_),
        "x": np.concatenate(xs),
    }
    meta = {
        "kind": "gaussian_shortcut",
        "n_classes": 2,
        "n_attrs": 2,
        "shape": [dim(cfg)],
        "rho_train": cfg.rho_train,
        "rho_ood": cfg.rho_ood,
        "params": dataclasses.asdict(cfg),
        "split_sizes": {split: getattr(cfg, key) for split, key in SPLIT_SIZES},
        "separation": separation(cfg),
        "separation_source": "closed_form",
    }
    return columns, meta


register_dataset("gaussian_shortcut", GaussianShortcutConfig, generate=generate, regenerate=sample_split)
