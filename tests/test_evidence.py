"""The evidence over replicates (stages/evaluation/evidence.py): the two-level bootstrap against
brute force, the verdict rule, the power estimate, the default (1-seed) run's shape, and how
replicate datasets and flagged models reach the verdict."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from stages.core.config import defaults
from stages.evaluation import evidence
from stages.evaluation.comparison import RunData
from stages.evaluation.evidence import Replicate, SplitGroups, decide, seeds_needed, two_level_draws
from stages.reporting import render

CONTRACT = {"seeds", "gap_worst_group", "gap_drop", "verdict", "prediction", "under_trained"}


# ---- the two-level bootstrap against brute force --------------------------------------------------


def _resamples(g: np.ndarray) -> list[tuple[int, ...]]:
    """Every stratified resample of rows with groups `g`, equally likely: position i holds any row
    of group g_i (a tuple of row indices)."""
    choices = [np.flatnonzero(g == gi).tolist() for gi in g]
    return list(itertools.product(*choices))


def _gap(rep: Replicate, t: SplitGroups, id_rows: tuple[int, ...], ood_rows: tuple[int, ...], w: list[Fraction]) -> Fraction:
    """One replicate's (worst-group) gap on given resampled rows, in exact arithmetic: the
    definition, written out without the library."""
    total = Fraction(0)
    for m, wm in enumerate(w):
        groups: dict[int, list[bool]] = {}
        for pos, row in enumerate(ood_rows):
            groups.setdefault(int(t.g_ood[pos]), []).append(bool(rep.ood_correct[m, row]))
        total += wm * min(Fraction(sum(v), len(v)) for v in groups.values())
    return total


def _exact_distribution(tests: list[SplitGroups], reps: list[Replicate], w: list[Fraction]) -> Counter:
    """P(statistic = v) by enumerating every outcome: one resample of each test set's examples (id
    and ood), shared by the replicates scored on it, and every ordered draw of R replicates."""
    outcomes: Counter = Counter()
    per_test = [list(itertools.product(_resamples(t.g_id), _resamples(t.g_ood))) for t in tests]
    R = len(reps)
    for combo in itertools.product(*per_test):
        gaps = [_gap(r, tests[r.test], *combo[r.test], w) for r in reps]
        for draw in itertools.product(range(R), repeat=R):
            outcomes[sum((gaps[j] for j in draw), Fraction(0)) / R] += 1
    total = sum(outcomes.values())
    return Counter({v: Fraction(c, total) for v, c in outcomes.items()})


def _small_case(shared: bool) -> tuple[list[SplitGroups], list[Replicate]]:
    # test_id: groups 0, 0, 1; test_ood: groups 1, 1, 2 (sizes 2 and 1); one generative, one reference model.
    t = SplitGroups(np.array([0, 0, 1]), np.array([1, 1, 2]))
    reps = [
        Replicate(0, np.array([[1, 0, 1], [1, 1, 0]], bool), np.array([[1, 0, 1], [0, 0, 1]], bool)),
        Replicate(0 if shared else 1, np.array([[0, 1, 1], [1, 1, 1]], bool), np.array([[1, 1, 0], [1, 0, 1]], bool)),
    ]
    return ([t] if shared else [t, SplitGroups(t.g_id.copy(), t.g_ood.copy())]), reps


@pytest.mark.parametrize("shared", [False, True], ids=["a test set per replicate", "one test set, two seeds"])
def test_two_level_bootstrap_matches_brute_force(shared: bool) -> None:
    tests, reps = _small_case(shared)
    exact = _exact_distribution(tests, reps, [Fraction(1), Fraction(-1)])
    B = 20_000
    draws = two_level_draws(tests, reps, np.array([1.0, -1.0]), B, [0, 300, 0])[:, 0]
    # The Monte Carlo CDF against the exact one at every atom: by the DKW inequality,
    # P(sup |F_B − F| > 0.02) <= 2·exp(−2·B·0.02²) ≈ 2e-7.
    atoms = sorted(exact)
    cdf = np.cumsum([float(exact[v]) for v in atoms])
    mc = np.array([(draws <= float(v) + 1e-12).mean() for v in atoms])
    assert np.max(np.abs(mc - cdf)) < 0.02, (atoms, cdf, mc)
    mean = sum(v * p for v, p in exact.items())
    assert draws.mean() == pytest.approx(float(mean), abs=0.01)
    # Seeded: the same draws again.
    assert np.array_equal(draws, two_level_draws(tests, reps, np.array([1.0, -1.0]), B, [0, 300, 0])[:, 0])


def test_drop_gap_is_resampled_with_the_same_draws() -> None:
    """The drop column: with one replicate and one model per family, each draw is the resampled
    accuracies' difference, which the exact enumeration gives too."""
    t = SplitGroups(np.array([0, 0, 1]), np.array([1, 1, 2]))
    rep = Replicate(0, np.array([[1, 0, 1], [1, 1, 1]], bool), np.array([[0, 0, 1], [1, 0, 1]], bool))
    exact: Counter = Counter()
    for id_rows, ood_rows in itertools.product(_resamples(t.g_id), _resamples(t.g_ood)):
        drop = [Fraction(int(rep.id_correct[m, list(id_rows)].sum()), 3) - Fraction(int(rep.ood_correct[m, list(ood_rows)].sum()), 3)
                for m in range(2)]
        exact[drop[0] - drop[1]] += 1
    draws = two_level_draws([t], [rep], np.array([1.0, -1.0]), 20_000, [1, 300, 0])[:, 1]
    total = sum(exact.values())
    for v, c in exact.items():
        assert (np.abs(draws - float(v)) < 1e-9).mean() == pytest.approx(c / total, abs=0.02)


