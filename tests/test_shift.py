"""Shift curves (stages/evaluation/shift.py): exact endpoints, the two routes agree, and the phase diagram smoke run."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from stages import evaluate
from stages.core.artifacts import Prepared
from stages.core.config import compose, dataset_section, defaults, load_params, section
from stages.core.io import read_json
from stages.core.settings import PhaseConfig
from stages.evaluation import shift

REPO = Path(__file__).resolve().parents[1]


def _toy(n_per_class: int, rho: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Labels and attributes with exactly `rho` agreement in each class."""
    y = np.repeat([0, 1], n_per_class)
    n_agree = round(rho * n_per_class)
    agree = np.tile(np.r_[np.ones(n_agree, bool), np.zeros(n_per_class - n_agree, bool)], 2)
    return y, np.where(agree, y, 1 - y)


def test_endpoints_are_the_training_mix_and_the_fully_reversed_accuracy() -> None:
    rng = np.random.default_rng(0)
    y, a = _toy(100, 0.9, rng)
    correct = rng.random(200) < np.where(a == y, 0.9, 0.3)
    axis = shift.shift_axis(y, a, 2, steps=5)  # the "train" split: agreement .9 in each class
    assert axis.start_agreement == (0.9, 0.9) and axis.end_agreement == 0.0
    rows, summary = shift.reweighted_curve(correct, y, a, axis, 2, resamples=0, seed=0)
    # Pool with the training mix: the first point is exactly its accuracy.
    assert rows[0]["acc"] == pytest.approx(correct.mean(), abs=1e-12)
    # Last point: the prior-weighted accuracy on examples whose attribute disagrees.
    dis = a != y
    reversed_acc = 0.5 * correct[dis & (y == 0)].mean() + 0.5 * correct[dis & (y == 1)].mean()
    assert rows[-1]["acc"] == pytest.approx(reversed_acc, abs=1e-12)
    assert rows[-1]["rho"] == 0.0 and rows[0]["rho"] == pytest.approx(0.9)
    assert summary["gap"] == pytest.approx(correct.mean() - reversed_acc)
    assert [r["step"] for r in rows] == list(range(5))
    accs = [r["acc"] for r in rows]
    assert accs == sorted(accs, reverse=True)  # linear in t between the ends
    # Worst-group accuracy is min over groups with mass: all four until agreeing groups vanish.
    assert rows[0]["worst_group_acc"] == rows[3]["worst_group_acc"]


def test_reversed_end_when_training_agreement_is_low_and_undefined_cells() -> None:
    rng = np.random.default_rng(1)
    y, a = _toy(50, 0.2, rng)
    assert shift.shift_axis(y, a, 2, 3).end_agreement == 1.0
    y2, a2 = _toy(50, 1.0, rng)  # no disagreeing example to score the reversed end on
    rows, _ = shift.reweighted_curve(np.ones(100, bool), y2, a2, shift.shift_axis(y, a, 2, 3), 2, 0, 0)
    assert rows[0]["acc"] is None and rows[-1]["acc"] == 1.0
    with pytest.raises(ValueError, match=">= 2 steps"):
        shift.shift_axis(y, a, 2, 1)


def test_evaluate_endpoints_match_test_id_and_fully_reversed_accuracy() -> None:
    """On data whose test_id has the training mix, the curve starts at test_id accuracy."""
    rng = np.random.default_rng(2)
    parts = []
    for split, rho in (("train", 0.9), ("val", 0.9), ("test_id", 0.9), ("test_ood", 0.1)):
        y, a = _toy(60, rho, rng)
        parts.append((np.full(120, split, dtype=object), y, a))
    split = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    a = np.concatenate([p[2] for p in parts])
    n = len(y)
    meta = {"dataset": "toy", "n_classes": 2, "n_attrs": 2, "shape": [2]}
    prepared = Prepared(np.arange(n), split, y, a, y * 2 + a, np.zeros((n, 2), np.float32), meta)
    # A model that follows the attribute 80% of the time and the label otherwise.
    follow = rng.random(n) < 0.8
    guess = np.where(follow, a, y)
    logits = np.eye(2)[guess] * 2.0
    _, metrics, plots = evaluate.evaluate_predictions(prepared, logits, 10, bootstrap_resamples=200, shift_steps=6)
    curve = plots["shift_curve"]
    assert len(curve) == 6 and {r["route"] for r in curve} == {"reweight"}
    pool = np.isin(split, ("test_id", "test_ood"))
    correct = guess == y
    dis = pool & (a != y)
    reversed_acc = 0.5 * correct[dis & (y == 0)].mean() + 0.5 * correct[dis & (y == 1)].mean()
    assert metrics["shift"]["acc_end"] == pytest.approx(reversed_acc, abs=1e-12)
    # Pooled group accuracies: the start estimates test_id accuracy (exact in expectation).
    assert metrics["shift"]["acc_start"] == pytest.approx(metrics["test_id_acc"], abs=0.08)
    assert curve[0]["acc_lo"] <= curve[0]["acc"] <= curve[0]["acc_hi"]
    assert metrics["shift"]["gap_ci"][0] > 0  # a shortcut user: the gap's interval is above 0


