"""`dfr`: Deep Feature Reweighting — DFR(Val) of Kirichenko, Izmailov & Wilson, "Last Layer
Re-Training is Sufficient for Robustness to Spurious Correlations" (ICLR 2023): the last layer
of a trained network is re-fitted as an L1 logistic regression on group-balanced validation
embeddings (`fit_dfr`), on top of that network's frozen feature extractor (`dfr_classifier`).

What the authors' code does — github.com/PolinaKirichenko/deep_feature_reweighting,
`dfr_evaluate_spurious.py` (commit 9d8d5de), `dfr_on_validation_tune` and
`dfr_on_validation_eval` as its README runs them (`balance_dfr_val` and `notrain_dfr_val` left
at their default True: no train rows in the fit, no class weights) — and is the default here
(conf/method/dfr.yaml):

- embeddings: the base model's last hidden layer (`get_embed`: the ResNet's pooled features,
  i.e. everything but `fc`). Here `features` names a method of `run.methods` whose trained MLP
  classifier gives them (its encoder output, the input of its head; default the plain
  cross-entropy baseline), read from data/models/<dataset>/<features>/seed=<seed>/.
- the base model is that method's *final* checkpoint: train_classifier.py trains ERM for
  `num_epochs` and saves `final_checkpoint.pt`, which the README's DFR command loads; no
  checkpoint is chosen with validation groups (DFR's tuning is their only use). `base: final`
  reads the model folder's final.safetensors (the last epoch's weights, which every model
  trained by epochs keeps); `base: selected` (model.safetensors, the epoch the method's own
  `selection` chose, e.g. by val worst-group: val group labels then count twice) is the option.
- tune (`dfr_on_validation_tune`, `num_retrains=1`): val is shuffled and cut in two, the first
  n//2 rows scored, the other half fitted; the fit half is cut to group balance (each group
  shuffled, the first min-group-size rows kept); a `StandardScaler` is fitted on that subsample;
  for each C of `C_OPTIONS = [1., 0.7, 0.3, 0.1, 0.07, 0.03, 0.01]` a
  `LogisticRegression(penalty="l1", C=c, solver="liblinear", class_weight={0: 1., 1: 1.})` is
  fitted and scored by worst-group accuracy on the scored half; `np.argmax` over the grid, so
  ties go to the first C in grid order.
- refit (`dfr_on_validation_eval`, `num_retrains=20`): a `StandardScaler` fitted on the
  *train* split's embeddings (inputs only, no labels); 20 group-balanced subsamples of the
  *whole* val, one L1 liblinear fit each with the chosen C; `coef_` and `intercept_` averaged.

Deviations are options, never defaults: `features: pretrained` (the pretrain stage's DAE
encoder and data/pretrained/<dataset>/embeddings.parquet), `base: selected`, `penalty: l2`,
`halving: stratified` (per-group halves, so a small group cannot fall out of one half),
`balance: weight` (all rows, 1/group-count sample weights, one fit), `scaler: val` (reads no
train row), `n_fits > 1` (tune scores averaged over fresh halvings, as the code's
`num_retrains` argument does), `selection: val_avg | oracle`. Random draws come from one
`numpy` generator seeded by the run's seed (the paper's code uses the global `np.random`), and
liblinear gets `random_state=seed`: the fit is deterministic.

On a small val split the tuning has little to go on (the built-in digits: a fit half of ~12
balanced rows, on which L1 with C <= 0.1 zeroes every weight): `fit_dfr` then still picks as the paper's
code does, and says so in one line (`tuning_warning`: stderr and config.json `dfr.warning`).

scikit-learn >= 1.8 deprecates `penalty=`: the penalty is `l1_ratio` (1 = L1, 0 = L2) with
`solver="liblinear"`, which fits binary problems only; with more classes each class is fitted
one-vs-rest (what liblinear did in the scikit-learn of the paper's code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from stages.core.registry import register_method
from stages.core.schema import SELECTIONS, Checks, ConfigError, option
from stages.models.discriminative import pretrained_encoder, pretrained_for

if TYPE_CHECKING:
    from pathlib import Path

    from stages.core.artifacts import Prepared
    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import Trained, TrainJob

PRETRAINED = "pretrained"  # `features` value: the pretrain stage's encoder, not a trained method
BASES = ("final", "selected")  # `base`: the features method's last epoch, or its selected one
L1_RATIO = {"l1": 1.0, "l2": 0.0}  # scikit-learn's l1_ratio for each penalty (penalty= is deprecated)


@dataclass
class DFRConfig:
    """Deep feature reweighting, DFR(Val): L1 logistic regression on a trained model's last
    hidden layer, C tuned on half of val, then refitted on the whole val (the average of
    group-balanced subsamples). Reads val rows (and train inputs for the scaler)."""

    kind: str = option("method family")
    features: str = option(
        "embeddings: a method in run.methods whose trained MLP model's last hidden layer gives them "
        "(DFR paper: the base model) | pretrained (the pretrain stage's DAE encoder)"
    )
    base: str = option(
        "which weights of the `features` method: final (DFR paper: its last epoch, final.safetensors) | "
        "selected (the epoch its own selection chose, model.safetensors)"
    )
    penalty: str = option("l1 (DFR paper) | l2")
    c_grid: list[float] = option("inverse regularisation strengths C to try, in order; ties go to the first (the paper's np.argmax)")
    halving: str = option("val cut into fit/tune halves: random (DFR paper: shuffled, n//2 rows scored) | stratified (per group)")
    balance: str = option(
        "group balance of every fit: subsample (DFR paper: each group cut to the smallest) | weight (all rows, 1/group-count weights)"
    )
    n_fits: int = option("tune: random halvings whose tune-half scores are averaged per C (DFR paper: 1)")
    n_refits: int = option("refit on the whole val: group-balanced subsamples whose heads are averaged (DFR paper: 20)")
    scaler: str = option("StandardScaler of the refit fitted on: train (DFR paper: the train split's embeddings) | val (whole val)")
    selection: str = option("C chosen by: val_worst_group (DFR paper) | val_avg (tune half) | oracle (test_ood)")

    def upstream_weights(self) -> str:
        """The file of the `features` method's model folder this config reads (stages/train.py
        records it among the inputs)."""
        from stages.models import FINAL_WEIGHTS, WEIGHTS

        return FINAL_WEIGHTS if self.base == "final" else WEIGHTS

    def reads_splits(self) -> tuple[str, ...]:
        """val; train too with scaler=train (its inputs set the standardisation); test_ood too
        under the oracle criterion."""
        return (*(("train",) if self.scaler == "train" else ()), "val", *(("test_ood",) if self.selection == "oracle" else ()))

    def check(self, c: Checks) -> None:
        c.require(bool(self.features), "features", "must name a method in run.methods, or be 'pretrained'")
        c.choice(self.base, "base", list(BASES))
        c.choice(self.penalty, "penalty", list(L1_RATIO))
        c.require(len(self.c_grid) > 0 and all(v > 0 for v in self.c_grid), "c_grid", f"needs values > 0, got {self.c_grid}")
        c.choice(self.halving, "halving", ["random", "stratified"])
        c.choice(self.balance, "balance", ["subsample", "weight"])
        c.require(self.n_fits >= 1, "n_fits", f"must be >= 1, got {self.n_fits}")
        c.require(self.n_refits >= 1, "n_refits", f"must be >= 1, got {self.n_refits}")
        c.choice(self.scaler, "scaler", ["train", "val"])
        c.choice(self.selection, "selection", SELECTIONS)


# ---- the fit, on embeddings ------------------------------------------------------------------


def halves(g: np.ndarray, rng: np.random.Generator, how: str) -> tuple[np.ndarray, np.ndarray]:
    """Row indices cut into (fit, tune) halves, each sorted.

    random (the paper's code): a seeded permutation, its first n//2 rows to tune and the rest
    to fit. stratified: per group, a seeded permutation gives the first ceil(n/2) rows to fit
    and the rest to tune.
    """
    if how == "random":
        perm = rng.permutation(len(g))
        cut = len(g) // 2
        return np.sort(perm[cut:]), np.sort(perm[:cut])
    if how != "stratified":
        raise ValueError(f"unknown halving '{how}'")
    fit, tune = [], []
    for value in np.unique(g):
        idx = rng.permutation(np.flatnonzero(g == value))
        cut = (len(idx) + 1) // 2
        fit.append(idx[:cut])
        tune.append(idx[cut:])
    return np.sort(np.concatenate(fit)), np.sort(np.concatenate(tune))


def balanced_subsample(g: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices of a group-balanced subset: every group present, down-sampled to the smallest."""
    values, counts = np.unique(g, return_counts=True)
    m = int(counts.min())
    return np.sort(np.concatenate([rng.choice(np.flatnonzero(g == v), m, replace=False) for v in values]))


def group_weights(g: np.ndarray) -> np.ndarray:
    """Per-row weights ∝ 1 / group count, mean 1: every group weighs the same in total."""
    values, inverse, counts = np.unique(g, return_inverse=True, return_counts=True)
    return len(g) / (len(values) * counts[inverse])


def liblinear(
    z: np.ndarray, y: np.ndarray, n_classes: int, c: float, penalty: str, seed: int, sample_weight: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's `LogisticRegression(C=c, l1_ratio=…, solver="liblinear")` on `z`:
    (weight (K, d), bias (K,)) whose logits reproduce its decision function — a binary score s
    becomes the rows (−s/2, +s/2), more classes are fitted one-vs-rest (row k: class k against
    the rest). Every class must occur in `y`."""
    from sklearn.linear_model import LogisticRegression

    present = np.unique(y)
    if list(present) != list(range(n_classes)):
        raise ValueError(f"fit set has classes {present.tolist()}, needs all of 0..{n_classes - 1}")

    def one(target: np.ndarray) -> tuple[np.ndarray, float]:
        model = LogisticRegression(C=float(c), l1_ratio=L1_RATIO[penalty], solver="liblinear", random_state=int(seed))
        model.fit(z, target, sample_weight=sample_weight)
        return model.coef_[0].astype(np.float64), float(model.intercept_[0])

    if n_classes == 2:
        w, b = one(y)
        return np.stack([-w / 2, w / 2]), np.array([-b / 2, b / 2])
    rows = [one((y == k).astype(np.int64)) for k in range(n_classes)]
    return np.stack([w for w, _ in rows]), np.array([b for _, b in rows])


@dataclass
class Embedded:
    """A split's embeddings with labels and groups (numpy)."""

    z: np.ndarray
    y: np.ndarray
    g: np.ndarray


@dataclass
class Scaler:
    """A fitted `sklearn.preprocessing.StandardScaler`'s mean and scale (scale 1 where the
    variance is 0): z_std = (z − mean) / scale."""

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, z: np.ndarray) -> Scaler:
        from sklearn.preprocessing import StandardScaler

        s = StandardScaler().fit(np.asarray(z, dtype=np.float64))
        return cls(s.mean_.copy(), s.scale_.copy())

    def __call__(self, z: np.ndarray) -> np.ndarray:
        return (np.asarray(z, dtype=np.float64) - self.mean) / self.scale

    def fold(self, weight: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The head (weight, bias) on standardised embeddings as a head on raw ones."""
        w = weight / self.scale
        return w, bias - w @ self.mean


@dataclass
class DFRCandidate:
    """One value of C: its tune-phase heads (on raw embeddings, one per halving) and their
    scores on the tune halves, averaged over the halvings."""

    c: float
    heads: list[tuple[np.ndarray, np.ndarray]]
    tune: dict[str, float]

    def scores(self, data: Embedded) -> dict[str, float]:
        """acc and worst-group accuracy of the heads on `data`, averaged over the halvings."""
        from stages.models.robust import group_scores

        runs = [group_scores(data.z @ w.T + b, data.y, data.g) for w, b in self.heads]
        return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


@dataclass
class DFRResult:
    """The refitted head (on raw embeddings) and everything config.json records about the fit."""

    weight: np.ndarray
    bias: np.ndarray
    c: float
    candidates: list[DFRCandidate]
    summary: dict[str, Any]
    scaler: Scaler  # the refit's standardisation
    refits: list[np.ndarray] = field(default_factory=list)  # val rows of each refit
    halvings: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (fit, tune) val rows


# The tune-half score each criterion maximises over C (oracle: test_ood worst-group).
DFR_CRITERIA = {"val_avg": "acc", "val_worst_group": "worst_group_acc", "oracle": "oracle"}


def _fit_rows(g: np.ndarray, balance: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows, sample weights) of one fit on rows with groups `g`: a balanced subsample, or all
    rows with 1/group-count weights."""
    if balance == "subsample":
        return balanced_subsample(g, rng), None
    if balance == "weight":
        return np.arange(len(g)), group_weights(g)
    raise ValueError(f"unknown balance '{balance}'")


def tuning_warning(
    candidates: list[DFRCandidate], best: DFRCandidate, key: str, g: np.ndarray,
    halvings: list[tuple[np.ndarray, np.ndarray]], fit_rows: int,
) -> str | None:
    """One line when the choice of C is not supported by the data, else None: some C's give an
    all-zero head on every tune fit (constant predictions: the L1 penalty removed every feature),
    or the chosen C ties with others on the tune score (picked as the first in grid order)."""
    zero = [cand.c for cand in candidates if all(not np.any(w) for w, _ in cand.heads)]
    tied = [cand.c for cand in candidates if cand.tune[key] == best.tune[key]]
    if not zero and len(tied) < 2:
        return None
    tune_min = min(int(np.min(np.unique(g[t], return_counts=True)[1])) for _, t in halvings)
    parts = []
    if zero:
        parts.append(f"C in {zero} give an all-zero head (constant predictions)")
    if len(tied) > 1:
        parts.append(f"C in {tied} tie at tune {key.replace('_', ' ')} {best.tune[key]:.3f}, C={best.c:g} picked as the first in grid order")
    return (f"DFR's choice of C rests on little data: fitted on {fit_rows} val rows, scored on a tune half whose smallest group "
            f"has {tune_min} rows; " + "; ".join(parts) + " (a larger val split, halving=stratified or n_fits > 1 give it more)")


def fit_dfr(
    val: Embedded, n_classes: int, cfg: DFRConfig, seed: int, train_z: np.ndarray | None = None, oracle: Embedded | None = None
) -> DFRResult:
    """DFR(Val) on validation embeddings (see the module docstring for the paper's code).

    Tune: `cfg.n_fits` times, val is cut into a fit and a tune half (`halves`, `cfg.halving`);
    the fit half is balanced over groups (`cfg.balance`) and standardised with its own
    statistics; for each C of `cfg.c_grid` a `liblinear` fit (`cfg.penalty`) is scored on the
    tune half. The C with the best mean score wins (selection val_worst_group: worst-group
    accuracy; val_avg: accuracy; oracle: worst-group accuracy on `oracle`, the test_ood
    embeddings); ties go to the first C in grid order.

    Refit: standardised with a scaler fitted on `train_z` (cfg.scaler=train) or on the whole
    val, `cfg.n_refits` group-balanced subsamples of the *whole* val (one weighted fit of all
    of it with balance=weight) are fitted with the chosen C and their heads averaged. The
    returned head acts on raw embeddings (the standardisation is folded in).
    """
    from stages.models.robust import group_scores

    if cfg.selection not in DFR_CRITERIA:
        raise ValueError(f"unknown selection '{cfg.selection}'")
    if cfg.selection == "oracle" and oracle is None:
        raise ValueError("selection 'oracle' needs the test_ood embeddings")
    if cfg.scaler == "train" and train_z is None:
        raise ValueError("scaler 'train' needs the train split's embeddings")
    rng = np.random.default_rng(seed)
    groups = np.unique(val.g)
    grid = [float(c) for c in cfg.c_grid]
    heads: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in grid]
    halvings = []
    for _ in range(cfg.n_fits):
        fit_idx, tune_idx = halves(val.g, rng, cfg.halving)
        lost = sorted(set(groups.tolist()) - set(val.g[fit_idx].tolist()))
        if lost:
            raise ValueError(
                f"group {lost[0]} has no row in the fit half of val ({len(val.g)} rows); "
                "use halving=stratified or a larger val split"
            )
        halvings.append((fit_idx, tune_idx))
        rows, weight = _fit_rows(val.g[fit_idx], cfg.balance, rng)
        rows = fit_idx[rows]
        scaler = Scaler.fit(val.z[rows])  # the paper's code: fit_transform on the fit subsample
        z_fit = scaler(val.z[rows])
        for i, c in enumerate(grid):
            heads[i].append(scaler.fold(*liblinear(z_fit, val.y[rows], n_classes, c, cfg.penalty, seed, weight)))
    candidates = []
    for c, hs in zip(grid, heads, strict=True):
        cand = DFRCandidate(c, hs, {})
        runs = [group_scores(val.z[t] @ w.T + b, val.y[t], val.g[t]) for (w, b), (_, t) in zip(hs, halvings, strict=True)]
        cand.tune = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        if oracle is not None and cfg.selection == "oracle":
            cand.tune["oracle"] = cand.scores(oracle)["worst_group_acc"]
        candidates.append(cand)
    key = DFR_CRITERIA[cfg.selection]
    best = max(candidates, key=lambda cand: cand.tune[key])  # max keeps the first of ties, as np.argmax
    counts = np.unique(val.g[halvings[0][0]], return_counts=True)[1]  # the first fit half's groups
    fit_rows = len(counts) * int(counts.min()) if cfg.balance == "subsample" else int(counts.sum())
    warning = tuning_warning(candidates, best, key, val.g, halvings, fit_rows)
    # Refit on the whole val with the chosen C.
    scaler = Scaler.fit(train_z if cfg.scaler == "train" else val.z)
    z_all = scaler(val.z)
    fits = [_fit_rows(val.g, cfg.balance, rng) for _ in range(cfg.n_refits if cfg.balance == "subsample" else 1)]
    refits = [liblinear(z_all[rows], val.y[rows], n_classes, best.c, cfg.penalty, seed, w) for rows, w in fits]
    weight, bias = scaler.fold(np.mean([h[0] for h in refits], axis=0), np.mean([h[1] for h in refits], axis=0))
    per_group = np.unique(val.g[fits[0][0]], return_counts=True)
    summary = {
        "features": cfg.features,
        "penalty": cfg.penalty,
        "c": best.c,
        "tuned_on": "test_ood" if cfg.selection == "oracle" else "val (tune half)",
        "halving": cfg.halving,
        "balance": cfg.balance,
        "n_fits": cfg.n_fits,
        "n_val": int(len(val.g)),
        "n_val_fit": int(len(halvings[0][0])),
        "n_val_tune": int(len(halvings[0][1])),
        "scaler": cfg.scaler,
        "n_refits": len(fits),
        "refit_rows_per_group": {str(int(v)): int(n) for v, n in zip(*per_group, strict=True)},
        "nonzero_weights": int(np.count_nonzero(np.abs(weight).sum(0))),
        "warning": warning,
        "grid": [{"c": cand.c, **{f"tune_{k}": v for k, v in cand.tune.items()}} for cand in candidates],
    }
    return DFRResult(weight, bias, best.c, candidates, summary, scaler, [rows for rows, _ in fits], halvings)


# ---- the model, the embeddings and the train stage -------------------------------------------


def dfr_classifier(standardize: Standardize, encoder: MLPEncoder, weight: np.ndarray, bias: np.ndarray) -> MLPClassifier:
    """The frozen encoder with the DFR head: an ordinary MLPClassifier mapping raw x to logits."""
    import torch

    from stages.models.mlp import MLPClassifier

    model = MLPClassifier(encoder, len(bias), standardize)
    with torch.no_grad():
        model.head.weight.copy_(torch.from_numpy(weight).float())
        model.head.bias.copy_(torch.from_numpy(bias).float())
    return model.eval()


def read_embeddings(dataset: str, prepared: Prepared, splits: tuple[str, ...], config: Any = None) -> dict[str, Any]:
    """`Embedded` for each split in `splits`, from data/pretrained/<dataset>/embeddings.parquet.

    Only the rows of `splits` are kept (matched to the prepared rows by id, in prepared
    order); a missing file, or ids that do not match the prepared data, name the file.
    """
    from stages.core import provenance
    from stages.core.artifacts import embeddings_schema, pretrained_dir
    from stages.core.io import (
        PROVENANCE,
        ArtifactError,
        fixed_list_to_numpy,
        read_metadata,
        read_parquet,
    )
    from stages.models import EMBEDDINGS

    path = pretrained_dir(dataset) / EMBEDDINGS
    if not path.is_file():
        raise ArtifactError(
            f"{path}: pretrained embeddings not found; they are made by the pretrain stage "
            f"(`python -m stages.pretrain {dataset}` or `dvc repro pretrain@{dataset}`)"
        )
    meta = read_metadata(path)
    hidden = meta.get("hidden")
    if not isinstance(hidden, list) or not hidden:
        raise ArtifactError(f"{path}: file metadata lacks the encoder widths 'hidden'")
    provenance.check(path, meta.get(PROVENANCE), pretrained_for(dataset, config))
    table = read_parquet(path, embeddings_schema(int(hidden[-1])))
    ids = table.column("id").to_numpy()
    split_col = np.asarray(table.column("split").to_pylist(), dtype=object)
    out = {}
    for name in splits:
        keep = np.flatnonzero(split_col == name)
        row_of = {int(i): k for k, i in enumerate(ids[keep])}
        part = prepared.subset(name)
        missing = [int(i) for i in part.id if int(i) not in row_of]
        if missing or len(keep) != len(part.id):
            first = f" (first missing id {missing[0]})" if missing else ""
            raise ArtifactError(f"{path}: split '{name}' rows do not match the prepared data{first}; re-run the pretrain stage")
        z = fixed_list_to_numpy(table.column("z").take(keep))[[row_of[int(i)] for i in part.id]]
        out[name] = Embedded(z, part.y.astype(np.int64), part.g.astype(np.int64))
    return out


def embed(standardize: Standardize, encoder: MLPEncoder, x: np.ndarray) -> np.ndarray:
    """The encoder's output (the last hidden layer) for raw inputs, float32."""
    import torch

    with torch.no_grad():
        return encoder(standardize(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))).numpy()


