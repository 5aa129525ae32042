"""Trained to convergence, visibly: the training objective per epoch in history.parquet, the
plateau test behind the under-training and over-fitting flags (`history.convergence`), the same
test as the generative models' stopping rule (`history.plateau_stop`), and where the report
shows it.

The statistical tests draw many synthetic val-objective curves with fixed seeds and assert a
rate with a stated tolerance: flat curves (the flag must not fire: nominal 1 %), curves still
falling (it must), curves rising past their minimum (over-fitting, never "under-trained")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages import train
from stages.core.artifacts import HISTORY_SCHEMA, LEADERBOARD_SCHEMA, model_dir
from stages.core.io import read_json, read_parquet
from stages.models import CONFIG, HISTORY
from stages.models.diffusion_model import train_diffusion
from stages.models.history import (
    PLATEAU_ALPHA,
    PLATEAU_GAIN,
    PLATEAU_MIN_EPOCHS,
    PLATEAU_WINDOW,
    convergence,
    history_rows,
    plateau_stop,
    trend,
)
from stages.reporting import render
from tests.test_evaluate_report import fake_metrics
from tests.test_generative import blobs, diffusion_cfg
from tests.test_train import DS, write_prepared


def curve(values: list[float] | np.ndarray) -> list[dict]:
    """History rows with `values` as the val objective of epochs 1..n (and a train row each)."""
    rows = []
    for e, v in enumerate(values, 1):
        rows += history_rows(e, {}, {"train": float(v) + 0.1, "val": float(v)})
    return rows


# ---- the rule -----------------------------------------------------------------------------------


def test_the_test_is_a_one_sided_slope_test_on_the_last_quarter_of_the_epochs():
    assert (PLATEAU_WINDOW, PLATEAU_MIN_EPOCHS, PLATEAU_ALPHA, PLATEAU_GAIN) == (0.25, 8, 0.01, 0.01)
    # 40 epochs: the window is the last 10; 12 epochs: the last 8 (the minimum).
    falling = convergence(curve(np.linspace(3.0, 1.0, 40)))
    assert falling["window"] == [31, 40] and falling["epochs"] == 40 and falling["flag"] == "may be under-trained"
    assert convergence(curve(np.linspace(3.0, 1.0, 12)))["window"] == [5, 12]
    # The line's fitted fall over the window relative to its fitted start (exactly linear here).
    start, end = 3.0 - 2.0 * 30 / 39, 1.0
    assert falling["improvement"] == pytest.approx((start - end) / start)
    assert falling["p_falling"] == 0.0 and falling["overfitting"] is False
    assert falling["test"] == {"window": 0.25, "min_epochs": 8, "alpha": 0.01, "gain": 0.01}
    # The slope's p-value is Student's t of the least-squares slope, n - 2 degrees of freedom.
    values = [1.0, 0.97, 0.99, 0.95, 0.96, 0.93, 0.94, 0.92]
    fit = trend(values)
    x = np.arange(8.0)
    slope, intercept = np.polyfit(x, values, 1)
    se = math.sqrt(np.sum((np.array(values) - intercept - slope * x) ** 2) / 6 / np.sum((x - x.mean()) ** 2))
    from scipy import stats

    assert fit.slope == pytest.approx(slope) and fit.p_falling == pytest.approx(stats.t.cdf(slope / se, 6))


def test_a_fall_must_be_significant_and_larger_than_one_percent():
    # Significant but tiny: a clean fall of 0.5 % over the window is a plateau.
    tiny = convergence(curve(1.0 - 0.0005 * np.arange(40)))
    assert tiny["p_falling"] < 0.01 and 0 < tiny["improvement"] < 0.01 and tiny["flag"] == "plateaued"
    # Large but noisy: a 3 % fall under 5 % noise is not evidence of one.
    rng = np.random.default_rng(1)
    noisy = convergence(curve(1.0 - 0.003 * np.arange(40) + 0.05 * rng.standard_normal(40)))
    assert noisy["p_falling"] > 0.01 and noisy["flag"] == "plateaued"


def test_a_rising_val_objective_is_over_fitting_not_under_training():
    # The case: the val objective rose 7.5 % at the end of training.
    values = list(np.linspace(1.0, 0.6, 20)) + list(np.linspace(0.6, 0.645, 10))
    c = convergence(curve(values))
    assert c["flag"] == "plateaued" and c["overfitting"] is True and c["improvement"] < -0.01
    assert c["best_epoch"] == 20 and "over-fitting" in c["why"] and "lowest at epoch 20" in c["why"]


def test_a_fall_that_never_regains_an_earlier_best_is_not_under_training():
    """The audit's groupdro curve: lowest at epoch 10, then a rise, then 70 epochs falling back
    without reaching it. The window's line falls significantly, but more epochs have not beaten
    epoch 10 so far: "plateaued", not "may be under-trained"; with a new low it is flagged."""
    values = list(np.linspace(1.0, 0.50, 10)) + list(np.linspace(0.52, 0.90, 10)) + list(np.linspace(0.90, 0.60, 60))
    c = convergence(curve(values))
    assert c["improvement"] > PLATEAU_GAIN and c["p_falling"] < PLATEAU_ALPHA  # the line does fall ...
    assert c["flag"] == "plateaued" and c["best_epoch"] == 10  # ... but not below epoch 10's value
    assert "came before the window and was not regained" in c["why"]
    regained = values[:-20] + list(np.linspace(values[-21], 0.45, 20))
    assert convergence(curve(regained))["flag"] == "may be under-trained"


def test_a_minimum_budget_delays_the_plateau_stop():
    """min_epochs: the plateau test may not stop training before it; the same run with 0 stops
    earlier on the same curve."""
    prepared = blobs(n_classes=2, n=400, seed=4)
    kw = dict(epochs=40, eval_every=3, steps=20, draws=4, select_draws=2, patience=2, lr=1e-2)
    _, early = train_diffusion(prepared, diffusion_cfg(**kw), seed=0)
    first = max(r["epoch"] for r in early.history.to_pylist())
    _, late = train_diffusion(prepared, diffusion_cfg(**kw, min_epochs=first + 5), seed=0)
    last = max(r["epoch"] for r in late.history.to_pylist())
    assert early.stopped == "plateau" and last >= first + 5 and late.stopped in ("plateau", "budget")


def test_too_few_epochs_or_none_is_not_applicable():
    short = convergence(curve([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]))
    assert short["flag"] == "n/a" and short["improvement"] is None and "too few epochs: 7" in short["why"]
    assert short["overfitting"] is False and short["best_epoch"] == 7
    # A closed-form model's history: epoch 0, scored, no objective.
    scored = {s: {"loss": 0.3, "acc": 0.9, "worst_group_acc": 0.8} for s in ("train", "val")}
    closed = convergence(history_rows(0, scored))
    assert closed["flag"] == "n/a" and closed["epochs"] == 0 and "no epochs" in closed["why"]
    # An exactly flat window: no noise, no slope.
    flat = convergence(curve([2.0, 1.0] + [0.5] * 10))
    assert flat["flag"] == "plateaued" and flat["improvement"] == 0 and flat["p_falling"] == 0.5


# ---- its error rates on synthetic curves (fixed seeds, stated tolerances) -----------------------

DRAWS = 1000
EPOCHS = (10, 30, 80)


def rates(make, epochs: int, seed: int) -> tuple[float, float]:
    """(share flagged "may be under-trained", share flagged over-fitting) over DRAWS curves."""
    rng = np.random.default_rng(seed)
    under = over = 0
    for _ in range(DRAWS):
        c = convergence(curve(make(rng, epochs)))
        under += c["flag"] == "may be under-trained"
        over += c["overfitting"]
    return under / DRAWS, over / DRAWS


def flat(sd: float):
    return lambda rng, n: 1.0 + sd * rng.standard_normal(n)


def ar1(sd: float, phi: float = 0.5):
    """Flat with AR(1) noise: each epoch carries `phi` of the previous epoch's deviation."""
    def make(rng: np.random.Generator, n: int) -> np.ndarray:
        e = sd * rng.standard_normal(n)
        x = np.empty(n)
        x[0] = e[0] / math.sqrt(1 - phi * phi)
        for i in range(1, n):
            x[i] = phi * x[i - 1] + e[i]
        return 1.0 + x
    return make


