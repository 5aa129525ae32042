"""`dfr`: Deep Feature Reweighting (Kirichenko et al. 2023) — logistic regression on frozen
embeddings, fitted on a group-balanced half of the validation split, its inverse
regularisation strength C chosen on the other half (`fit_dfr`, `dfr_classifier`).

Reads the pretrain stage's encoder and embeddings, and val rows only (test_ood too under
the oracle criterion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from stages.models.discriminative import pretrained_encoder
from stages.models.robust import group_scores, logistic_regression
from stages.registry import register_method
from stages.schema import SELECTIONS, Checks, ConfigError, option

if TYPE_CHECKING:
    from stages.artifacts import Prepared
    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import Trained, TrainJob


@dataclass
class DFRConfig:
    """Deep feature reweighting: logistic regression on the pretrained embeddings of a
    group-balanced half of val; C tuned on the other half. Reads val rows only (plus test_ood
    under the oracle selection)."""

    kind: str = option("method family")
    c_grid: list[float] = option("inverse L2 regularisation strengths C to try")
    balance: str = option("group balance of the fit half: subsample (DFR paper) | weight (all rows, 1/group-count weights)")
    n_fits: int = option("with balance=subsample: balanced subsamples whose heads are averaged")
    selection: str = option("C chosen by: val_worst_group | val_avg (tune half) | oracle (test_ood)")

    def reads_splits(self) -> tuple[str, ...]:
        """val only (test_ood too under the oracle criterion)."""
        return ("val", "test_ood") if self.selection == "oracle" else ("val",)

    def check(self, c: Checks) -> None:
        c.require(len(self.c_grid) > 0 and all(v > 0 for v in self.c_grid), "c_grid", f"needs values > 0, got {self.c_grid}")
        c.choice(self.balance, "balance", ["subsample", "weight"])
        c.require(self.n_fits >= 1, "n_fits", f"must be >= 1, got {self.n_fits}")
        c.choice(self.selection, "selection", SELECTIONS)


def halves(g: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices into (fit, tune) halves stratified by group: per group, a seeded
    permutation gives the first ceil(n/2) rows to fit and the rest to tune. Sorted indices."""
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


@dataclass
class Embedded:
    """A split's embeddings with labels and groups (numpy)."""

    z: np.ndarray
    y: np.ndarray
    g: np.ndarray


@dataclass
class DFRCandidate:
    """One value of C: its head (on raw embeddings) and its scores on the tune half."""

    c: float
    weight: np.ndarray
    bias: np.ndarray
    tune: dict[str, float]


@dataclass
class DFRResult:
    """The chosen head and everything config.json records about the fit."""

    weight: np.ndarray
    bias: np.ndarray
    c: float
    candidates: list[DFRCandidate]
    summary: dict[str, Any]


# The tune-half score each criterion maximises over C (oracle: test_ood worst-group).
DFR_CRITERIA = {"val_avg": "acc", "val_worst_group": "worst_group_acc", "oracle": "worst_group_acc"}


