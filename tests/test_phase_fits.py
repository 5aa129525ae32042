"""The phase diagram's two fits as toy analyses make them (stages/phase.py): logistic regression
fitted to convergence and LDA with a d-independent shrinkage agree with scikit-learn on the
same data, also with d_noise ≥ 10 × n_train; the population LDA's closed-form worst-group
accuracy agrees with Monte Carlo and the population logistic regression's with a very large
sample; a cell's interval over seeds and its winner (stages/evaluation/phase_cells.py); the
regime measure predicts cells it was not fitted to; and the covariance shrinkage targets
(stages/models/gaussian.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from stages import phase
from stages.core import registry
from stages.core.config import CONF, defaults, section
from stages.core.schema import ConfigError
from stages.core.settings import PhaseConfig
from stages.datasets.gaussian_shortcut import population_groups, population_lda, sample_split
from stages.evaluation import regime
from stages.evaluation.phase_cells import phase_wins, prediction_agreement, seed_interval, winner
from stages.models.gaussian import shrink
from stages.models.lda_model import fit_lda
from stages.models.schemas import SHRINK_TARGETS


def _phase() -> tuple[PhaseConfig, object, object]:
    """conf/phase/default.yaml's section, its dataset base and its generative classifier."""
    params = OmegaConf.create({"phase": OmegaConf.load(CONF / "phase" / "default.yaml")})
    return section(params, "phase", PhaseConfig), phase.base_config(params), phase.generative_config(params)


def _wga(pred: np.ndarray, y: np.ndarray, g: np.ndarray) -> float:
    return min(float((pred[g == k] == y[g == k]).mean()) for k in np.unique(g))


class _ShrunkCovariance:
    """A scikit-learn covariance estimator: the MLE covariance shrunk like stages/models/gaussian.py."""

    def __init__(self, shrinkage: float, target: str) -> None:
        self.shrinkage, self.target = shrinkage, target

    def get_params(self, deep: bool = True) -> dict:
        return {"shrinkage": self.shrinkage, "target": self.target}

    def fit(self, x: np.ndarray) -> _ShrunkCovariance:
        s = np.cov(x, rowvar=False, bias=True)
        goal = {"scaled_identity": np.trace(s) / len(s) * np.eye(len(s)), "diagonal": np.diag(np.diag(s)), "identity": np.eye(len(s))}
        self.covariance_ = (1 - self.shrinkage) * s + self.shrinkage * goal[self.target]
        return self


@pytest.mark.parametrize(
    ("n_train", "d_noise", "seed"),
    [(32, 512, 0), (400, 16, 1)],  # d ≥ 10 n (separable; the dual route) and n ≫ d (the primal one)
)
def test_phase_fits_agree_with_scikit_learn(n_train: int, d_noise: int, seed: int) -> None:
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression

    pcfg, base, gcfg = _phase()
    assert gcfg.kind == "lda" and gcfg.shrink_target != "scaled_identity"  # a target that does not move with d
    cfg = phase.cell_config(base, {"n_train": n_train, "d_noise": d_noise}, seed)
    ours = phase.compare_cell(cfg, pcfg, gcfg, seed)

    columns, _ = registry.dataset(cfg.kind).generate(cfg)
    split, y, x = columns["split"], columns["y"], columns["x"].astype(np.float64)
    g = y * 2 + columns["a"]
    train, ood = split == "train", split == "test_ood"
    lr = LogisticRegression(C=1.0 / (pcfg.lr_l2 * n_train), solver="lbfgs", tol=1e-12, max_iter=100_000).fit(x[train], y[train])
    lda = LinearDiscriminantAnalysis(solver="lsqr", covariance_estimator=_ShrunkCovariance(gcfg.shrinkage, gcfg.shrink_target))
    lda.fit(x[train], y[train])
    assert abs(ours["discriminative_wga"] - _wga(lr.predict(x[ood]), y[ood], g[ood])) <= 0.01
    assert abs(ours["generative_wga"] - _wga(lda.predict(x[ood]), y[ood], g[ood])) <= 0.01

    fit = phase.fit_logistic(x[train], y[train], pcfg.lr_l2, pcfg.lr_tol)
    assert fit.grad_max < pcfg.lr_tol and fit.iterations == ours["discriminative_iterations"] < 40
    cosine = fit.weight @ lr.coef_[0] / np.linalg.norm(fit.weight) / np.linalg.norm(lr.coef_[0])
    assert cosine > 0.999 and fit.bias == pytest.approx(lr.intercept_[0], abs=0.02 * max(1.0, abs(fit.bias)))
    if d_noise >= 10 * n_train:
        assert ours["discriminative_train_acc"] == 1.0  # separable: only λ > 0 keeps the optimum finite