def feature_extractor(
    prepared: Prepared, cfg: DFRConfig, dataset: str, seed: int, key: str, method: str,
    built_on: dict[str, Any] | None = None,
) -> tuple[Path, Any, MLPEncoder | None, dict[str, Embedded]]:
    """(the file the features come from, its standardisation, its encoder, embeddings of the
    `cfg.reads_splits()` splits); for a timm network's features (model kind `backbone`): (its file,
    the network, None, its `embed` of the splits).

    features=pretrained: the pretrain stage's encoder and embeddings.parquet, whose stored val
    embeddings must be what the stored encoder gives (else the folder is stale). Otherwise the
    trained model of method `cfg.features`, same dataset and seed: its encoder's output, the
    input of its head, is the last hidden layer. `built_on` (TrainJob.built_on): the params
    sections those were made under, checked against their provenance.
    """
    from stages.core import provenance
    from stages.core.artifacts import model_dir, prepared_path
    from stages.core.io import ArtifactError
    from stages.models import load_model

    splits = cfg.reads_splits()
    if cfg.features == PRETRAINED:
        made = (built_on or {}).get("pretrain")
        path, standardize, encoder = pretrained_encoder(dataset, prepared.x.shape[1], made)
        embedded = read_embeddings(dataset, prepared, splits, made)
        z_check = embed(standardize, encoder, prepared.subset("val").x)
        val = embedded["val"]
        if z_check.shape != val.z.shape or not np.allclose(z_check, val.z, rtol=1e-4, atol=1e-4):
            raise ArtifactError(f"{path.parent}: embeddings.parquet does not match encoder.safetensors; re-run the pretrain stage")
        return path, standardize, encoder, embedded
    if cfg.features == method:
        raise ConfigError(f"params.yaml: {key}.features: names the method itself; name another method of run.methods, or 'pretrained'")
    folder = model_dir(dataset, cfg.features, seed)
    path = folder / cfg.upstream_weights()
    if not path.is_file() and cfg.base == "final" and folder.is_dir():
        raise ArtifactError(
            f"{path}: the last epoch's weights of method '{cfg.features}' ({key}.base: final) not found; a model "
            f"trained by epochs keeps them (re-run `dvc repro train@{dataset}-{cfg.features}-{seed}`), one fitted "
            f"without epochs has none: set {key}.base=selected"
        )
    if not path.is_file():
        raise ArtifactError(
            f"{path}: the trained model of method '{cfg.features}' ({key}.features) not found; it is made by "
            f"the train stage (`python -m stages.train {dataset} {cfg.features} {seed}` or "
            f"`dvc repro train@{dataset}-{cfg.features}-{seed}`)"
        )
    # That method's model for this dataset and seed, trained on this prepared file (its provenance).
    made_for = provenance.Expected(
        dataset, f"train@{dataset}-{cfg.features}-{seed}", model=cfg.features, seed=seed, inputs=(prepared_path(dataset),),
        config=(built_on or {}).get(f"method.{cfg.features}"), config_key=f"method.{cfg.features}",
    )
    model = load_model(folder, expect=made_for, weights=path.name)
    if model.kind == "backbone":  # a timm network: its pooled features, its head replaced (stages/models/backbone.py)
        if model.in_dim != prepared.x.shape[1] or model.n_classes != prepared.n_classes:
            raise ArtifactError(f"{path}: a model for {model.in_dim} inputs and {model.n_classes} classes, the prepared data has "
                                f"{prepared.x.shape[1]} and {prepared.n_classes}; re-run train@{dataset}-{cfg.features}-{seed}")
        from stages.models.nets import place

        place(model)
        embedded = {}
        for name in splits:
            part = prepared.subset(name)
            embedded[name] = Embedded(model.embed(part.x), part.y.astype(np.int64), part.g.astype(np.int64))
        return path, model, None, embedded
    standardize, encoder = getattr(model, "standardize", None), getattr(model, "encoder", None)
    if model.kind != "mlp" or standardize is None or encoder is None:
        raise ConfigError(
            f"params.yaml: {key}.features: method '{cfg.features}' saved a '{model.kind}' model, which has no "
            f"last hidden layer to re-train a head on; name a method that trains an MLP classifier, or 'pretrained'"
        )
    if model.in_dim != prepared.x.shape[1] or model.n_classes != prepared.n_classes:
        raise ArtifactError(
            f"{path}: a model for {model.in_dim} inputs and {model.n_classes} classes, the prepared data has "
            f"{prepared.x.shape[1]} and {prepared.n_classes}; re-run train@{dataset}-{cfg.features}-{seed}"
        )
    embedded = {}
    for name in splits:
        part = prepared.subset(name)
        embedded[name] = Embedded(embed(standardize, encoder, part.x), part.y.astype(np.int64), part.g.astype(np.int64))
    return path, standardize, encoder, embedded