@pytest.mark.parametrize("epochs", EPOCHS)
@pytest.mark.parametrize("sd", [0.01, 0.05])
def test_flat_noisy_curves_are_flagged_at_most_the_nominal_rate(epochs, sd):
    """Nominal 1 % each way (PLATEAU_ALPHA); tolerance 1.5 points (5 binomial SEs at 1000 draws);
    the issue's bound is 5 %. The old rule (best of the last 20 % vs the epoch before) fired on
    58-75 % of such curves at 1 % noise."""
    under, over = rates(flat(sd), epochs, seed=epochs)
    assert under <= 0.025 and over <= 0.025


@pytest.mark.parametrize("epochs", EPOCHS)
def test_flat_curves_with_serially_correlated_noise_are_flagged_rarely(epochs):
    """AR(1) noise, lag-1 correlation 0.5: the test assumes independent noise, so its rate rises
    (measured 4.5-8 %, docs/metrics.md); tolerance: at most 10 %."""
    under, over = rates(ar1(0.01), epochs, seed=100 + epochs)
    assert under <= 0.10 and over <= 0.10


@pytest.mark.parametrize("epochs", [20, 30, 80])
def test_curves_still_falling_are_flagged(epochs):
    """0.5 + 0.5·exp(−epoch/E) with 1 % noise: the last quarter still falls ~5 %. Power measured
    85-100 %; asserted at least 75 %, and never over-fitting."""
    def make(rng: np.random.Generator, n: int) -> np.ndarray:
        return 0.5 + 0.5 * np.exp(-np.arange(1, n + 1) / n) + 0.01 * rng.standard_normal(n)
    under, over = rates(make, epochs, seed=200 + epochs)
    assert under >= 0.75 and over == 0.0


