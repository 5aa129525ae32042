"""Each metric on inputs small enough to check by hand, edge cases, and recomputation from files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.core.artifacts import SPLITS, Prepared, predictions_schema
from stages.core.io import (
    fixed_list_to_numpy,
    read_json,
    read_metadata,
    read_parquet,
    write_json,
    write_parquet,
)
from stages.evaluate import evaluate_predictions
from stages.evaluation.metrics import log_softmax, softmax, split_metrics

REPO = Path(__file__).resolve().parents[1]
LN3 = math.log(3.0)

# Five examples, 2 classes × 2 attributes = 4 groups (group 2 absent).
#  i  y  a  g  logits      p(0), p(1)   pred  correct  conf
#  0  0  0  0  [ln3, 0]    .75   .25    0     yes      .75
#  1  0  0  0  [0, ln3]    .25   .75    1     no       .75
#  2  0  1  1  [0, 0]      .50   .50    0     yes      .50   (tie -> lowest index)
#  3  1  1  3  [0, ln3]    .25   .75    1     yes      .75
#  4  1  1  3  [ln3, 0]    .75   .25    0     no       .75
LOGITS = np.array([[LN3, 0], [0, LN3], [0, 0], [0, LN3], [LN3, 0]])
Y = np.array([0, 0, 0, 1, 1])
G = np.array([0, 0, 1, 3, 3])
TRAIN_PROPS = np.array([0.4, 0.1, 0.1, 0.4])


@pytest.fixture
def hand() -> dict:
    return split_metrics(LOGITS, Y, G, 4, TRAIN_PROPS, ece_bins=10)


def test_accuracy_and_groups_by_hand(hand: dict) -> None:
    assert hand["n"] == 5
    assert hand["acc"] == pytest.approx(3 / 5)  # examples 0, 2, 3
    # g0: 1 of 2, g1: 1 of 1, g2: absent, g3: 1 of 2
    # pred: counts of each predicted class in the group (its row of the confusion matrix)
    # ci: Clopper–Pearson, closed form here: 1 of 2 -> [1 − √.975, √.975]; 1 of 1 -> [.025, 1]
    half = [1 - math.sqrt(0.975), math.sqrt(0.975)]
    assert hand["groups"] == {
        "0": {"n": 2, "acc": 0.5, "ci": pytest.approx(half), "pred": [1, 1]},
        "1": {"n": 1, "acc": 1.0, "ci": pytest.approx([0.025, 1.0]), "pred": [1, 0]},
        "2": {"n": 0, "acc": None, "ci": None, "pred": [0, 0]},
        "3": {"n": 2, "acc": 0.5, "ci": pytest.approx(half), "pred": [1, 1]},
    }
    # rows = true class, columns = predicted: class 0 -> 2 right (0, 2), 1 wrong; class 1 -> 1, 1
    assert hand["confusion"] == [[2, 1], [1, 1]]
    assert hand["worst_group_acc"] == pytest.approx(
        0.5
    )  # min over present groups, not the absent one


def test_weighted_average_drops_absent_groups_and_renormalises(hand: dict) -> None:
    # present groups 0, 1, 3 with weights .4, .1, .4 (sum .9): (.4*.5 + .1*1 + .4*.5) / .9 = 5/9
    assert hand["avg_acc_weighted"] == pytest.approx(5 / 9)


def test_balanced_accuracy_by_hand(hand: dict) -> None:
    # recall(class 0) = 2/3 (examples 0, 2 of 0, 1, 2); recall(class 1) = 1/2
    assert hand["balanced_acc"] == pytest.approx((2 / 3 + 1 / 2) / 2)


def test_ece_by_hand(hand: dict) -> None:
    # 10 bins: conf .5 -> bin 5 (n=1, acc 1, |1-.5| = .5); conf .75 -> bin 7 (n=4, acc .5, |.5-.75| = .25)
    # ECE = 1/5 * .5 + 4/5 * .25 = .3
    assert hand["ece"] == pytest.approx(0.3)
    bins = {b["bin_lower"]: b for b in hand["reliability"] if b["n"]}
    assert sorted(bins) == [0.5, 0.7]
    assert bins[0.7]["conf"] == pytest.approx(0.75) and bins[0.7]["acc"] == pytest.approx(0.5)
    assert len(hand["reliability"]) == 10
    assert all(b["conf"] is None and b["acc"] is None for b in hand["reliability"] if not b["n"])
    # 2 bins: [0, .5) and [.5, 1]; everything in bin 1: conf 3.5/5 = .7, acc .6 -> ECE .1
    assert split_metrics(LOGITS, Y, G, 4, TRAIN_PROPS, ece_bins=2)["ece"] == pytest.approx(0.1)


def test_nll_and_brier_by_hand(hand: dict) -> None:
    # -log p_y: ln(4/3), ln 4, ln 2, ln(4/3), ln 4
    assert hand["nll"] == pytest.approx((2 * math.log(4 / 3) + 2 * math.log(4) + math.log(2)) / 5)
    # per example Σ_k (p_k - 1[y=k])²: .125, 1.125, .5, .125, 1.125 -> sum 3, mean .6
    assert hand["brier"] == pytest.approx(0.6)


def test_confidence_one_lands_in_the_last_bin() -> None:
    m = split_metrics(
        np.array([[100.0, 0.0]]), np.array([0]), np.array([0]), 1, np.ones(1), ece_bins=4
    )
    assert m["reliability"][-1]["n"] == 1 and m["reliability"][-1]["bin_upper"] == 1.0


def test_perfect_predictions() -> None:
    y = np.array([0, 1, 2, 1, 0, 2])
    logits = 30.0 * np.eye(3)[y]
    m = split_metrics(logits, y, y, 3, np.full(3, 1 / 3), ece_bins=15)
    assert m["acc"] == m["worst_group_acc"] == m["balanced_acc"] == m["avg_acc_weighted"] == 1.0
    assert m["ece"] == pytest.approx(0.0, abs=1e-9)
    assert m["brier"] == pytest.approx(0.0, abs=1e-9)
    assert m["nll"] == pytest.approx(0.0, abs=1e-9)


def test_huge_logits_stay_finite() -> None:
    logits = np.array([[1e4, -1e4], [-1e4, 1e4], [1e4, 1e4]], dtype=np.float32)
    y = np.array([1, 1, 0])
    m = split_metrics(logits, y, y, 2, np.array([0.5, 0.5]), ece_bins=15)
    numbers = [
        m[k]
        for k in (
            "acc",
            "worst_group_acc",
            "avg_acc_weighted",
            "balanced_acc",
            "ece",
            "nll",
            "brier",
        )
    ]
    assert all(math.isfinite(v) for v in numbers)
    # example 0 is confidently wrong: -log p_y = 2e4; examples 1 and 2 contribute 0 and ln 2
    assert m["nll"] == pytest.approx((2e4 + math.log(2)) / 3)
    assert m["brier"] == pytest.approx((2.0 + 0.0 + 0.5) / 3)
    assert np.isfinite(softmax(logits)).all() and np.isfinite(log_softmax(logits)).all()
    assert softmax(logits).sum(axis=1) == pytest.approx(np.ones(3))


def test_absent_train_groups_give_null_weighted_average() -> None:
    m = split_metrics(
        np.zeros((2, 2)), np.array([0, 1]), np.array([1, 3]), 4, np.array([0.5, 0, 0.5, 0]), 5
    )
    assert m["avg_acc_weighted"] is None
    json.dumps(m, allow_nan=False)  # strict JSON, as write_json writes it: None, never NaN


@pytest.mark.parametrize(
    ("logits", "y", "g", "match"),
    [
        (np.zeros((0, 2)), np.zeros(0, int), np.zeros(0, int), "empty"),
        (np.zeros((2, 2)), np.array([0, 2]), np.array([0, 1]), "labels"),
        (np.zeros((2, 2)), np.array([0, 1]), np.array([0, 4]), "groups"),
        (np.array([[0.0, np.nan], [0, 0]]), np.array([0, 1]), np.array([0, 1]), "non-finite"),
    ],
)
def test_bad_inputs_are_rejected(
    logits: np.ndarray, y: np.ndarray, g: np.ndarray, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        split_metrics(logits, y, g, 4, np.full(4, 0.25), ece_bins=5)


def _prepared(rng: np.random.Generator, n_classes: int, n_attrs: int, per_split: int) -> Prepared:
    n = per_split * len(SPLITS)
    y = rng.integers(0, n_classes, n)
    a = rng.integers(0, n_attrs, n)
    split = np.array([s for s in SPLITS for _ in range(per_split)], dtype=object)
    rng.shuffle(split)
    meta = {"dataset": "toy", "n_classes": n_classes, "n_attrs": n_attrs, "shape": [3]}
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return Prepared(np.arange(n) * 7 + 1, split, y, a, y * n_attrs + a, x, meta)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31),
    n_classes=st.integers(2, 4),
    n_attrs=st.integers(1, 3),
    per_split=st.integers(1, 30),
    scale=st.sampled_from([0.1, 3.0, 1e4]),
    ece_bins=st.integers(1, 20),
)
def test_metrics_recompute_from_written_predictions(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    n_classes: int,
    n_attrs: int,
    per_split: int,
    scale: float,
    ece_bins: int,
) -> None:
    rng = np.random.default_rng(seed)
    prepared = _prepared(rng, n_classes, n_attrs, per_split)
    logits = rng.normal(scale=scale, size=(len(prepared.id), n_classes))
    logits[rng.random(len(logits)) < 0.2] = 0.0  # exact ties
    table, metrics, _ = evaluate_predictions(prepared, logits, ece_bins)

    folder = tmp_path_factory.mktemp("recompute")
    write_parquet(
        table,
        folder / "p.parquet",
        predictions_schema(n_classes),
        {"n_classes": n_classes, "n_attrs": n_attrs},
    )
    write_json(metrics, folder / "m.json")

    stored = read_json(folder / "m.json")
    meta = read_metadata(folder / "p.parquet")
    t = read_parquet(folder / "p.parquet", predictions_schema(meta["n_classes"]))
    split = np.asarray(t.column("split").to_pylist())
    z = fixed_list_to_numpy(t.column("logits"))
    y, g = t.column("y").to_numpy(), t.column("g").to_numpy()
    n_groups = meta["n_classes"] * meta["n_attrs"]
    props = np.bincount(g[split == "train"], minlength=n_groups) / (split == "train").sum()
    assert (t.column("pred").to_numpy() == z.argmax(axis=1)).all()
    for s in SPLITS:
        m = split == s
        again = split_metrics(z[m], y[m], g[m], n_groups, props, ece_bins)
        again.pop("reliability")
        assert again == stored["splits"][s], s


def test_docs_recomputation_snippet_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The polars snippet in docs/metrics.md reproduces split_metrics on a predictions file."""
    code = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "metrics.md").read_text(), re.S)[0]
    monkeypatch.chdir(tmp_path)
    prepared = _prepared(np.random.default_rng(3), n_classes=2, n_attrs=2, per_split=40)
    logits = np.random.default_rng(4).normal(scale=2.0, size=(len(prepared.id), 2))
    table, metrics, _ = evaluate_predictions(prepared, logits, ece_bins=15)
    write_parquet(
        table, "data/predictions/gaussian_shortcut/erm/seed=0.parquet", predictions_schema(2)
    )
    ns: dict = {}
    exec(code, ns)
    for key in (
        "acc",
        "worst_group_acc",
        "avg_acc_weighted",
        "balanced_acc",
        "ece",
        "nll",
        "brier",
    ):
        assert float(ns[key]) == pytest.approx(metrics["splits"]["test_ood"][key], abs=1e-12), key