def fit_dfr(
    val: Embedded,
    n_classes: int,
    c_grid: Sequence[float],
    n_fits: int,
    selection: str,
    seed: int,
    oracle: Embedded | None = None,
    balance: str = "subsample",
) -> DFRResult:
    """DFR on validation embeddings only (plus test_ood embeddings when `selection` is oracle).

    val is split into halves stratified by group (`halves`). For each C in `c_grid`
    (ascending), logistic regressions are fitted on the fit half's embeddings, standardised
    with the fit half's mean and std, balanced over groups either by `balance="subsample"`
    (as in the DFR paper: `n_fits` independent group-balanced subsamples, `balanced_subsample`,
    whose heads are averaged) or by `balance="weight"` (one fit on the whole fit half with
    sample weights ∝ 1 / group count, so each group weighs the same). The C whose head scores best on the
    tune half (selection val_worst_group: worst-group accuracy; val_avg: accuracy; oracle:
    test_ood worst-group accuracy) wins; ties go to the smaller C (stronger regularisation).
    The returned head acts on raw embeddings (the standardisation is folded in).
    """
    if selection not in DFR_CRITERIA:
        raise ValueError(f"unknown selection '{selection}'")
    if selection == "oracle" and oracle is None:
        raise ValueError("selection 'oracle' needs the test_ood embeddings")
    if balance not in ("subsample", "weight"):
        raise ValueError(f"unknown balance '{balance}'")
    rng = np.random.default_rng(seed)
    fit_idx, tune_idx = halves(val.g, rng)
    g_fit, y_fit = val.g[fit_idx], val.y[fit_idx]
    if balance == "subsample":
        subsets = [(balanced_subsample(g_fit, rng), None) for _ in range(n_fits)]
    else:
        values, inverse, counts = np.unique(g_fit, return_inverse=True, return_counts=True)
        weight = len(g_fit) / (len(values) * counts[inverse])  # mean 1, equal total per group
        subsets = [(np.arange(len(fit_idx)), weight)]
    z_fit = val.z[fit_idx].astype(np.float64)
    mean = z_fit.mean(0)
    std = z_fit.std(0)
    std = np.where(std < 1e-6, 1.0, std)
    candidates = []
    for c in sorted(float(c) for c in c_grid):
        heads = [logistic_regression((z_fit[s] - mean) / std, y_fit[s], n_classes, c, w) for s, w in subsets]
        w = np.mean([h[0] for h in heads], axis=0) / std  # fold the standardisation in
        b = np.mean([h[1] for h in heads], axis=0) - w @ mean
        tune = group_scores(val.z[tune_idx] @ w.T + b, val.y[tune_idx], val.g[tune_idx])
        if oracle is not None and selection == "oracle":
            tune["oracle"] = group_scores(oracle.z @ w.T + b, oracle.y, oracle.g)["worst_group_acc"]
        candidates.append(DFRCandidate(c, w, b, tune))
    key = "oracle" if selection == "oracle" else DFR_CRITERIA[selection]
    best = max(candidates, key=lambda cand: cand.tune[key])  # max keeps the first (smallest C) of ties
    summary = {
        "c": best.c,
        "n_val_fit": int(len(fit_idx)),
        "n_val_tune": int(len(tune_idx)),
        "balance": balance,
        "n_fit_rows": int(len(subsets[0][0])),
        "n_fits": len(subsets),
        "tuned_on": "test_ood" if selection == "oracle" else "val (tune half)",
        "grid": [{"c": cand.c, **{f"tune_{k}": v for k, v in cand.tune.items()}} for cand in candidates],
    }
    return DFRResult(best.weight, best.bias, best.c, candidates, summary)


def dfr_classifier(standardize: Standardize, encoder: MLPEncoder, weight: np.ndarray, bias: np.ndarray) -> MLPClassifier:
    """The frozen encoder with the DFR head: an ordinary MLPClassifier mapping raw x to logits."""
    from stages.models.mlp import MLPClassifier

    model = MLPClassifier(encoder, len(bias), standardize)
    with torch.no_grad():
        model.head.weight.copy_(torch.from_numpy(weight).float())
        model.head.bias.copy_(torch.from_numpy(bias).float())
    return model.eval()


def read_embeddings(dataset: str, prepared: Prepared, splits: tuple[str, ...]) -> dict[str, Any]:
    """`robust.Embedded` for each split in `splits`, from data/pretrained/<dataset>/embeddings.parquet.

    Only the rows of `splits` are kept (matched to the prepared rows by id, in prepared
    order); a missing file, or ids that do not match the prepared data, name the file.
    """
    import numpy as np

    from stages.artifacts import embeddings_schema, pretrained_dir
    from stages.io import ArtifactError, fixed_list_to_numpy, read_metadata, read_parquet
    from stages.models import EMBEDDINGS

    path = pretrained_dir(dataset) / EMBEDDINGS
    if not path.is_file():
        raise ArtifactError(
            f"{path}: pretrained embeddings not found; they are made by the pretrain stage "
            f"(`python -m stages.pretrain {dataset}` or `dvc repro pretrain@{dataset}`)"
        )
    hidden = read_metadata(path).get("hidden")
    if not isinstance(hidden, list) or not hidden:
        raise ArtifactError(f"{path}: file metadata lacks the encoder widths 'hidden'")
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