@pytest.mark.parametrize("epochs", [20, 30, 80])
def test_curves_rising_past_their_minimum_are_over_fitting_never_under_trained(epochs):
    """A fast fall, a minimum at 60 % of the run, then a 10 % rise, 1 % noise: over-fitting in at
    least 85 % of draws (measured 95-100 %), "may be under-trained" in none."""
    def make(rng: np.random.Generator, n: int) -> np.ndarray:
        t = np.arange(1, n + 1) / n
        return 1.0 + 0.5 * np.exp(-8 * t) + 0.25 * np.maximum(0.0, t - 0.6) + 0.01 * rng.standard_normal(n)
    under, over = rates(make, epochs, seed=300 + epochs)
    assert over >= 0.85 and under == 0.0


# ---- the stopping rule ------------------------------------------------------------------------


def test_the_stopping_rule_stops_flat_curves_and_never_leaves_a_stopped_model_flagged():
    rng = np.random.default_rng(7)
    stops = []
    for _ in range(200):
        falling = 0.5 + 0.5 * np.exp(-np.arange(1, 81) / 8) + 0.01 * rng.standard_normal(80)
        for patience in (1, 3):
            at = next((e for e in range(1, 81) if plateau_stop(list(falling[:e]), patience)), None)
            if at is not None:
                c = convergence(curve(falling[:at]))
                assert c["flag"] == "plateaued" and c["improvement"] <= PLATEAU_GAIN
                if patience == 3:  # the two epochs before qualified too
                    assert all(convergence(curve(falling[:k]))["improvement"] <= PLATEAU_GAIN for k in (at - 2, at - 1))
                stops.append(at)
    # The curve flattens by epoch ~40 (e^-5): every run stops, none before the window's minimum.
    assert len(stops) == 400 and min(stops) >= PLATEAU_MIN_EPOCHS and max(stops) <= 80
    # A curve still falling steadily never stops; patience 0 never stops.
    steady = list(np.linspace(2.0, 1.0, 60))
    assert not any(plateau_stop(steady[:e], 1) for e in range(1, 61))
    assert not plateau_stop([1.0] * 30, 0) and plateau_stop([1.0] * 30, 3)


def test_a_generative_model_stops_on_the_plateau_and_its_flag_says_so():
    """A diffusion model with patience: training ends on the plateau test, well inside its budget;
    that epoch is scored (selection sees it), the flag computed on what was run is "plateaued"."""
    prepared = blobs(n_classes=2, n=400, seed=4)
    cfg = diffusion_cfg(epochs=40, eval_every=3, steps=20, draws=4, select_draws=2, patience=2, lr=1e-2)
    model, result = train_diffusion(prepared, cfg, seed=0)
    rows = result.history.to_pylist()
    last = max(r["epoch"] for r in rows)
    assert result.stopped == "plateau" and result.budget == 40 and PLATEAU_MIN_EPOCHS + 1 <= last < 40
    assert {r["split"] for r in rows if r["epoch"] == last and r["acc"] is not None} == {"val", "test_ood"}
    assert plateau_stop([r["objective"] for r in rows if r["split"] == "val"], 2)
    c = convergence(result.history, budget=result.budget, stopped=result.stopped)
    assert c["flag"] == "plateaued" and c["stopped"] == "plateau" and c["budget"] == 40 and c["epochs"] == last
    assert "training stopped here on this test (budget 40 epochs)" in c["why"]
    # The same run without patience trains every epoch of the budget.
    _, whole = train_diffusion(prepared, diffusion_cfg(epochs=last + 2, eval_every=3, steps=20, draws=4, select_draws=2,
                                                       patience=0, lr=1e-2), seed=0)
    assert whole.stopped == "budget" and max(r["epoch"] for r in whole.history.to_pylist()) == last + 2


# ---- history of real trainings -------------------------------------------------------------------


@pytest.fixture
def workdir(workdir):
    """conftest's workdir with a prepared file written."""
    write_prepared(workdir)
    return workdir


