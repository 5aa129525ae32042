"""Trained to convergence, visibly: the training objective per epoch in history.parquet, the
under-training flag (`history.convergence`) and where the report shows it."""

from __future__ import annotations

import pytest
import torch

from stages import train
from stages.core.artifacts import HISTORY_SCHEMA, LEADERBOARD_SCHEMA, model_dir
from stages.core.io import read_json, read_parquet
from stages.models import CONFIG, HISTORY
from stages.models.diffusion_model import train_diffusion
from stages.models.history import (
    UNDERTRAINED_GAIN,
    UNDERTRAINED_MIN_EPOCHS,
    UNDERTRAINED_WINDOW,
    convergence,
    history_rows,
)
from stages.reporting import render
from tests.test_evaluate_report import fake_metrics
from tests.test_generative import blobs, diffusion_cfg
from tests.test_train import DS, write_prepared


def curve(values: list[float]) -> list[dict]:
    """History rows with `values` as the val objective of epochs 1..n (and a train row each)."""
    rows = []
    for e, v in enumerate(values, 1):
        rows += history_rows(e, {}, {"train": v + 0.1, "val": v})
    return rows


# ---- the rule -----------------------------------------------------------------------------------


def test_a_val_objective_still_falling_in_the_last_fifth_is_flagged():
    # 10 epochs: the window is epochs 9-10, measured from epoch 8's value (1.0) to the best in it (0.9).
    c = convergence(curve([3.0, 2.5, 2.0, 1.7, 1.4, 1.2, 1.1, 1.0, 0.95, 0.9]))
    assert c["flag"] == "may be under-trained" and c["window"] == [9, 10] and c["epochs"] == 10
    assert c["improvement"] == pytest.approx(0.1)
    assert c["val_objective"][-1] == 0.9 and "+10.0%" in c["why"]


def test_a_plateau_or_a_rising_val_objective_is_not_flagged():
    flat = convergence(curve([3.0, 1.0, 0.6, 0.5, 0.5, 0.5, 0.499, 0.5, 0.498, 0.497]))
    assert flat["flag"] == "plateaued" and flat["improvement"] == pytest.approx(0.003 / 0.5)
    # Overfitting: val objective going up in the window is no improvement.
    rising = convergence(curve([1.0, 0.5, 0.4, 0.45, 0.5]))
    assert rising["flag"] == "plateaued" and rising["improvement"] < 0
    # Exactly at the threshold (here 25 %, exact in binary): not more than it, not flagged.
    edge = convergence(curve([2.0, 1.0, 1.0, 0.75]), gain=0.25)
    assert edge["flag"] == "plateaued" and edge["improvement"] == 0.25
    assert convergence(curve([2.0, 1.0, 1.0, 0.74]), gain=0.25)["flag"] == "may be under-trained"


def test_the_window_is_a_fifth_of_the_epochs_but_at_least_two():
    # 40 epochs: the last 8; the improvement is counted from epoch 32.
    values = [1.0] * 32 + [0.99] * 7 + [0.5]
    c = convergence(curve(values))
    assert c["window"] == [33, 40] and c["flag"] == "may be under-trained"
    # 3 epochs is the fewest the check can judge (two in the window and one before it).
    assert convergence(curve([1.0, 0.9, 0.5]))["window"] == [2, 3]


def test_too_few_epochs_or_none_is_not_applicable():
    short = convergence(curve([1.0, 0.5]))
    assert short["flag"] == "n/a" and short["improvement"] is None and "too few epochs" in short["why"]
    # A closed-form model's history: epoch 0, scored, no objective.
    scored = {s: {"loss": 0.3, "acc": 0.9, "worst_group_acc": 0.8} for s in ("train", "val")}
    closed = convergence(history_rows(0, scored))
    assert closed["flag"] == "n/a" and closed["epochs"] == 0 and "no epochs" in closed["why"]


def test_the_report_explains_the_thresholds_the_rule_uses():
    assert (UNDERTRAINED_WINDOW, UNDERTRAINED_MIN_EPOCHS, UNDERTRAINED_GAIN) == (0.2, 2, 0.01)
    assert "more than 1% over the last 20% of its epochs (at least 2)" in " ".join(render.INTRO.split())


# ---- history of real trainings -------------------------------------------------------------------


@pytest.fixture
def workdir(workdir):
    """conftest's workdir with a prepared file written."""
    write_prepared(workdir)
    return workdir


@pytest.mark.parametrize("method", ["erm", "groupdro", "jtt"])
def test_a_trained_classifier_records_train_and_val_objective_every_epoch(workdir, method):
    fast = [f"method.{method}.epochs=4", f"method.{method}.hidden=[8]"]
    assert train.main([DS, method, "0", *fast, *(["method.jtt.id_epochs=1"] if method == "jtt" else [])]) == 0
    folder = model_dir(DS, method, 0)
    rows = read_parquet(folder / HISTORY, HISTORY_SCHEMA).to_pylist()
    objective = [(r["epoch"], r["split"]) for r in rows if r["objective"] is not None]
    assert objective == [(e, s) for e in (1, 2, 3, 4) for s in ("train", "val")]
    # A classifier is scored every epoch on every split; the test splits carry no objective.
    assert all(r["acc"] is not None for r in rows) and len(rows) == 4 * 4
    val = [r for r in rows if r["split"] == "val"]
    if method == "erm":  # ERM's objective is the cross-entropy the `loss` column holds
        assert all(r["objective"] == pytest.approx(r["loss"], rel=1e-5) for r in val)
    if method == "groupdro":  # the worst group's loss: at least the average loss
        assert all(r["objective"] >= r["loss"] - 1e-6 for r in val)
    record = read_json(folder / CONFIG)["convergence"]
    assert record["flag"] in ("may be under-trained", "plateaued") and record["epochs"] == 4
    assert record["val_objective"] == [r["objective"] for r in val]


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
    flagged = convergence(curve([3.0, 2.0, 1.5, 1.2, 1.0]))
    runs = []
    for seed in (0, 1):
        erm, lda = fake_metrics("gauss", "erm", seed), fake_metrics("gauss", "lda", seed)
        erm["model_config"] = {**erm["model_config"], "convergence": flagged}
        runs += [erm, lda]
    built = render.build_report(runs)
    table = built.markdown.split("## gauss")[1]
    erm_row = next(line for line in table.splitlines() if line.startswith("| erm |"))
    lda_row = next(line for line in table.splitlines() if line.startswith("| lda |"))
    assert "**may be under-trained** (improved 33.3%, 2/2 seeds)" in erm_row and "| n/a |" in lda_row
    assert "| training |" in table
    board = built.leaderboard
    assert board.schema == LEADERBOARD_SCHEMA
    erm = [r for r in board.to_pylist() if r["model"] == "erm"]
    assert {r["convergence"] for r in erm} == {"may be under-trained"}
    assert erm[0]["convergence_improvement"] == pytest.approx(flagged["improvement"])
    assert {(r["convergence"], r["convergence_improvement"]) for r in board.to_pylist() if r["model"] == "lda"} == {("n/a", None)}
    # The curves: one per model trained by epochs, relative to epoch 1.
    assert 'id="fig-gauss-objective"' in built.html
    assert [r["relative"] for r in built.plots["objective"]] == pytest.approx([1.0, 2 / 3, 0.5, 0.4, 1 / 3])