def fit_head(
    prepared: Prepared, cfg: DFRConfig, dataset: str, seed: int, key: str, method: str = "",
    built_on: dict[str, Any] | None = None,
) -> tuple[MLPClassifier, dict[str, dict[str, float]], pa.Table, dict[str, Any]]:
    """DFR: a linear head on a frozen encoder, fitted on val embeddings only.

    Returns (model mapping raw x to logits, metrics per split, epoch-0 history, summary for
    config.json). The fit reads only the `cfg.reads_splits()` rows. After the fit, every C's
    tune-phase heads are also scored on test_ood for the report
    (`grid[*].test_ood_worst_group_acc`); that score never chooses C unless `selection` is
    oracle.
    """
    import torch

    from stages.core.runtime import setup_torch
    from stages.models.history import history_rows, history_table
    from stages.models.training import split_data, split_metrics

    setup_torch(seed)
    path, standardize, encoder, embedded = feature_extractor(prepared, cfg, dataset, seed, key, method, built_on or {})
    train_z = embedded["train"].z if "train" in embedded else None
    try:
        fit = fit_dfr(embedded["val"], prepared.n_classes, cfg, seed, train_z, embedded.get("test_ood"))
    except ValueError as e:
        raise ConfigError(f"{key} on {dataset}: {e}") from None
    if encoder is None:  # features of a timm network (`standardize` is that network)
        model = standardize.with_head(fit.weight, fit.bias)
    else:
        model = dfr_classifier(standardize, encoder, fit.weight, fit.bias)
    splits = split_data(prepared)
    metrics = {}
    with torch.no_grad():
        for name, s in splits.items():
            logits = model(s.x) if encoder is not None else torch.from_numpy(model.logits(s.x.numpy()))
            metrics[name] = split_metrics(logits, s.y, s.g)
    summary = {**fit.summary, "features_from": str(path)}
    if "test_ood" in splits:  # what the oracle would have chosen, for the report only
        ood = splits["test_ood"]
        z = standardize.embed(ood.x.numpy()) if encoder is None else embed(standardize, encoder, ood.x.numpy())
        z_ood = Embedded(z.astype(np.float64), ood.y.numpy(), ood.g.numpy())
        for cand, row in zip(fit.candidates, summary["grid"], strict=True):
            row["test_ood_worst_group_acc"] = cand.scores(z_ood)["worst_group_acc"]
    # The C each criterion picks (ties to the first in grid order), in the shape of `selections` elsewhere.
    keys = {"val_avg": "tune_acc", "val_worst_group": "tune_worst_group_acc", "oracle": "test_ood_worst_group_acc"}
    summary["selections"] = {
        criterion: max(summary["grid"], key=lambda row, k=key: row[k])  # type: ignore[misc]
        for criterion, key in keys.items()
        if key in summary["grid"][0]
    }
    return model, metrics, history_table(history_rows(0, metrics)), summary


