"""The evidence over replicates (stages/evaluation/evidence.py): the t interval against the
textbook one, the sampling variance of a shared split and of repeated items against their known
values, Holm's correction, a null simulation over τ, shared and redrawn splits and repeated items
(at most 5 % false verdicts in every cell) with a power figure, a model that failed to learn
blocking its verdicts, and the report's pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from stages.core.config import defaults
from stages.evaluation import evidence
from stages.evaluation.comparison import RunData
from stages.evaluation.evidence import (
    Replicate,
    SplitGroups,
    contrast_interval,
    holm,
    sampling_draws,
    seeds_needed,
    t_interval,
)
from stages.evaluation.metrics import (
    bootstrap_ci,
    cluster_weights,
    item_strata,
    resampled_group_hits,
)
from stages.reporting import render

PAIR_KEYS = {"generative", "reference", "comparison", "replicates", "estimate", "low", "high", "drop", "p_value", "p_holm",
             "verdict", "flags"}


# ---- the interval --------------------------------------------------------------------------------


def test_with_a_split_per_replicate_the_interval_is_the_textbook_t_interval() -> None:
    gaps = np.array([[0.05, -0.01], [0.12, 0.02], [-0.02, 0.00], [0.08, 0.03], [0.03, -0.02]])
    iv = t_interval(gaps, np.zeros(2))
    for k in range(2):
        lo, hi = stats.t.interval(0.95, 4, loc=gaps[:, k].mean(), scale=stats.sem(gaps[:, k]))
        assert (iv.low[k], iv.high[k]) == pytest.approx((lo, hi), abs=1e-12)
    assert iv.df[0] == pytest.approx(4.0)
    assert iv.p_value == pytest.approx(stats.ttest_1samp(gaps[:, 0], 0.0).pvalue, abs=1e-12)
    # The percentile bootstrap over 5 replicates the audit found was ≈ ±1.75 s/√R: t(4) is ±2.78 s/√R.
    assert (iv.high[0] - iv.low[0]) / 2 == pytest.approx(2.776 * stats.sem(gaps[:, 0]), rel=1e-3)


def test_a_shared_split_adds_its_sampling_variance_with_welch_satterthwaite_degrees() -> None:
    gaps = np.array([[0.05, 0.0], [0.07, 0.0], [0.06, 0.0]])
    shared = np.array([0.0004, 0.0])
    iv = t_interval(gaps, shared)
    between = gaps[:, 0].var(ddof=1) / 3
    se = math.sqrt(between + 0.0004)
    df = (between + 0.0004) ** 2 / (between**2 / 2)
    assert iv.se[0] == pytest.approx(se) and iv.df[0] == pytest.approx(df)
    assert iv.high[0] == pytest.approx(0.06 + stats.t.ppf(0.975, df) * se)
    # One replicate: the sampling variance alone, on the normal scale, and no p-value for a verdict.
    one = t_interval(gaps[:1], shared)
    assert one.high[0] == pytest.approx(0.05 + 1.959964 * 0.02, abs=1e-6) and one.between_sd is None


def test_the_row_bootstrap_variance_of_a_mean_is_its_known_value() -> None:
    """Rows resampled within groups: Var*(acc) = Σ_g (n_g/n)² p_g(1 − p_g)/n_g exactly in
    expectation; 4000 resamples estimate it within 10 %."""
    rng = np.random.default_rng(0)
    g = np.repeat(np.arange(4), 50)
    correct = rng.random(200) < np.array([0.9, 0.6, 0.6, 0.9])[g]
    accs = np.concatenate([(h.sum(axis=2) / s.sum(axis=1)[:, None])[:, 0]
                           for h, s in resampled_group_hits(correct, g, 4, 4000, [1])])
    p = np.array([correct[g == k].mean() for k in range(4)])
    want = sum((50 / 200) ** 2 * p[k] * (1 - p[k]) / 50 for k in range(4))
    assert accs.var() == pytest.approx(want, rel=0.1)


def test_repeated_items_are_resampled_whole_within_their_class() -> None:
    """Copies of one image move together: every resample gives all copies of an item one weight,
    each class keeps its number of items, and the variance of a mean is the between-item one."""
    rng = np.random.default_rng(2)
    k, copies = 30, 8
    item = np.repeat(np.arange(2 * k), copies)  # items 0..k−1 of class 0, k..2k−1 of class 1
    y = (item >= k).astype(np.int64)
    a = rng.integers(0, 2, len(item))
    g = 2 * y + a
    chunks = list(cluster_weights(item * 7 + 3, y, 50, [0]))  # any ids: numbered by first appearance
    assert sum(len(w) for w in chunks) == 50
    for w in chunks:
        per_item = w.reshape(len(w), 2 * k, copies)
        assert (per_item == per_item[:, :, :1]).all()
        assert (per_item[:, :k, 0].sum(axis=1) == k).all() and (per_item[:, k:, 0].sum(axis=1) == k).all()
    # An item's copies share its difficulty: the item bootstrap sees the between-item variance.
    p_item = rng.uniform(0.2, 1.0, 2 * k)
    correct = rng.random(len(item)) < p_item[item]
    accs = np.concatenate([(h.sum(axis=2) / s.sum(axis=1)[:, None])[:, 0]
                           for h, s in resampled_group_hits(correct, g, 4, 4000, [3], item, y)])
    means = correct.reshape(2 * k, copies).mean(axis=1)
    want = sum(0.25 * means[c * k:(c + 1) * k].var() / k for c in range(2))  # each class half the rows
    assert accs.var() == pytest.approx(want, rel=0.15)
    rows_only = np.concatenate([(h.sum(axis=2) / s.sum(axis=1)[:, None])[:, 0]
                                for h, s in resampled_group_hits(correct, g, 4, 2000, [3])])
    assert accs.var() > 2.0 * rows_only.var()  # counting copies as rows is too narrow
    with pytest.raises(ValueError, match="item 0 has rows in more than one stratum"):
        item_strata(np.array([0, 0]), np.array([0, 1]))


def test_the_report_interval_uses_items_where_there_are_items() -> None:
    rng = np.random.default_rng(4)
    item = np.repeat(np.arange(40), 10)
    y = (item >= 20).astype(np.int64)
    g = 2 * y + rng.integers(0, 2, len(item))
    correct = rng.random(len(item)) < rng.uniform(0.3, 1.0, 40)[item]
    rows = bootstrap_ci(correct, g, 4, 1000, [0])
    items = bootstrap_ci(correct, g, 4, 1000, [0], items=item, strata=y)
    # sd ratio ≈ √(1 + (copies − 1)·ICC) = √(1 + 9·0.18) ≈ 1.6 for item accuracies uniform on [0.3, 1]
    assert items["acc"][1] - items["acc"][0] > 1.3 * (rows["acc"][1] - rows["acc"][0])


def test_holm_on_a_known_case() -> None:
    # sorted 0.01, 0.02, 0.04 over m = 3: 0.03, 0.04, 0.04 (monotone); order given is kept.
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


def test_power_estimate_on_a_known_case() -> None:
    # t-based: the least n with n >= ((t_{n-1,.975} + t_{n-1,.80}) · sd / gap)²; sd/gap = 2 -> 34 (z: 32).
    assert seeds_needed(0.05, 0.10) == 34
    assert seeds_needed(-0.05, 0.10) == 34  # two-sided: the sign does not matter
    assert seeds_needed(0.5, 0.10) == 3 and seeds_needed(0.05, None) is None and seeds_needed(0.0, 0.1) is None
    # What it promises: a two-sided 5 % t test of 34 replicates (sd 0.1, true gap 0.05) rejects ~80 %.
    rng = np.random.default_rng(0)
    x = rng.normal(0.05, 0.10, size=(4000, 34))
    rate = (stats.ttest_1samp(x, 0.0, axis=1).pvalue < 0.05).mean()
    assert abs(rate - 0.80) < 0.03, rate


# ---- the null simulation -------------------------------------------------------------------------

P_GROUP = np.array([0.9, 0.6, 0.6, 0.9])  # groups (y, a): the minority groups are the worst


def _test_split(rng: np.random.Generator, repeated: bool) -> tuple[SplitGroups, np.ndarray]:
    """A test split of 400 rows in 4 groups and the rows' shared difficulty z (N(0, 1)): 400
    single rows, or 40 source items of 10 copies (class fixed per item, the attribute drawn per
    copy, the difficulty 0.8 shared within the item)."""
    if repeated:
        item = np.repeat(np.arange(40), 10)
        y = (item >= 20).astype(np.int64)
        a = rng.integers(0, 2, len(item))
        z = math.sqrt(0.8) * rng.normal(size=40)[item] + math.sqrt(0.2) * rng.normal(size=len(item))
    else:
        item, y, a = None, np.repeat([0, 1], 200), np.tile(np.repeat([0, 1], 100), 2)
        z = rng.normal(size=400)
    g = 2 * y + a
    return SplitGroups(g, g, y, y, item, item), z


def _correct(rng: np.random.Generator, t: SplitGroups, z: np.ndarray, tau: float, shift: np.ndarray) -> np.ndarray:
    """One model, one replicate: its group accuracies P_GROUP + shift + N(0, τ²) (this seed's luck),
    a row correct when 0.7·z + 0.71·ε is below the accuracy's normal quantile (the models share z)."""
    p = np.clip(P_GROUP + shift + tau * rng.normal(size=4), 0.02, 0.98)
    latent = math.sqrt(0.5) * z + math.sqrt(0.5) * rng.normal(size=len(z))
    return latent < stats.norm.ppf(p)[t.g_ood]


def _experiment(rng: np.random.Generator, tau: float, shared: bool, repeated: bool, effect: float = 0.0,
                replicates: int = 5, resamples: int = 100) -> tuple[float, float]:
    """One experiment of R replicates, generative vs erm: (the mean gap, its two-sided p-value)."""
    tests, reps, zs = [], [], []
    gain = np.array([0.0, effect, effect, 0.0])
    for _ in range(replicates):
        if shared and tests:
            t_index = 0
        else:
            t, z = _test_split(rng, repeated)
            tests.append(t)
            zs.append(z)
            t_index = len(tests) - 1
        t, z = tests[t_index], zs[t_index]
        ood = np.stack([_correct(rng, t, z, tau, gain), _correct(rng, t, z, tau, np.zeros(4))])
        idc = np.stack([_correct(rng, t, z, tau, gain), _correct(rng, t, z, tau, np.zeros(4))])
        reps.append(Replicate(t_index, idc, ood))
    draws = sampling_draws(tests, reps, 4, resamples, [int(rng.integers(1 << 30))])
    _, iv = contrast_interval(tests, reps, draws, np.array([1.0, -1.0]), 4)
    return float(iv.estimate[0]), float(iv.p_value)


@pytest.mark.parametrize("repeated", [False, True], ids=["rows", "repeated items"])
@pytest.mark.parametrize("shared", [False, True], ids=["redrawn splits", "shared split"])
def test_null_simulation_keeps_the_level(shared: bool, repeated: bool) -> None:
    """True gap 0, 5 replicates, seed-to-seed sd τ per model and group: the verdict names a
    winner in at most 5 % of experiments (within simulation error: 2.5 binomial sds over N) at
    every τ. Measured over 2,000 experiments a cell when this test was written, τ = 0 / 0.05 /
    0.1 / 0.2 (%): redrawn rows 5.0 / 4.9 / 5.9 / 5.5, redrawn items 5.0 / 6.6 / 4.3 / 5.5, shared
    rows 0.7 / 3.2 / 4.7 / 5.2, shared items 0.7 / 2.0 / 4.2 / 5.8 (the gaps are close to normal,
    kurtosis ≈ 0, so the t test's size is its nominal 5 % up to that noise; the percentile
    bootstrap it replaces named a winner in up to 18.5 %)."""
    n = 300 if shared else 600
    bound = 0.05 + 2.5 * math.sqrt(0.05 * 0.95 / n)
    for k, tau in enumerate((0.0, 0.05, 0.1, 0.2)):
        rng = np.random.default_rng([7, int(shared), int(repeated), k])
        rate = np.mean([_experiment(rng, tau, shared, repeated)[1] < 0.05 for _ in range(n)])
        assert rate <= bound, (tau, rate, bound)


def test_power_at_a_stated_effect() -> None:
    """The figure the docs quote: 5 redrawn replicates of 100 rows a group, a true worst-group
    gain of 0.15 (both minority groups) at τ = 0.05: the interval names the generative model in
    0.89 of 1,000 experiments when this test was written (0.49 at τ = 0.1; a gain of 0.10: 0.58
    and 0.27) — and never the other model."""
    rng = np.random.default_rng(12)
    results = [_experiment(rng, 0.05, False, False, effect=0.15) for _ in range(300)]
    power = np.mean([p < 0.05 and est > 0 for est, p in results])
    assert power >= 0.8, power
    assert not any(p < 0.05 and est < 0 for est, p in results)


# ---- synthetic runs through evidence.gather / build_report ---------------------------------------


def _data(n: int, acc_ood: float, acc_id: float, seed: int, weak_group: float | None = None) -> RunData:
    """A binary-task predictions record: 4 groups of n rows in each test split, correct with
    probability acc_* (group 3 of test_ood with `weak_group` instead, when given)."""
    rng = np.random.default_rng(seed)
    split = np.array(["train"] * 8 + ["val"] * 8 + ["test_id"] * 4 * n + ["test_ood"] * 4 * n, dtype=object)
    g = np.concatenate([np.arange(4).repeat(2), np.arange(4).repeat(2), np.arange(4).repeat(n), np.arange(4).repeat(n)])
    y = g // 2
    p = np.where(split == "test_id", acc_id, np.where(split == "test_ood", acc_ood, 1.0))
    if weak_group is not None:
        p = np.where((split == "test_ood") & (g == 3), weak_group, p)
    correct = rng.random(len(g)) < p
    pred = np.where(correct, y, 1 - y)
    return RunData(split, y, g % 2, g, np.eye(2, dtype=np.float32)[pred])


def _metrics(dataset: str, model: str, seed: int, d: RunData, kind: str, convergence: dict | None = None,
             chance: bool = False) -> dict:
    """The metrics dict the report reads, computed from `d` (as evaluate would); `chance`: a val
    split scored at chance (balanced accuracy 0.5)."""
    from stages.evaluation.metrics import split_metrics

    splits = {}
    for s in ("train", "val", "test_id", "test_ood"):
        rows = d.split == s
        logits = d.logits[rows] if not (chance and s == "val") else np.eye(2, dtype=np.float32)[np.zeros(rows.sum(), int)]
        splits[s] = split_metrics(logits, d.y[rows], d.g[rows], 4, np.full(4, 0.25), 5)
        splits[s].pop("reliability")
    info = {"kind": kind, "selection": "val_worst_group", **({"convergence": convergence} if convergence else {})}
    return {"dataset": dataset, "model": model, "seed": seed, "n_classes": 2, "n_attrs": 2, "ece_bins": 5,
            "model_config": info, "splits": splits}


def _run(datasets_seeds: list[tuple[str, int]], gen_acc: float, ref_acc: float, n: int = 60,
         convergence: dict[str, dict] | None = None, at_chance: tuple[str, ...] = ()) -> tuple[list[dict], dict]:
    """lda and qda (generative) against erm and groupdro, every (dataset, seed)."""
    kinds = {"lda": ("lda", gen_acc), "qda": ("qda", gen_acc), "erm": ("erm", ref_acc), "groupdro": ("groupdro", ref_acc)}
    metrics, data = [], {}
    for k, (dataset, seed) in enumerate(datasets_seeds):
        for i, (model, (kind, acc)) in enumerate(kinds.items()):
            d = _data(n, 0.8, 0.9, seed=1000 * k + 10 * i + seed, weak_group=acc)
            data[(dataset, model, seed)] = d
            metrics.append(_metrics(dataset, model, seed, d, kind, (convergence or {}).get(model), model in at_chance))
    return metrics, data


def _boot(**kw: object):
    return defaults("evaluate", "default", bootstrap_resamples=400, **kw)


def test_default_run_with_one_seed_is_not_distinguishable_and_says_why() -> None:
    # A gap the examples alone would call (0.9 vs 0.3 on a group of 60), but one replicate.
    metrics, data = _run([("toy", 0)], gen_acc=0.9, ref_acc=0.3)
    built = render.build_report(metrics, data, boot=_boot())
    e = built.summary["_evidence"]["toy"]
    assert e["seeds"] == 1 and {p["verdict"] for p in e["pairs"]} == {"not distinguishable"}
    assert all(set(p) >= PAIR_KEYS for p in e["pairs"])
    matched = [p for p in e["pairs"] if p["comparison"] == "matched"]
    assert [(p["generative"], p["reference"]) for p in matched] == [("lda", "erm"), ("qda", "erm")]
    assert matched[0]["low"] > 0  # the example-level interval alone excludes 0 ...
    assert set(matched[0]["drop"]) == {"estimate", "low", "high"}
    assert matched[0]["p_value"] is None and matched[0]["p_holm"] is None
    assert e["note"].startswith("1 replicate: the interval holds the test examples' sampling noise only")  # ... and says why
    assert "1 replicate: the interval holds" in built.markdown
    assert e["family"]["summary"].startswith("a summary, not a verdict")


def test_matched_and_group_aware_verdicts_over_replicates_with_holm_and_flags() -> None:
    runs = [(f"toy_seed{s}", s) for s in range(5)]
    flags = {"qda": {"flag": "may be under-trained", "improvement": 0.2},
             "erm": {"flag": "plateaued", "improvement": 0.0, "overfitting": True}}
    metrics, data = _run(runs, gen_acc=0.95, ref_acc=0.3, convergence=flags)
    bases = {d: "toy" for d, _ in runs}
    got = evidence.gather(metrics, data, _boot(), {}, bases)
    e = got["toy"]
    assert len(e.replicates) == 5 and not e.shared_split
    assert e.generative == ["lda", "qda"] and e.reference == ["erm", "groupdro"] and e.absent_reference == ["jtt", "dfr"]
    kinds = [(p.model, p.against, p.comparison) for p in e.pairs]
    assert kinds == [("lda", "erm", "matched"), ("lda", "groupdro", "group-aware"),
                     ("qda", "erm", "matched"), ("qda", "groupdro", "group-aware")]
    for p in e.pairs:
        assert p.verdict == "generative better" and p.worst_group["low"] > 0 and p.family_size == 2
        assert p.p_holm >= p.p_value
    assert e.pairs[2].flags == ["qda may be under-trained", "erm over-fitting flagged",
                                "val's smallest group holds 2 rows (< 50): selection on it is noisy"]
    assert e.smallest_group == {"test_id": 60, "test_ood": 60, "val": 2}
    assert "erm over-fitting flagged" in e.pairs[0].verdict_text()
    built = render.build_report(metrics, data, boot=_boot(), bases=bases)
    assert "| toy | matched | lda − erm | 5 |" in built.markdown
    assert built.summary["_evidence"]["toy"]["pairs"][0]["verdict"] == "generative better"


def test_instances_with_one_fixed_test_split_share_it_and_widen_the_interval() -> None:
    """A real data set's replicates redraw train/val but keep the official test split (its prepared
    metadata `test_sha256`): the same key makes the split shared, so its sampling variance joins
    the interval; without the key each instance would count as a fresh test split."""
    runs = [(f"toy_seed{s}", s) for s in range(5)]
    metrics, data = _run(runs, gen_acc=0.8, ref_acc=0.7)
    bases = {d: "toy" for d, _ in runs}
    apart = evidence.gather(metrics, data, _boot(), {}, bases)["toy"]
    shared = evidence.gather(metrics, data, _boot(), {}, bases, {d: "sha-of-the-test-rows" for d, _ in runs})["toy"]
    assert not apart.shared_split and shared.shared_split
    assert shared.summary()["test_split"] == "shared by the replicates"
    for a, b in zip(apart.pairs, shared.pairs, strict=True):
        assert a.worst_group["estimate"] == b.worst_group["estimate"]
        assert b.worst_group["high"] - b.worst_group["low"] > a.worst_group["high"] - a.worst_group["low"]


def test_a_model_that_failed_to_learn_blocks_its_verdicts() -> None:
    """lda at chance on val (balanced accuracy 0.5) on one seed: both of its pairs are blocked
    (no test, out of Holm's family), qda's still stand."""
    runs = [(f"toy_seed{s}", s) for s in range(5)]
    metrics, data = _run(runs, gen_acc=0.95, ref_acc=0.3)
    for m in metrics:
        if m["model"] == "lda" and m["seed"] == 2:
            m.update(_metrics(m["dataset"], "lda", 2, data[(m["dataset"], "lda", 2)], "lda", chance=True))
    e = evidence.gather(metrics, data, _boot(), {}, {d: "toy" for d, _ in runs})["toy"]
    assert e.failed == ["lda (1/5 seeds)"]
    lda = [p for p in e.pairs if p.model == "lda"]
    assert {p.verdict for p in lda} == {"blocked"} and all(p.p_holm is None for p in lda)
    assert lda[0].verdict_text().startswith("**blocked**: lda (1/5 seeds) failed to learn")
    qda = [p for p in e.pairs if p.model == "qda"]
    assert {p.verdict for p in qda} == {"generative better"} and all(p.family_size == 1 for p in qda)
    assert e.summary()["failed_to_learn"] == ["lda"]


def test_no_gap_is_not_distinguishable_with_the_seeds_a_t_test_asks_for() -> None:
    metrics, data = _run([("toy", s) for s in range(4)], gen_acc=0.5, ref_acc=0.5, n=40)
    e = evidence.gather(metrics, data, _boot(), {})["toy"]
    assert e.shared_split  # four seeds on one test split
    for p in e.pairs:
        assert p.verdict == "not distinguishable" and p.worst_group["low"] <= 0 <= p.worst_group["high"]
        assert p.seeds_needed == seeds_needed(p.worst_group["estimate"], p.between_sd)