def test_logistic_regression_needs_a_penalty_and_both_classes() -> None:
    x = np.random.default_rng(0).normal(size=(20, 3))
    with pytest.raises(ValueError, match="l2 must be > 0"):
        phase.fit_logistic(x, np.arange(20) % 2, 0.0, 1e-10)
    with pytest.raises(ValueError, match="labels 0 and 1"):
        phase.fit_logistic(x, np.zeros(20, dtype=int), 1e-3, 1e-10)
    with pytest.raises(ValueError, match="did not converge"):
        phase.fit_logistic(x, np.arange(20) % 2, 1e-3, 1e-10, max_steps=1)
    with pytest.raises(ConfigError, match="phase.lr_l2"):
        section(OmegaConf.create({"phase": {**OmegaConf.to_container(OmegaConf.load(CONF / "phase/default.yaml")), "lr_l2": 0.0}}), "phase", PhaseConfig)


@pytest.mark.parametrize(
    "knobs",
    [
        {"spurious_scale": 0.25, "rho_train": 0.9, "rho_ood": 0.0},  # the two disagreeing groups only
        {"spurious_scale": 0.5, "rho_train": 0.8, "rho_ood": 0.3, "cue_dims": 2, "d_noise": 4},  # all four; a non-diagonal Σ
    ],
)
def test_population_wga_is_the_population_lda_rule_on_fresh_draws(knobs: dict) -> None:
    """population_wga against a Monte-Carlo estimate of the same rule, and against LDA fitted
    (without shrinkage) to many examples: what the sample LDA heads for as n_train grows."""
    _, base, _ = _phase()
    cfg = dataclasses.replace(base, **knobs)
    exact = phase.population_worst_group(cfg)
    assert exact is not None and 0.2 < exact < 0.8

    means, cov, priors = population_lda(cfg)
    w = np.linalg.solve(cov, means[1] - means[0])
    b = -0.5 * (means[1] + means[0]) @ w + math.log(priors[1] / priors[0])
    n = 200_000
    y, a, x = sample_split(cfg, n, cfg.rho_ood, np.random.default_rng(7))
    g = 2 * y + a
    monte_carlo = _wga(((x @ w + b) > 0).astype(int), y, g)
    smallest = min(c for c in np.bincount(g) if c > 0)
    assert abs(monte_carlo - exact) < 4 * math.sqrt(exact * (1 - exact) / smallest)

    yt, _, xt = sample_split(cfg, 100_000, cfg.rho_train, np.random.default_rng(8))
    big = fit_lda(xt, yt, 2, 0.0)
    assert abs(_wga(big.logits(x).argmax(1), y, g) - exact) < 0.01


def test_population_wga_is_none_without_a_closed_form() -> None:
    other = next(k for k, s in registry.datasets().items() if s.generate is not None and k != "gaussian_shortcut")
    assert phase.population_worst_group(defaults("dataset", other)) is None
    assert phase.population_worst_groups(defaults("dataset", other)) is None


def test_population_logistic_regression_line_is_the_large_sample_fit() -> None:
    """The phase's population logistic regression (the dash-dotted line) against scikit-learn's,
    fitted to 300,000 train rows of the base cell, both scored exactly on the test_ood groups."""
    from sklearn.linear_model import LogisticRegression

    _, base, _ = _phase()
    cfg = dataclasses.replace(base, d_noise=2)
    lda, lr = phase.population_worst_groups(cfg)
    assert lda == pytest.approx(phase.population_worst_group(cfg)) and lda < 0.05 < 0.3 < lr < 0.35
    y, _, x = sample_split(cfg, 300_000, cfg.rho_train, np.random.default_rng(3))
    fit = LogisticRegression(C=1e6, tol=1e-10, max_iter=10_000).fit(x.astype(np.float64), y)
    w, b = fit.coef_[0], fit.intercept_[0]
    accs = []
    for group in population_groups(cfg, cfg.rho_ood):
        if group.prob > 0:
            margin = (float(group.mean @ w) + b) / math.sqrt(float(w @ group.cov @ w))
            accs.append(0.5 * math.erfc(-(margin if group.y == 1 else -margin) / math.sqrt(2)))
    assert min(accs) == pytest.approx(lr, abs=0.01)


# ---- a cell's interval and winner, and the regime's calls against cells ----------------------