def fit_head(
    prepared: Prepared, cfg: DFRConfig, dataset: str, seed: int, key: str
) -> tuple[MLPClassifier, dict[str, dict[str, float]], pa.Table, dict[str, Any]]:
    """DFR: a linear head on the frozen pretrained encoder, fitted on val embeddings only.

    Returns (model mapping raw x to logits, metrics per split, epoch-0 history, summary for
    config.json). The fit reads only the `cfg.reads_splits()` rows of the embeddings file,
    and checks that the stored val embeddings are what the stored encoder gives (else the
    pretrained folder is stale). After the fit, every C's head is also scored on test_ood
    for the report (`grid[*].test_ood_worst_group_acc`); that score never chooses C unless
    `selection` is oracle.
    """
    import numpy as np
    import torch

    from stages.io import ArtifactError
    from stages.models.training import history_rows, history_table, split_data, split_metrics
    from stages.runtime import setup_torch

    setup_torch(seed)
    path, standardize, encoder = pretrained_encoder(dataset)
    embedded = read_embeddings(dataset, prepared, cfg.reads_splits())
    val = embedded["val"]
    with torch.no_grad():
        z_check = encoder(standardize(torch.from_numpy(np.ascontiguousarray(prepared.subset("val").x)))).numpy()
    if z_check.shape != val.z.shape or not np.allclose(z_check, val.z, rtol=1e-4, atol=1e-4):
        raise ArtifactError(f"{path.parent}: embeddings.parquet does not match encoder.safetensors; re-run the pretrain stage")
    try:
        fit = fit_dfr(
            val, prepared.n_classes, cfg.c_grid, cfg.n_fits, cfg.selection, seed, embedded.get("test_ood"), cfg.balance
        )
    except ValueError as e:
        raise ConfigError(f"{key} on {dataset}: {e}") from None
    model = dfr_classifier(standardize, encoder, fit.weight, fit.bias)
    splits = split_data(prepared)
    metrics = {}
    with torch.no_grad():
        for name, s in splits.items():
            metrics[name] = split_metrics(model(s.x), s.y, s.g)
    summary = dict(fit.summary)
    if "test_ood" in splits:  # what the oracle would have chosen, for the report only
        ood = splits["test_ood"]
        with torch.no_grad():
            z_ood = encoder(standardize(ood.x)).double().numpy()
        for cand, row in zip(fit.candidates, summary["grid"], strict=True):
            scores = group_scores(z_ood @ cand.weight.T + cand.bias, ood.y.numpy(), ood.g.numpy())
            row["test_ood_worst_group_acc"] = scores["worst_group_acc"]
    # The C each criterion picks (ties to the smaller C), in the shape of `selections` elsewhere.
    keys = {"val_avg": "tune_acc", "val_worst_group": "tune_worst_group_acc", "oracle": "test_ood_worst_group_acc"}
    summary["selections"] = {
        criterion: max(summary["grid"], key=lambda row, k=key: row[k])  # type: ignore[misc]
        for criterion, key in keys.items()
        if key in summary["grid"][0]
    }
    return model, metrics, history_table(history_rows(0, metrics)), summary


def train(job: TrainJob) -> Trained:
    """The head on val embeddings; C chosen by `selection` (config.json: `dfr`, `selections`)."""
    from stages.artifacts import pretrained_dir
    from stages.models import ENCODER
    from stages.models.training import Trained

    cfg = job.cfg
    model, metrics, history, summary = fit_head(job.prepared, cfg, job.dataset, job.seed, job.key)
    selections = summary.pop("selections")
    record = {
        "architecture": model.arch(), "selection": cfg.selection, "selected_epoch": 0, "metrics": metrics,
        "selections": selections, "dfr": summary, "pretrained_encoder": str(pretrained_dir(job.dataset) / ENCODER),
    }
    how = f"C={summary['c']:g} selected by {cfg.selection} on {summary['tuned_on']}"
    return Trained(model, metrics, history, how, record)


register_method("dfr", DFRConfig, train, pretrained="always")