# ---- golden edge cases, bootstrap, paired test, effective robustness ----------------------------


def test_single_class_split_and_logit_ties() -> None:
    # Only class 1 present; rows 0-1 tie exactly (-> class 0, wrong), rows 2-3 predict class 1.
    logits = np.array([[0.5, 0.5], [2.0, 2.0], [0.0, 1.0], [-1.0, 3.0]])
    y = np.array([1, 1, 1, 1])
    g = np.array([2, 3, 3, 2])
    m = split_metrics(logits, y, g, 4, np.full(4, 0.25), ece_bins=4)
    assert m["acc"] == 0.5
    assert m["balanced_acc"] == 0.5  # class 0 absent: mean over the present class only
    assert m["confusion"] == [[0, 0], [2, 2]]
    assert m["groups"]["0"] == {"n": 0, "acc": None, "ci": None, "pred": [0, 0]}
    assert m["groups"]["2"] == {"n": 2, "acc": 0.5, "ci": pytest.approx([1 - math.sqrt(0.975), math.sqrt(0.975)]), "pred": [1, 1]}
    assert m["worst_group_acc"] == 0.5


def test_bootstrap_is_seeded_reproducible_and_covers_the_estimate() -> None:
    from stages.evaluation.metrics import bootstrap_ci

    rng = np.random.default_rng(0)
    g = rng.integers(0, 4, 300)
    correct = rng.random(300) < np.array([0.9, 0.6, 0.7, 0.95])[g]
    a = bootstrap_ci(correct, g, 4, resamples=400, seed=[7, 1])
    assert a == bootstrap_ci(correct, g, 4, resamples=400, seed=[7, 1])
    assert a != bootstrap_ci(correct, g, 4, resamples=400, seed=[8, 1])
    acc = correct.mean()
    wga = min(correct[g == k].mean() for k in range(4))
    assert a["acc"][0] <= acc <= a["acc"][1]
    assert a["worst_group_acc"][0] <= wga <= a["worst_group_acc"][1]
    assert a["acc"][1] - a["acc"][0] < 0.15  # n = 300: about ±2 standard errors
    # split_metrics stores the same interval.
    m = split_metrics(np.stack([~correct, correct], 1).astype(float), np.ones(300, int), g, 4, np.full(4, 0.25), 5, 400, [7, 1])
    assert (m["acc_ci"], m["worst_group_acc_ci"]) == (a["acc"], a["worst_group_acc"])