# ---- the verdict rule and the power estimate -----------------------------------------------------


def test_verdict_only_where_the_interval_excludes_zero() -> None:
    assert decide(0.01, 0.20, 5) == "generative better"
    assert decide(-0.20, -0.01, 5) == "discriminative better"
    assert decide(-0.10, 0.10, 5) == "not distinguishable"
    assert decide(0.0, 0.10, 5) == "not distinguishable"  # 0 is inside a closed interval
    assert decide(-0.10, 0.0, 5) == "not distinguishable"
    # One replicate: its interval holds no between-seed variance, so it carries no verdict.
    assert decide(0.30, 0.50, 1) == "not distinguishable"
    assert decide(None, None, 5) == "not distinguishable"


def test_power_estimate_on_a_known_case() -> None:
    # n = ((z_.975 + z_.80) · sd / gap)² = (2.8016 · 0.1 / 0.05)² = 31.4 -> 32 seeds.
    assert seeds_needed(0.05, 0.10) == 32
    assert seeds_needed(-0.05, 0.10) == 32  # two-sided: the sign does not matter
    assert seeds_needed(0.5, 0.10) == 2  # at least 2
    assert seeds_needed(0.05, None) is None and seeds_needed(0.0, 0.1) is None
    # What it promises: at n = 32 replicates of sd 0.1 and true gap 0.05, a two-sided 5% z test on
    # their mean rejects with probability ~0.80. Over 4,000 simulated experiments the rate lies
    # within 0.03 of 0.80 (about 4.7 binomial sds).
    rng = np.random.default_rng(0)
    means = rng.normal(0.05, 0.10, size=(4000, 32)).mean(axis=1)
    rate = (np.abs(means) / (0.10 / math.sqrt(32)) > 1.959964).mean()
    assert abs(rate - 0.80) < 0.03, rate


# ---- synthetic runs through evidence_for / build_report ------------------------------------------


def _data(n: int, acc_ood: float, acc_id: float, seed: int, weak_group: float | None = None) -> RunData:
    """A binary-task predictions record: 4 groups of n rows in each test split, correct with
    probability acc_* (group 3 of test_ood with `weak_group` instead, when given)."""
    rng = np.random.default_rng(seed)
    split = np.array(["train"] * 8 + ["test_id"] * 4 * n + ["test_ood"] * 4 * n, dtype=object)
    g = np.concatenate([np.arange(4).repeat(2), np.arange(4).repeat(n), np.arange(4).repeat(n)])
    y, a = g // 2, g % 2
    p = np.where(split == "test_id", acc_id, np.where(split == "test_ood", acc_ood, 1.0))
    if weak_group is not None:
        p = np.where((split == "test_ood") & (g == 3), weak_group, p)
    correct = rng.random(len(g)) < p
    pred = np.where(correct, y, 1 - y)
    return RunData(split, y, a, g, np.eye(2, dtype=np.float32)[pred])


def _metrics(dataset: str, model: str, seed: int, d: RunData, kind: str, convergence: dict | None = None) -> dict:
    """The metrics dict the report reads, computed from `d` (as evaluate would)."""
    from stages.evaluation.metrics import split_metrics

    splits = {}
    for s in ("train", "val", "test_id", "test_ood"):
        rows = d.split == (s if s != "val" else "test_id")
        splits[s] = split_metrics(d.logits[rows], d.y[rows], d.g[rows], 4, np.full(4, 0.25), 5)
        splits[s].pop("reliability")
    info = {"kind": kind, **({"convergence": convergence} if convergence else {})}
    return {"dataset": dataset, "model": model, "seed": seed, "n_classes": 2, "n_attrs": 2, "ece_bins": 5,
            "model_config": info, "splits": splits}


def _run(datasets_seeds: list[tuple[str, int]], gen_acc: float, ref_acc: float, n: int = 60,
         convergence: dict[str, dict] | None = None) -> tuple[list[dict], dict]:
    """lda and qda (generative) against erm and groupdro (the reference), every (dataset, seed)."""
    kinds = {"lda": ("lda", gen_acc), "qda": ("qda", gen_acc), "erm": ("erm", ref_acc), "groupdro": ("groupdro", ref_acc)}
    metrics, data = [], {}
    for k, (dataset, seed) in enumerate(datasets_seeds):
        for i, (model, (kind, acc)) in enumerate(kinds.items()):
            d = _data(n, 0.8, 0.9, seed=1000 * k + 10 * i + seed, weak_group=acc)
            data[(dataset, model, seed)] = d
            metrics.append(_metrics(dataset, model, seed, d, kind, (convergence or {}).get(model)))
    return metrics, data