def train(job: TrainJob) -> Trained:
    """The head on val embeddings; C chosen by `selection` (config.json: `dfr`, `selections`)."""
    from stages.models.training import Trained

    cfg = job.cfg
    model, metrics, history, summary = fit_head(job.prepared, cfg, job.dataset, job.seed, job.key, job.method, job.built_on)
    selections = summary.pop("selections")
    record = {
        "architecture": model.arch(), "selection": cfg.selection, "selected_epoch": 0, "metrics": metrics,
        "selections": selections, "dfr": {**summary, "base": cfg.base if cfg.features != PRETRAINED else None},
    }
    if summary["warning"]:  # one line; config.json keeps it under dfr.warning
        import sys

        print(f"{job.key} on {job.dataset} seed {job.seed}: warning: {summary['warning']}", file=sys.stderr)
    if cfg.features == PRETRAINED:  # the key the other methods that read the pretrain stage write
        record["pretrained_encoder"] = summary["features_from"]
    how = (
        f"C={summary['c']:g} selected by {cfg.selection} on {summary['tuned_on']}, "
        f"head averaged over {summary['n_refits']} refits on val, features of {cfg.features}"
    )
    return Trained(model, metrics, history, how, record)


# `features` is both rules' key: "pretrained" reads data/pretrained/<dataset>/, any other value
# names the method whose trained model (data/models/<dataset>/<method>/seed=<seed>/) it reads.
register_method("dfr", DFRConfig, train, pretrained="features", upstream="features", model=("mlp", "backbone"))