def test_reweight_and_regenerate_routes_agree_on_gaussian_shortcut() -> None:
    from stages.datasets.gaussian_shortcut import generate
    from stages.models.lda_model import fit_lda

    cfg = defaults("dataset", "gaussian_shortcut", spurious_scale=0.6, n_train=2000, n_val=8, n_test_id=3000, n_test_ood=3000)
    cols, _ = generate(cfg)
    s, y, a, x = cols["split"], cols["y"], cols["a"], cols["x"]
    model = fit_lda(x[s == "train"], y[s == "train"], 2, 0.1)
    pool = np.isin(s, ("test_id", "test_ood"))
    correct = model.logits(x[pool]).argmax(1) == y[pool]
    axis = shift.shift_axis(y[s == "train"], a[s == "train"], 2, 6)
    rows, _ = shift.reweighted_curve(correct, y[pool], a[pool], axis, 2, 0, 0)
    regen = shift.regenerated_curve(cfg, model.logits, [r["rho"] for r in rows], 4000)
    diffs = [abs(r["acc"] - q["acc"]) for r, q in zip(rows, regen, strict=True)]
    assert max(diffs) < 0.035, diffs  # a few binomial standard errors at these sizes
    assert regen[0]["acc"] - regen[-1]["acc"] > 0.1  # and the curve really falls
    assert regen == shift.regenerated_curve(cfg, model.logits, [r["rho"] for r in rows], 4000)  # seeded