def test_paired_bootstrap_separates_real_and_null_differences() -> None:
    from stages.evaluation.metrics import paired_bootstrap

    rng = np.random.default_rng(1)
    g = rng.integers(0, 2, 500)
    base = rng.random(500) < 0.7
    better = base | (rng.random(500) < 0.5)  # strictly more correct
    r = paired_bootstrap(better, base, g, 2, 300, 0)
    assert r["acc"]["significant"] and r["acc"]["diff"] > 0 and r["acc"]["ci"][0] > 0
    same = paired_bootstrap(base, base.copy(), g, 2, 300, 0)
    assert same["acc"] == {"diff": 0.0, "ci": [0.0, 0.0], "p_value": 1.0, "significant": False}
    noisy = paired_bootstrap(base, rng.permutation(base), g, 2, 300, 0)  # same accuracy, shuffled
    assert not noisy["acc"]["significant"]
    with pytest.raises(ValueError, match="same examples"):
        paired_bootstrap(base, base[:-1], g, 2, 10, 0)


def test_stratified_bootstrap_keeps_every_group_and_its_size() -> None:
    from stages.evaluation.metrics import bootstrap_indices

    rng = np.random.default_rng(3)
    g = rng.permutation(np.repeat([0, 1, 2, 3], [2, 150, 90, 7]))
    chunks = list(bootstrap_indices(g, 450, [5, 2]))
    assert [len(c) for c in chunks] == [200, 200, 50]
    idx = np.concatenate(chunks)
    assert (g[idx] == g).all()  # position i always holds a row of group g_i: every count kept
    counts = np.stack([np.bincount(g[r], minlength=4) for r in idx])
    assert (counts == np.bincount(g)).all()
    for k in range(4):  # within a group, rows are drawn with replacement from all its members
        members = np.flatnonzero(g == k)
        assert set(np.unique(idx[:, g == k])) == set(members)
    # Deterministic from (groups, resamples, seed).
    assert all((a == b).all() for a, b in zip(chunks, bootstrap_indices(g, 450, [5, 2]), strict=True))
    assert not (next(bootstrap_indices(g, 450, [6, 2])) == chunks[0]).all()