def test_seed_interval_covers_the_mean_at_its_level_over_many_draws() -> None:
    """Statistical: 2,000 draws of 10 seeds' differences (normal, mean 0.03, sd 0.05): the 95 %
    t interval holds 0.03 in 93–97 % of them (binomial sd 0.5 %), where a normal-quantile
    interval would hold it in ~92 %."""
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(2000):
        mean, low, high = seed_interval(rng.normal(0.03, 0.05, size=10))
        covered += low <= 0.03 <= high
        assert low < mean < high
    assert 0.93 <= covered / 2000 <= 0.97
    assert seed_interval([0.2]) == (0.2, None, None)
    mean, low, high = seed_interval([0.1, 0.3])  # t at 1 degree of freedom: 12.7 × sd/√2
    assert (low, high) == (pytest.approx(0.2 - 12.7062 * 0.1414214 / math.sqrt(2), rel=1e-4), pytest.approx(0.2 + 1.27062, rel=1e-4))


def test_winners_ties_and_the_regimes_calls_are_counted_apart() -> None:
    assert [winner(0.01, 0.2), winner(-0.2, -0.01), winner(-0.1, 0.1), winner(None, None)] == [
        "generative", "discriminative", "tie", "tie"
    ]
    cells = [
        {"winner": "discriminative", "predicted": "more"},
        {"winner": "tie", "predicted": "more"},
        {"winner": "generative", "predicted": "more"},
        {"winner": "generative", "predicted": "less"},
        {"winner": "tie", "predicted": None},
        {"winner": "generative", "predicted": None},
    ]
    assert phase_wins(cells) == (3, 1, 2) and phase_wins(cells).tie == 2
    assert prediction_agreement(cells) == (4, 2, 1, 1, 2, 1, 1, 0)


@pytest.mark.parametrize(
    ("knobs", "call", "measured"),
    [
        # the shortcut regime: the population gap is −0.32 and logistic regression wins
        ({"spurious_scale": 1.0, "rho_train": 0.95}, "more", "discriminative"),
        # cue 20 ≫ core 2, but at ρ = 0.6 (separation alone says "more"): no call, a tie
        ({"spurious_scale": 2.0, "rho_train": 0.6}, None, "tie"),
        # cue 0.5 < core 2 (separation alone says "less"): no call, a tie
        ({"spurious_scale": 0.05, "rho_train": 0.95}, None, "tie"),
    ],
)
def test_regime_measure_predicts_cells_it_was_not_fitted_to(knobs: dict, call: str | None, measured: str) -> None:
    """Three cells of the phase diagram's separation × ρ panel at d/n 0.05, 12 seeds each (data
    redrawn per seed), run as the stage runs them: the regime's call (from the dataset's
    closed-form separation dict) names the measured winner, and where it calls, the measured
    difference is within 0.06 of the population gap (the finite-sample part)."""
    pcfg, base, gcfg = _phase()
    cells = [phase.compare_cell(phase.cell_config(base, {**knobs, "n_train": 200}, s), pcfg, gcfg, s) for s in range(12)]
    sep = cells[0]["separation"]
    assert (sep["cue"] > sep["core"]) == (knobs["spurious_scale"] >= 1.0)  # what separation alone would call
    mean, low, high = seed_interval([c["generative_wga"] - c["discriminative_wga"] for c in cells])
    assert regime.expected_use(sep) == call and winner(low, high) == measured, (sep, mean, low, high)
    if call is not None:
        assert abs(mean - sep["gap"]) < 0.06


# ---- shrinkage targets ------------------------------------------------------------------------


def test_shrink_targets() -> None:
    rng = np.random.default_rng(0)
    s = np.cov(rng.normal(size=(30, 5)) * [1.0, 2.0, 3.0, 0.5, 1.5], rowvar=False)
    cov = torch.tensor(s)
    lam = 0.3
    expected = {
        "scaled_identity": (1 - lam) * s + lam * np.trace(s) / 5 * np.eye(5),
        "diagonal": (1 - lam) * s + lam * np.diag(np.diag(s)),
        "identity": (1 - lam) * s + lam * np.eye(5),
    }
    assert set(expected) == set(SHRINK_TARGETS)
    for target, want in expected.items():
        got = shrink(cov, lam, target)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)
        assert torch.equal(got, got.T)
        stacked = shrink(torch.stack([cov, 2 * cov]), lam, target)  # QDA's per-class stack
        np.testing.assert_allclose(stacked[0].numpy(), want, rtol=1e-12, atol=1e-14)
    # diagonal leaves a diagonal covariance unchanged; only scaled_identity moves when
    # independent dimensions are added (the phase diagram's noise dimensions)
    diag = torch.diag(torch.tensor([1.0, 4.0, 0.25]))
    assert torch.equal(shrink(diag, 0.7, "diagonal"), diag)
    wider = torch.block_diag(cov, 100.0 * torch.eye(50, dtype=torch.float64))
    for target in SHRINK_TARGETS:
        same = torch.allclose(shrink(wider, lam, target)[:5, :5], shrink(cov, lam, target), rtol=1e-12, atol=1e-14)
        assert same == (target != "scaled_identity"), target
    with pytest.raises(ValueError, match="shrink target must be one of"):
        shrink(cov, lam, "nope")