@pytest.mark.parametrize("method", ["erm", "groupdro", "jtt"])
def test_a_trained_classifier_records_train_and_val_objective_every_epoch(workdir, method):
    fast = [f"method.{method}.epochs=9", f"method.{method}.hidden=[8]"]
    assert train.main([DS, method, "0", *fast, *(["method.jtt.id_epochs=1", "method.jtt.id_epochs_grid=[]", "method.jtt.upweight=5"] if method == "jtt" else [])]) == 0
    folder = model_dir(DS, method, 0)
    rows = read_parquet(folder / HISTORY, HISTORY_SCHEMA).to_pylist()
    objective = [(r["epoch"], r["split"]) for r in rows if r["objective"] is not None]
    assert objective == [(e, s) for e in range(1, 10) for s in ("train", "val")]
    # A classifier is scored every epoch on every split; the test splits carry no objective.
    assert all(r["acc"] is not None for r in rows) and len(rows) == 9 * 4
    val = [r for r in rows if r["split"] == "val"]
    if method == "erm":  # ERM's objective is the cross-entropy the `loss` column holds
        assert all(r["objective"] == pytest.approx(r["loss"], rel=1e-5) for r in val)
    if method == "groupdro":  # the worst group's loss: at least the average loss
        assert all(r["objective"] >= r["loss"] - 1e-6 for r in val)
    config = read_json(folder / CONFIG)
    record = config["convergence"]
    assert record["flag"] in ("may be under-trained", "plateaued") and record["epochs"] == 9 and record["window"] == [2, 9]
    assert record["val_objective"] == [r["objective"] for r in val]
    assert (record["budget"], record["stopped"], config["final_epoch"]) == (9, "budget", 9)
    assert record == convergence(rows, budget=9, stopped="budget")


def test_diffusion_records_its_denoising_loss_every_epoch_on_fixed_draws():
    prepared = blobs(n_classes=2, n=120, seed=4)
    cfg = diffusion_cfg(epochs=4, eval_every=3, steps=20, draws=4, select_draws=2)
    model, result = train_diffusion(prepared, cfg, seed=0)
    rows = result.history.to_pylist()
    assert [(r["epoch"], r["split"]) for r in rows if r["objective"] is not None] == [
        (e, s) for e in (1, 2, 3, 4) for s in ("train", "val")
    ]
    # Scored (all splits) only at epochs 3 and 4: classification columns null elsewhere.
    assert sorted({r["epoch"] for r in rows if r["acc"] is not None}) == [3, 4]
    assert [r["split"] for r in rows if r["epoch"] == 1] == ["train", "val"]
    # The val objective is the training loss on draws fixed by score_seed: the same value every call,
    # and the global RNG is left alone (so checkpoints resume byte-identically).
    val = prepared.subset("val")
    x, y = torch.from_numpy(val.x), torch.from_numpy(val.y.astype("int64"))
    state = torch.get_rng_state()
    first = model.denoising_loss(x, y)
    assert model.denoising_loss(x, y) == first and torch.equal(torch.get_rng_state(), state)
    if result.selected_epoch == 4:
        assert first == pytest.approx([r["objective"] for r in rows if r["split"] == "val"][-1])
    assert convergence(result.history)["epochs"] == 4


# ---- the report ----------------------------------------------------------------------------------


def test_the_report_flags_under_trained_models_in_its_table_and_leaderboard():
    values = [3.0, 2.6, 2.3, 2.0, 1.8, 1.6, 1.4, 1.3, 1.2, 1.1]
    flagged = convergence(curve(values))
    assert flagged["flag"] == "may be under-trained"
    runs = []
    for seed in (0, 1):
        erm, lda = fake_metrics("gauss", "erm", seed), fake_metrics("gauss", "lda", seed)
        erm["model_config"] = {**erm["model_config"], "convergence": flagged}
        runs += [erm, lda]
    built = render.build_report(runs)
    table = built.markdown.split("## gauss")[1]
    erm_row = next(line for line in table.splitlines() if line.startswith("| erm |"))
    lda_row = next(line for line in table.splitlines() if line.startswith("| lda |"))
    assert f"**may be under-trained** (improved {flagged['improvement']:.1%}, 2/2 seeds)" in erm_row and "| n/a |" in lda_row
    assert "| training |" in table
    board = built.leaderboard
    assert board.schema == LEADERBOARD_SCHEMA
    erm = [r for r in board.to_pylist() if r["model"] == "erm"]
    assert {r["convergence"] for r in erm} == {"may be under-trained"}
    assert erm[0]["convergence_improvement"] == pytest.approx(flagged["improvement"])
    assert {(r["convergence"], r["convergence_improvement"]) for r in board.to_pylist() if r["model"] == "lda"} == {("n/a", None)}
    # The curves: one per model trained by epochs, relative to epoch 1.
    assert 'id="fig-gauss-objective"' in built.html
    assert [r["relative"] for r in built.plots["objective"]] == pytest.approx([v / 3.0 for v in values])