def test_worst_group_interval_never_loses_a_tiny_group() -> None:
    from stages.evaluation.metrics import bootstrap_ci, paired_bootstrap

    # Two big groups the model gets mostly right and a tiny group of 2 it gets wrong. An
    # unstratified resample misses the tiny group with probability (1 − 2/n)^n ≈ e^-2 ≈ 14%,
    # and its worst group then becomes a big group (~0.8): the upper end of the interval
    # would be far above 0. Stratified, every resample keeps both wrong examples.
    rng = np.random.default_rng(0)
    g = np.concatenate([np.zeros(100, int), np.ones(100, int), np.full(2, 2)])
    correct = np.concatenate([rng.random(200) < 0.85, [False, False]])
    ci = bootstrap_ci(correct, g, 3, resamples=1000, seed=[0, 3])
    assert ci["worst_group_acc"] == [0.0, 0.0]
    assert ci["acc"][0] < correct.mean() < ci["acc"][1]
    # The paired test: A and B both fail the tiny group, so its worst-group difference is
    # exactly 0 on every resample.
    other = np.concatenate([rng.random(200) < 0.6, [False, False]])
    r = paired_bootstrap(correct, other, g, 3, 300, 0)["worst_group_acc"]
    assert r == {"diff": 0.0, "ci": [0.0, 0.0], "p_value": 1.0, "significant": False}