def test_lda_and_qda_read_the_shrink_target() -> None:
    rng = np.random.default_rng(1)
    x = np.c_[rng.normal(size=(60, 3)) * [1.0, 5.0, 0.2], np.zeros(60)]  # the last feature is constant
    y = np.arange(60) % 2
    for method in ("lda", "qda"):
        spec = registry.method(method)
        cfg = defaults("method", method)
        assert cfg.shrink_target == "scaled_identity"  # conf/method: constant pixels keep it the default
        assert spec.fit(x, y, 2, cfg) is not None
        assert spec.fit(x, y, 2, dataclasses.replace(cfg, shrink_target="identity")) is not None
        with pytest.raises(ValueError, match="not positive definite"):  # a constant feature: diag(Σ) is singular
            spec.fit(x, y, 2, dataclasses.replace(cfg, shrink_target="diagonal"))
        with pytest.raises(ConfigError, match=f"method.{method}.shrink_target"):
            defaults("method", method, shrink_target="nope")
    model = fit_lda(x[:, :3], y, 2, 0.4, "diagonal")
    s = np.cov(x[:, :3][y == 0] - x[:, :3][y == 0].mean(0), rowvar=False, bias=True) * 30
    s += np.cov(x[:, :3][y == 1] - x[:, :3][y == 1].mean(0), rowvar=False, bias=True) * 30
    s /= 60 - 2  # the pooled covariance, n − K denominator
    np.testing.assert_allclose(model.covariance.numpy(), 0.6 * s + 0.4 * np.diag(np.diag(s)), rtol=1e-10)


def test_report_draws_the_population_answers_beside_each_panel_and_ties_grey() -> None:
    from stages.reporting import figures, phase_section
    cells = [
        {"panel": 0, "x_knob": "n_train", "x": float(n), "y_knob": "d_noise", "y": float(d), "diff": 0.1 - 0.001 * n,
         "diff_low": 0.05 - 0.001 * n, "diff_high": 0.15 - 0.001 * n, "seeds": 10,
         "winner": winner(0.05 - 0.001 * n, 0.15 - 0.001 * n),
         "generative_wga": 0.3, "discriminative_wga": 0.2 + 0.001 * n, "population_wga": 0.011, "population_lr_wga": 0.328,
         "predicted": "more", "d_over_n": (2 + d) / n, "separation": {"cue": 10.0},
         "l2_lines": [{"l2": 0.01, "wga": 0.25, "ood_acc": 0.5}]}
        for n in (25, 200) for d in (0, 2048)
    ]
    figs = phase_section.phase_figures(cells)
    assert [name for name, _, _ in figs] == ["phase-0", "phase-0-lines"]
    heat, lines = figs[0][2], figs[1][2]
    assert "population LDA 0.011" in heat and "population LR 0.328" in heat and "LR λ=0.01 0.250" in heat  # tooltips
    assert "interval [+0.025, +0.125]" in heat and "regime call: more" in heat
    # n 25: +0.075 [+0.025, +0.125] is a win, coloured; n 200: −0.1 [−0.15, −0.05] too; ...
    assert heat.count(figures.TIE_FILL) == 0
    tied = [dict(c, winner="tie") if c["x"] == 25.0 else c for c in cells]
    assert phase_section.phase_figures(tied)[0][2].count(figures.TIE_FILL) == 2  # ... unless the interval holds 0
    assert "grey: a tie" in figs[0][1]
    assert lines.count('stroke-dasharray="1 3"') == 2 + 1  # a dotted population LDA line per d_noise + its legend
    assert lines.count('stroke-dasharray="6 2 1 2"') == 2 + 1  # and a dash-dotted population logistic regression
    assert "25 (cue 10)" in lines and "population" in figs[1][1]
    without = phase_section.phase_figures([{k: v for k, v in c.items() if not k.startswith("population")} for c in cells])
    assert 'stroke-dasharray="1 3"' not in without[1][2] and 'stroke-dasharray="6 2 1 2"' not in without[1][2]
    text, _ = phase_section.phase_section(tied)
    assert "10 seeds per cell" in text and "2 are ties" in text and "at d/n < 1 (2 cells), it calls 2" in text