def test_phase_diagram_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cells of the toy phase diagram, 10 seeds each, run as the real stage: a winner only
    where the seeds' interval excludes 0, the regime's call beside it, same bytes twice."""
    from stages import phase
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "params.yaml", "params.yaml")
    panel = "[{x: spurious_scale, x_values: [0.05, 1.0], y: n_train, y_values: [100]}]"
    argv = [f"phase.panels={panel}", f"phase.seeds=[{','.join(map(str, range(10)))}]"]
    assert phase.main(argv) == 0
    cells = read_json(phase.PHASE_PATH)
    assert [(c["x_knob"], c["x"], c["y_knob"], c["y"]) for c in cells] == [
        ("spurious_scale", 0.05, "n_train", 100.0),
        ("spurious_scale", 1.0, "n_train", 100.0),
    ]
    # cue 0.5 < core 2: the population rules agree (no call) and the cell is a tie;
    # cue 10 > core 2 at ρ 0.95: LDA leans on the cue (call "more"), logistic regression wins.
    assert [c["winner"] for c in cells] == ["tie", "discriminative"]
    assert [c["predicted"] for c in cells] == [None, "more"]
    assert cells[0]["diff_low"] < 0 < cells[0]["diff_high"] and cells[1]["diff_high"] < 0
    assert all(c["seeds"] == 10 and c["diff"] == pytest.approx(c["generative_wga"] - c["discriminative_wga"]) for c in cells)
    assert all(0 < c["discriminative_iterations"] < 40 for c in cells)
    assert all(c["population_wga"] < c["population_lr_wga"] for c in cells)  # LDA never leans on the cue less
    assert cells[1]["separation"]["cue"] == 10.0 and cells[1]["d_over_n"] == pytest.approx((2 + 8) / 100)
    assert [line["l2"] for line in cells[0]["l2_lines"]] == list(load_params(REPO / "params.yaml").phase.l2_lines)
    first = phase.PHASE_PATH.read_bytes()
    assert phase.main(["phase.panels=[]"]) == 0 and read_json(phase.PHASE_PATH) == []
    assert phase.main(argv) == 0 and phase.PHASE_PATH.read_bytes() == first  # deterministic


def test_toy_phase_diagram_experiment_composes_and_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    out = compose(output=tmp_path / "params.yaml", overrides=["experiment=toy_phase_diagram"])
    params = load_params(out)
    cfg = section(params, "phase", PhaseConfig)
    base = dataset_section(params, "phase.base")  # validated by its kind's schema
    knobs = {k for p in cfg.panels for k in (p.x, p.y)}
    assert knobs == {"sigma", "spurious_scale", "rho_train", "d_noise", "n_train"}
    assert knobs <= {f.name for f in dataclasses.fields(base)}
    assert len(cfg.seeds) >= 10  # enough that a cell's winner is read from its interval
    # separation × d/n: every panel sweeps the cue's separation, with cells on both sides of the core
    core = 2 / base.sigma
    for p in cfg.panels:
        assert p.x == "spurious_scale"
        cues = [2 * v * math.sqrt(base.cue_dims) / base.spurious_noise for v in p.x_values]
        assert min(cues) < core < max(cues), (p, cues)
    # d/n swept at fixed separation, through the dimension (to ≥ 10) and through the sample
    d = {p.y: p.y_values for p in cfg.panels}
    assert (1 + base.cue_dims + max(d["d_noise"])) / base.n_train >= 10 and min(d["d_noise"]) == 0
    assert min(d["n_train"]) <= 25 and max(d["n_train"]) >= 1600
    assert base.rho_ood == 0.0  # scored on a fully reversed test set
    assert base.noise_scaling == "per_dim"  # adding noise dimensions adds no noise energy


def test_regenerate_route_is_the_registered_one_and_absent_kinds_get_none() -> None:
    """evaluate rebuilds the generator config from the file's params with its kind's schema;
    a kind without a regenerate route (or no kind) gets the reweight route only."""
    from stages.core import registry
    cfg = defaults("dataset", "gaussian_shortcut", n_train=200, n_val=100, n_test_id=100, n_test_ood=100)
    spec = registry.dataset(cfg.kind)
    assert spec.regenerate is not None and spec.schema(**dataclasses.asdict(cfg)) == cfg
    ecfg = defaults("evaluate", "default", shift_regenerate_n=50)
    x = np.zeros((4, 2), np.float32)
    y = np.array([0, 1, 0, 1])
    reweighted = [{"step": 0, "t": 0.0, "rho": 0.9}, {"step": 1, "t": 1.0, "rho": 0.0}]

    class Constant:
        def logits(self, x: np.ndarray, batch_size: int = 0) -> np.ndarray:
            return np.tile([1.0, 0.0], (len(x), 1))

    def prepared(meta: dict) -> Prepared:
        return Prepared(np.arange(4), np.array(["train"] * 4, dtype=object), y, y, y * 2 + y, x, meta)

    base = {"dataset": "toy", "n_classes": 2, "n_attrs": 2, "shape": [10]}
    rows = evaluate.regenerated_shift(prepared({**base, "kind": cfg.kind, "params": dataclasses.asdict(cfg)}), Constant(), reweighted, ecfg)
    assert [r["route"] for r in rows] == ["regenerate"] * 2 and all(r["acc"] == pytest.approx(0.5, abs=0.02) for r in rows)
    no_route = next(k for k, s in registry.datasets().items() if s.regenerate is None)
    assert evaluate.regenerated_shift(prepared({**base, "kind": no_route, "params": {}}), Constant(), reweighted, ecfg) == []
    assert evaluate.regenerated_shift(prepared(base), Constant(), reweighted, ecfg) == []


def test_phase_knobs_must_be_keys_of_the_base_kind() -> None:
    from stages import phase
    from stages.core import registry
    from stages.core.schema import ConfigError

    base = defaults("dataset", "gaussian_shortcut")
    assert phase.knob_types(base)["n_train"] is int and phase.knob_types(base)["sigma"] is float
    assert phase.cell_config(base, {"n_train": 99.6, "sigma": 2}, 3) == dataclasses.replace(base, n_train=100, sigma=2.0, seed=3)
    # a generated kind without the knobs (any one but the base's own) is named as the problem
    other = next(k for k, s in registry.datasets().items() if s.generate is not None and k != base.kind)
    with pytest.raises(ConfigError, match=f"phase.base.kind: dataset kind '{other}' has no key"):
        phase.knob_types(defaults("dataset", other))