def test_effective_robustness_on_a_logit_line() -> None:
    from stages.evaluation.metrics import (
        MIN_REFERENCE_POINTS,
        logit,
        logit_fit,
        robustness_baseline,
        seed_summary,
        sigmoid,
    )

    ids = [0.6, 0.7, 0.8, 0.9]
    line = lambda x: float(sigmoid(0.5 * logit(x) - 0.2))  # noqa: E731
    oods = [line(x) for x in ids]
    assert logit_fit(ids, oods) == pytest.approx((-0.2, 0.5))
    base = robustness_baseline(ids, oods)
    assert base.n_points == 4 and base.reason is None
    assert all(abs(base.effective_robustness(i, o)) < 1e-9 for i, o in zip(ids, oods, strict=True))
    # Any model, in the reference family or not: OOD acc minus the line at its ID acc.
    assert base.effective_robustness(0.75, line(0.75) + 0.05) == pytest.approx(0.05, abs=1e-9)
    assert base.effective_robustness(0.95, line(0.95) - 0.1) == pytest.approx(-0.1, abs=1e-9)
    # The axes are logit, not probit: a point on the probit line of the same (β₀, β₁) is off it.
    from statistics import NormalDist

    nd = NormalDist()
    probit_pts = [nd.cdf(0.5 * nd.inv_cdf(x) - 0.2) for x in ids]
    assert max(abs(v - w) for v, w in zip(probit_pts, oods, strict=True)) > 1e-3
    # Accuracies of 0 and 1 are clipped, not infinite.
    assert np.isfinite(logit([0.0, 1.0])).all()
    # n/a: fewer than 3 points, or no spread in ID accuracy.
    few = robustness_baseline(ids[:2], oods[:2])
    assert MIN_REFERENCE_POINTS == 3 and few.fit is None and few.effective_robustness(0.7, 0.5) is None
    assert few.reason == "2 reference points, needs 3"
    flat = robustness_baseline([0.8, 0.8, 0.8], [0.5, 0.6, 0.7])
    assert flat.fit is None and "share one ID accuracy" in flat.reason
    with pytest.raises(ValueError, match="no baseline"):
        flat.predict(0.8)
    with pytest.raises(ValueError, match="3 ID accuracies but 2"):
        robustness_baseline([0.1, 0.2, 0.3], [0.1, 0.2])
    assert seed_summary([0.5, 0.7]) == {"mean": pytest.approx(0.6), "sd": pytest.approx(0.1414213562), "n": 2}
    assert seed_summary([0.5])["sd"] is None