def _boot(**kw: object):
    return defaults("evaluate", "default", bootstrap_resamples=400, **kw)


def test_default_run_with_one_seed_is_not_distinguishable_and_says_why() -> None:
    # A gap the examples alone would call (0.9 vs 0.3 on a group of 60), but one replicate.
    metrics, data = _run([("toy", 0)], gen_acc=0.9, ref_acc=0.3)
    built = render.build_report(metrics, data, boot=_boot())
    e = built.summary["_evidence"]["toy"]
    assert set(e) >= CONTRACT
    assert e["seeds"] == 1 and e["verdict"] == "not distinguishable" and e["seeds_needed"] is None
    assert set(e["gap_worst_group"]) == {"estimate", "low", "high"} == set(e["gap_drop"])
    assert e["gap_worst_group"]["low"] > 0  # the example-level interval alone excludes 0 ...
    assert e["note"].startswith("1 replicate: the interval holds the test examples' sampling noise only")  # ... and says why that is not enough
    assert "1 replicate: the interval holds" in built.markdown
    assert e["under_trained"] == [] and e["prediction"] is None


def test_verdicts_over_replicates_with_the_prediction_and_flagged_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evidence, "expected_use", lambda sep: None if sep is None else sep["use"])
    runs = [(f"toy_seed{s}", s) for s in range(5)]
    flags = {"qda": {"flag": "may be under-trained", "improvement": 0.2},
             "erm": {"flag": "plateaued", "improvement": 0.0, "overfitting": True}}
    metrics, data = _run(runs, gen_acc=0.95, ref_acc=0.3, convergence=flags)
    bases = {d: "toy" for d, _ in runs}
    seps = {d: {"use": "less"} for d, _ in runs}
    got = evidence.gather(metrics, data, _boot(), seps, bases)
    assert list(got) == ["toy"]
    e = got["toy"]
    assert len(e.replicates) == 5 and e.datasets == [d for d, _ in runs]
    assert e.generative == ["lda", "qda"] and e.reference == ["erm", "groupdro"] and e.absent_reference == ["jtt", "dfr"]
    assert e.verdict == "generative better" and e.gap_worst_group["low"] > 0
    assert e.agreement == "as predicted"
    assert e.under_trained == ["qda"] and e.overfitting == ["erm"]
    text = e.verdict_text()
    assert text.startswith("**generative better** (as predicted)") and "under-trained in a compared family: qda" in text
    assert "over-fitting flagged: erm" in text
    assert e.summary()["under_trained"] == ["qda"]
    # The same runs against a prediction of "more": contrary.
    seps = {d: {"use": "more"} for d, _ in runs}
    assert evidence.gather(metrics, data, _boot(), seps, bases)["toy"].agreement == "contrary to the prediction"
    # Through the report: the evidence table and the summary.
    built = render.build_report(metrics, data, boot=_boot(), regimes={d: ({"use": "less"}, None) for d, _ in runs}, bases=bases)
    assert built.summary["_evidence"]["toy"]["verdict"] == "generative better"
    assert "| toy | 5 | generative uses the shortcut less |" in built.markdown


def test_no_gap_is_not_distinguishable_with_the_seeds_a_power_estimate_asks_for() -> None:
    metrics, data = _run([("toy", s) for s in range(4)], gen_acc=0.5, ref_acc=0.5, n=40)
    e = evidence.gather(metrics, data, _boot(), {})["toy"]
    assert e.verdict == "not distinguishable" and e.gap_worst_group["low"] <= 0 <= e.gap_worst_group["high"]
    per_rep = [float(v) for v in np.asarray(evidence.replicate_gaps(*evidence.replicate_arrays(
        e.replicates, e.generative + e.reference, data), evidence.family_weights(2, 2), 4))[:, 0]]
    assert e.between_sd == pytest.approx(float(np.std(per_rep, ddof=1)), rel=1e-6)
    assert e.seeds_needed == seeds_needed(e.gap_worst_group["estimate"], e.between_sd)
    assert "Power estimate" in e.note or "no number of seeds" in e.note


def test_null_gap_false_verdict_rate() -> None:
    """Generative and reference models drawn from one distribution (true gap 0), 5 replicates of
    fresh data each: the verdict must name a winner at most at the nominal 5%. With a test set
    per replicate the examples' noise enters through both levels (a replicate's gap already
    carries it, and level 2 adds it again), so the interval is conservative: 0 winners in 300
    such experiments when this test was written. Over 100 experiments, at most 5 winners."""
    winners = 0
    for k in range(100):
        metrics, data = _run([(f"toy_seed{s}", 100 * k + s) for s in range(5)], gen_acc=0.7, ref_acc=0.7, n=30)
        e = evidence.gather(metrics, data, _boot(bootstrap_seed=k), {}, {f"toy_seed{s}": "toy" for s in range(5)})["toy"]
        winners += e.verdict != "not distinguishable"
    assert winners <= 5, winners
