"""DFR(Val) as the authors' code does it (stages/models/dfr.py): L1 liblinear logistic
regression, C tuned on half of val, refitted on the whole val as the average of group-balanced
subsamples; and the DAG dependency on the method whose model gives the features.

The train stage end to end (features from a trained model, or the pretrained DAE) is in
tests/test_robust.py, which has the stage fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from stages import dag
from stages.core import registry
from stages.core.config import check_upstream, defaults
from stages.core.schema import ConfigError
from stages.models.dfr import Embedded, fit_dfr, halves

ROOT = Path(__file__).resolve().parent.parent
NOISE = 8  # irrelevant embedding dimensions


def sample(rng: np.random.Generator, n: int, rho: float) -> Embedded:
    """Embeddings with a core coordinate (y), a spurious one (a, agreeing with y w.p. rho) and
    NOISE pure-noise coordinates; groups g = 2y + a."""
    y = rng.integers(0, 2, n)
    a = np.where(rng.random(n) < rho, y, 1 - y)
    z = np.column_stack([(2 * y - 1) + rng.standard_normal(n), 3 * (2 * a - 1) + 0.1 * rng.standard_normal(n),
                         rng.standard_normal((n, NOISE))])
    return Embedded(z, y, 2 * y + a)


@pytest.fixture(scope="module")
def data() -> dict[str, Embedded]:
    rng = np.random.default_rng(0)
    return {"train": sample(rng, 600, 0.9), "val": sample(rng, 800, 0.9), "test_ood": sample(rng, 2000, 0.1)}


def test_the_defaults_are_the_papers_code():
    """conf/method/dfr.yaml: dfr_evaluate_spurious.py's C_OPTIONS, REG = "l1", 20 refits, one
    tune split, StandardScaler on train, features of the base (cross-entropy) model."""
    cfg = defaults("method", "dfr")
    assert cfg.c_grid == [1.0, 0.7, 0.3, 0.1, 0.07, 0.03, 0.01]
    assert (cfg.penalty, cfg.halving, cfg.balance, cfg.scaler, cfg.selection) == ("l1", "random", "subsample", "train", "val_worst_group")
    assert cfg.n_fits == 1 and cfg.n_refits >= 10
    assert registry.method(cfg.features).kind == cfg.features  # a trained method, not the DAE


def test_the_head_is_the_average_of_l1_fits_on_balanced_subsamples_of_the_whole_val(data):
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    val, train = data["val"], data["train"]
    cfg = defaults("method", "dfr")
    fit = fit_dfr(val, 2, cfg, seed=3, train_z=train.z)
    # Every refit is a group-balanced subsample of the WHOLE val: the smallest group of val
    # (not of a half) sets its size, and together they use rows of both halves.
    smallest = np.bincount(val.g).min()
    assert len(fit.refits) == cfg.n_refits
    for rows in fit.refits:
        assert np.bincount(val.g[rows]).tolist() == [smallest] * 4
    used = np.unique(np.concatenate(fit.refits))
    fit_half, tune_half = fit.halvings[0]
    assert np.intersect1d(used, fit_half).size and np.intersect1d(used, tune_half).size
    assert len(fit_half) + len(tune_half) == len(val.g) and len(tune_half) == len(val.g) // 2
    # The head: scikit-learn's L1 liblinear fits with the chosen C, on val standardised by a
    # StandardScaler fitted on train's embeddings, coefficients and intercepts averaged.
    scaler = StandardScaler().fit(train.z)
    coefs, intercepts = [], []
    for rows in fit.refits:
        lr = LogisticRegression(C=fit.c, l1_ratio=1.0, solver="liblinear", random_state=3)
        lr.fit(scaler.transform(val.z[rows]), val.y[rows])
        coefs.append(lr.coef_[0])
        intercepts.append(lr.intercept_[0])
    w = np.mean(coefs, axis=0) / scaler.scale_
    b = np.mean(intercepts) - w @ scaler.mean_
    np.testing.assert_allclose(fit.weight[1] - fit.weight[0], w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fit.bias[1] - fit.bias[0], b, rtol=1e-10, atol=1e-12)
    # C: the grid's best tune-half worst-group accuracy, the first of ties; all recorded.
    grid = fit.summary["grid"]
    assert [row["c"] for row in grid] == cfg.c_grid
    best = max(row["tune_worst_group_acc"] for row in grid)
    assert fit.c == next(row["c"] for row in grid if row["tune_worst_group_acc"] == best)
    assert {"c", "n_refits", "features", "penalty", "scaler"} <= set(fit.summary) and fit.summary["n_refits"] == cfg.n_refits
    # Deterministic given the seed; another seed draws other subsamples.
    again = fit_dfr(val, 2, cfg, seed=3, train_z=train.z)
    assert np.array_equal(again.weight, fit.weight) and np.array_equal(again.bias, fit.bias)
    other = fit_dfr(val, 2, cfg, seed=4, train_z=train.z)
    assert not all(np.array_equal(a, b) for a, b in zip(other.refits, fit.refits, strict=True))


def test_it_recovers_the_core_feature_and_l1_zeroes_the_irrelevant_ones(data):
    val, train, ood = data["val"], data["train"], data["test_ood"]
    fit = fit_dfr(val, 2, defaults("method", "dfr"), seed=0, train_z=train.z)
    correct = (ood.z @ fit.weight.T + fit.bias).argmax(1) == ood.y
    assert min(correct[ood.g == k].mean() for k in range(4)) > 0.7  # the shortcut alone gives ~0
    w = fit.weight[1] - fit.weight[0]
    assert abs(w[0]) > 3 * abs(w[1])
    # At a strong penalty L1 zeroes the noise coordinates (averaged over 20 refits, all but a
    # stray one or two are exactly 0) and keeps the core one; L2 zeroes none.
    l1 = fit_dfr(val, 2, defaults("method", "dfr", c_grid=[0.1]), seed=0, train_z=train.z)
    l2 = fit_dfr(val, 2, defaults("method", "dfr", c_grid=[0.1], penalty="l2"), seed=0, train_z=train.z)
    assert np.count_nonzero(l1.weight[1, 2:]) <= 2 and l1.weight[1, 0] > 0
    assert np.count_nonzero(l2.weight[1, 2:]) == NOISE
    assert l1.summary["nonzero_weights"] < l2.summary["nonzero_weights"]


def test_the_options_that_deviate_from_the_paper(data):
    val, train, ood = data["val"], data["train"], data["test_ood"]
    # scaler=val: the refit standardises with the whole val and needs no train rows
    fit = fit_dfr(val, 2, defaults("method", "dfr", scaler="val"), seed=0)
    np.testing.assert_allclose(fit.scaler.mean, val.z.mean(0))
    with pytest.raises(ValueError, match="train split"):
        fit_dfr(val, 2, defaults("method", "dfr"), seed=0)
    # balance=weight: one fit of all of val with 1/group-count weights
    weighted = fit_dfr(val, 2, defaults("method", "dfr", balance="weight"), seed=0, train_z=train.z)
    assert weighted.summary["n_refits"] == 1 and len(weighted.refits[0]) == len(val.g)
    # n_fits: tune scores averaged over that many halvings
    assert len(fit_dfr(val, 2, defaults("method", "dfr", n_fits=3), seed=0, train_z=train.z).halvings) == 3
    # oracle: C by test_ood worst-group accuracy, which it must be given
    oracle = fit_dfr(val, 2, defaults("method", "dfr", selection="oracle"), seed=0, train_z=train.z, oracle=ood)
    assert oracle.summary["tuned_on"] == "test_ood" and "tune_oracle" in oracle.summary["grid"][0]
    with pytest.raises(ValueError, match="test_ood"):
        fit_dfr(val, 2, defaults("method", "dfr", selection="oracle"), seed=0, train_z=train.z)
    # three classes: one-vs-rest liblinear rows
    rng = np.random.default_rng(1)
    y = np.arange(300) % 3
    three = Embedded(rng.standard_normal((300, 4)) + y[:, None], y, y * 2 + (rng.random(300) < 0.5))
    head = fit_dfr(three, 3, defaults("method", "dfr", scaler="val"), seed=0)
    assert head.weight.shape == (3, 4) and ((three.z @ head.weight.T + head.bias).argmax(1) == y).mean() > 0.7


def test_halves_random_as_the_paper_or_stratified():
    g = np.array([0] * 40 + [1] * 7 + [2] * 5 + [3] * 31)
    fit, tune = halves(g, np.random.default_rng(0), "random")
    assert not set(fit) & set(tune) and len(tune) == len(g) // 2 and len(fit) == len(g) - len(g) // 2
    fit, tune = halves(g, np.random.default_rng(0), "stratified")
    assert not set(fit) & set(tune) and len(fit) + len(tune) == len(g)
    for k, n in zip(range(4), (40, 7, 5, 31), strict=True):
        assert (g[fit] == k).sum() == (n + 1) // 2


def test_a_group_missing_from_the_random_fit_half_is_an_error_naming_the_fix():
    val = Embedded(np.arange(20.0)[:, None], np.array([0, 1] * 10), np.array([0, 2] * 9 + [1, 3]))
    with pytest.raises(ValueError, match="halving=stratified"):
        for seed in range(20):  # some seed leaves group 1 or 3 (one row each) out of the fit half
            fit_dfr(val, 2, defaults("method", "dfr", scaler="val"), seed=seed)


# ---- the registry and the DAG ----------------------------------------------------------------


def test_the_registration_reads_the_features_key():
    spec = registry.method("dfr")
    cfg = defaults("method", "dfr")
    assert spec.upstream_method(cfg) == cfg.features and not spec.needs_pretrained(cfg)
    cfg = defaults("method", "dfr", features="pretrained")
    assert spec.upstream_method(cfg) is None and spec.needs_pretrained(cfg)
    assert dag.method_registration("dfr")["upstream"] == spec.upstream == "features"
    with pytest.raises(TypeError, match="upstream must be a key"):
        registry.register_method("dfr_typo", spec.schema, spec.train, upstream="feature")
    with pytest.raises(TypeError, match="pretrained must be one of"):
        registry.register_method("dfr_typo", spec.schema, spec.train, pretrained="feature")


def plan_with(**dfr: object) -> tuple[dict, dict]:
    params = OmegaConf.to_container(OmegaConf.load(ROOT / "params.yaml"))
    params["method"]["dfr"].update(dfr)
    run = {**params["run"], "datasets": ["gaussian_shortcut"]}
    run["methods"] = [m for m in run["methods"] if m in ("erm", "lda", "dfr")]
    run["teachers"] = [t for t in run["teachers"] if t in run["methods"]]  # (what conf/ derives when composed)
    run["models"] = [m for m in run["models"] if m in run["methods"] or m.removesuffix("_student") in run["methods"]]
    return run, params


def test_the_dag_makes_dfr_wait_for_the_model_it_reads():
    run, params = plan_with()
    plan = dag.plan(run, params["dataset"], params["method"], params["phase"], ROOT)
    features = params["method"]["dfr"]["features"]
    item = plan["train"]["gaussian_shortcut-dfr-0"]
    assert item["upstream"] == f"data/models/gaussian_shortcut/{features}/seed=0"
    assert item["pretrained"] == "data/prepared/gaussian_shortcut.parquet"
    assert plan["train"][f"gaussian_shortcut-{features}-0"]["upstream"] == "data/prepared/gaussian_shortcut.parquet"
    run, params = plan_with(features="pretrained")
    item = dag.plan(run, params["dataset"], params["method"], params["phase"], ROOT)["train"]["gaussian_shortcut-dfr-0"]
    assert item["pretrained"] == "data/pretrained/gaussian_shortcut"
    assert item["upstream"] == "data/prepared/gaussian_shortcut.parquet"


@pytest.mark.parametrize("features", ["groupdro", "dfr"])
def test_features_must_name_another_method_of_the_run(features):
    run, params = plan_with(features=features)
    with pytest.raises(ConfigError, match=r"method\.dfr\.features: .*run\.methods"):
        dag.plan(run, params["dataset"], params["method"], params["phase"], ROOT)
    with pytest.raises(ConfigError, match=r"method\.dfr\.features: .*run\.methods"):
        check_upstream("dfr", defaults("method", "dfr", features=features), run["methods"])