# ---- exact intervals for small groups (issue 23 item 8) -------------------------------------------


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k), X ~ Binomial(n, p), summed term by term (the brute-force reference)."""
    return math.fsum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def test_clopper_pearson_is_the_exact_binomial_interval() -> None:
    from stages.evaluation.metrics import clopper_pearson

    # 0 of 9 correct: not [0, 0] (a stratified bootstrap's answer) but [0, 1 − .025^(1/9)] ≈ [0, 0.336].
    lo, hi = clopper_pearson(0, 9)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 9), rel=1e-12) and hi == pytest.approx(0.3363, abs=1e-4)
    assert clopper_pearson(9, 9) == pytest.approx([0.025 ** (1 / 9), 1.0], rel=1e-12)
    # Its defining equations, against binomial tails summed by hand: P(X >= k | lo) = P(X <= k | hi) = .025.
    for k, n, level in ((1, 9, 0.95), (5, 9, 0.95), (7, 9, 0.99), (3, 40, 0.95), (199, 200, 0.9)):
        lo, hi = clopper_pearson(k, n, level)
        tail = (1 - level) / 2
        assert 1 - _binomial_cdf(k - 1, n, lo) == pytest.approx(tail, abs=1e-10), (k, n)
        assert _binomial_cdf(k, n, hi) == pytest.approx(tail, abs=1e-10), (k, n)
    # Coverage, computed exactly (no simulation): at every p of a grid the interval holds p with
    # probability >= 95% over X ~ Binomial(9, p).
    bounds = [clopper_pearson(k, 9) for k in range(10)]
    for p in np.linspace(0.001, 0.999, 199):
        cover = math.fsum(math.comb(9, k) * p**k * (1 - p) ** (9 - k) for k, (a, b) in enumerate(bounds) if a <= p <= b)
        assert cover >= 0.95 - 1e-12, p
    with pytest.raises(ValueError, match="0 <= hits <= n"):
        clopper_pearson(10, 9)


def test_worst_group_exact_interval_is_simultaneous_and_never_a_point() -> None:
    from stages.evaluation.metrics import bootstrap_ci, clopper_pearson, worst_group_exact

    # Two big groups and one of 9 the model gets all wrong: the bootstrap says [0, 0].
    g = np.concatenate([np.zeros(200, int), np.ones(200, int), np.full(9, 2)])
    correct = np.concatenate([np.arange(400) % 10 < 8, np.zeros(9, bool)])
    assert bootstrap_ci(correct, g, 3, 500, [0, 3])["worst_group_acc"] == [0.0, 0.0]
    m = split_metrics(np.stack([correct, ~correct], axis=1).astype(float) * 2 - 1, np.zeros(len(g), int), g, 3,
                      np.full(3, 1 / 3), ece_bins=5)
    assert m["worst_group_acc"] == 0.0
    lo, hi = m["worst_group_acc_exact"]
    # Each of the 3 groups at level 1 − .05/3 (Bonferroni): the worst group's upper bound.
    assert lo == 0.0 and hi == pytest.approx(clopper_pearson(0, 9, 1 - 0.05 / 3)[1]) and hi > 0.336
    assert m["groups"]["2"]["ci"] == pytest.approx(clopper_pearson(0, 9))
    # Seeds: S·P intervals at level 1 − .05/(S·P); the bounds are the seed means of each seed's worst.
    hits = np.array([[160, 150, 0], [170, 120, 9]])
    n = np.array([200, 200, 9])
    each = 1 - 0.05 / 6
    per_seed = [min((clopper_pearson(int(h), int(k), each) for h, k in zip(row, n, strict=True)), key=lambda b: b[0])
                for row in hits]
    highs = [min(clopper_pearson(int(h), int(k), each)[1] for h, k in zip(row, n, strict=True)) for row in hits]
    assert worst_group_exact(hits, n) == pytest.approx([np.mean([b[0] for b in per_seed]), np.mean(highs)])
    # An absent group is left out, not counted as a group of 0.
    assert worst_group_exact(np.array([[5, 0]]), np.array([10, 0])) == pytest.approx(clopper_pearson(5, 10))


def test_effective_robustness_interval_resamples_points_and_examples() -> None:
    from stages.evaluation.metrics import robustness_baseline, robustness_bootstrap

    rng = np.random.default_rng(4)
    n = 400
    g = np.repeat(np.arange(4), n // 4)
    # Six reference runs whose (ID, OOD) accuracies lie near one logit line, and a model 0.1 above it.
    id_acc = np.array([0.70, 0.75, 0.80, 0.85, 0.90, 0.93])
    ood_acc = 1 / (1 + np.exp(-(0.8 * np.log(id_acc / (1 - id_acc)) - 1.0)))
    id_acc = np.append(id_acc, 0.80)
    ood_acc = np.append(ood_acc, float(1 / (1 + np.exp(-(0.8 * np.log(4.0) - 1.0)))) + 0.1)
    id_correct = rng.random((7, n)) < id_acc[:, None]
    ood_correct = rng.random((7, n)) < ood_acc[:, None]
    base = robustness_baseline(id_correct[:6].mean(1), ood_correct[:6].mean(1))
    point = [base.effective_robustness(id_correct[i].mean(), ood_correct[i].mean()) for i in (0, 6)]
    (ref_ci, model_ci), left_out = robustness_bootstrap(id_correct, ood_correct, g, g, range(6), [[0], [6]], 1000, [0, 400])
    assert ref_ci[0] < point[0] < ref_ci[1] and ref_ci[0] < 0 < ref_ci[1]
    assert model_ci[0] < point[1] < model_ci[1] and model_ci[0] > 0  # 0.1 above the line, 400 examples a split
    assert left_out == 0  # six distinct ID accuracies: a resample has one with probability 6·6^-6
    again = robustness_bootstrap(id_correct, ood_correct, g, g, range(6), [[0], [6]], 1000, [0, 400])
    assert again == ([ref_ci, model_ci], 0)
    # Three reference points: a resample draws one point thrice with probability 3·3^-3 = 1/9, and
    # has no line then; over 9,000 resamples the rate is 1/9 within 4 binomial sds (± 0.013).
    _, left_out = robustness_bootstrap(id_correct, ood_correct, g, g, [0, 2, 4], [[6]], 9000, [1, 400])
    assert abs(left_out / 9000 - 1 / 9) < 4 * math.sqrt(1 / 9 * 8 / 9 / 9000)
