"""Evidence over replicates: does each generative classifier beat the matched discriminative model
where the shortcut breaks?

The question the seed paper asks is matched: a class-conditional generative model against a
discriminative model trained on the same inputs without group labels, each selected by
the run's rule. So the evidence is a list of **pairs** per base dataset (docs/metrics.md,
"Evidence over replicates"):

- **matched**: each generative model of the run against `evaluate.evidence_matched` (plain ERM) —
  the headline, one verdict per generative model;
- **group-aware**: each generative model against each other model of
  `evaluate.evidence_reference` (the robust methods there use group labels or an error set) — a
  second, labelled comparison;
- the **family** mean (every generative model against every reference model) is kept as a
  summary only, never a verdict.

A **replicate** is one (dataset, seed) run of every compared model; a dataset redrawn per seed
(prepared metadata `replicate_of`) is a replicate of its base. A pair's gap per replicate r is
d_r = wg_A(r) − wg_B(r) in test_ood worst-group accuracy, and the same in the ID→OOD accuracy
drop (acc test_id − acc test_ood), so "better overall" and "less shortcut" are told apart.

**Interval** (built for few replicates): the mean gap ± t_{ν, 0.975} · se with

    se² = s²/R + V,   ν = se⁴ / ((s²/R)² / (R − 1))     (Welch–Satterthwaite, V known)

s² the sample variance of the R replicate gaps and V the test examples' sampling variance of
the mean gap over test splits **shared** by several replicates (a fixed test split scored by
several seeds: its noise is common to them and does not shrink with R). V is a bootstrap
variance: the shared split's examples resampled within each group, or, where a test item
appears several times (copies of one source image, prepared metadata `source_item_modulus`),
whole items resampled within each class. With a test split per replicate (redrawn data) each
d_r carries its own examples' noise and V = 0: a plain one-sample t interval on R − 1 degrees
of freedom. tests/test_evidence.py simulates the null (seed-to-seed sd τ up to 0.2, shared and
redrawn splits, repeated items) and asserts at most 5 % false verdicts in every cell.

**Verdict**: a winner only with R ≥ 2 and a two-sided p-value that survives Holm's step-down
correction over the run's comparisons of the same kind (all matched pairs of every base dataset
form one family; the group-aware pairs another); else `not distinguishable`. A pair with a
model that **failed to learn** (val balanced accuracy within `evaluate.learned_margin` of
chance on some seed) has no verdict and no test: `blocked`. Under-trained, over-fitting and
selection-rule flags stand beside the verdict.

Nothing here formats a page beyond the verdict's words (`fmt_gap`, `Pair.verdict_text`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from stages.core.io import fixed_precision
from stages.core.settings import EvaluateConfig
from stages.evaluation.comparison import (
    RunData,
    failed_to_learn,
    model_config,
    model_type,
    ordered,
    run_convergence,
    smallest_groups,
)
from stages.evaluation.metrics import group_accuracies, resampled_group_hits
from stages.evaluation.regime import expected_use

# Bootstrap streams of the evidence: [bootstrap_seed, EVIDENCE_STREAM, base dataset index, ...],
# apart from evaluate's and the report's per-model streams (comparison.REPORT_STREAM = 100..).
EVIDENCE_STREAM = 300
LEVEL = 0.95
ALPHA = 1.0 - LEVEL
# The power estimate: two-sided test at ALPHA, power POWER.
POWER = 0.80
UNDER_TRAINED = "may be under-trained"
VERDICTS = ("generative better", "discriminative better", "not distinguishable", "blocked")
MATCHED, GROUP_AWARE = "matched", "group-aware"
# Checkpoint selection (and JTT's T, DFR's C and its fit) read val's groups: below this many rows
# in its smallest group, the report flags every pair of the dataset.
VAL_GROUP_MIN = 50
# An `overfitting` value (bool, flag string, or {"flag": ...}) that does not flag the run.
NOT_FLAGGED = frozenset({"", "n/a", "no", "none", "false", "plateaued", "not over-fitting", "not overfitting"})


@dataclass
class SplitGroups:
    """One dataset's test splits: groups (and classes, and source items where a test item is
    repeated) of test_id and test_ood, in file order."""

    g_id: np.ndarray
    g_ood: np.ndarray
    y_id: np.ndarray | None = None
    y_ood: np.ndarray | None = None
    items_id: np.ndarray | None = None  # source item per row; None: every row its own item
    items_ood: np.ndarray | None = None


@dataclass
class Replicate:
    """One (dataset, seed): every compared model's correctness on its dataset's test splits."""

    test: int  # index of its SplitGroups
    id_correct: np.ndarray  # (M, n_id) bool, models in the order of the contrast weights
    ood_correct: np.ndarray  # (M, n_ood)


def replicate_values(r: Replicate, t: SplitGroups, n_groups: int) -> np.ndarray:
    """(M, 2) per model: test_ood worst-group accuracy and ID→OOD accuracy drop, examples as they are."""
    present = np.bincount(t.g_ood, minlength=n_groups) > 0
    wga = np.array([group_accuracies(c, t.g_ood, n_groups)[1][present].min() for c in r.ood_correct])
    drop = r.id_correct.mean(axis=1) - r.ood_correct.mean(axis=1)
    return np.stack([wga, drop], axis=1)


def replicate_gaps(
    tests: Sequence[SplitGroups], replicates: Sequence[Replicate], weights: np.ndarray, n_groups: int
) -> np.ndarray:
    """(R, 2): each replicate's contrast Σ_m w_m·v_m in worst-group accuracy and in the drop."""
    return np.array([weights @ replicate_values(r, tests[r.test], n_groups) for r in replicates],
                    dtype=np.float64).reshape(len(replicates), 2)


def sampling_draws(
    tests: Sequence[SplitGroups],
    replicates: Sequence[Replicate],
    n_groups: int,
    resamples: int,
    seed: Sequence[int],
) -> dict[int, np.ndarray]:
    """Per test split t scored by ≥ 2 replicates (or the only replicate): (B, R_t, M, 2), every
    model's (worst-group, drop) of each of its replicates on B resamples of t's examples.

    Resample b of t: test_id with stream `[*seed, 1 + t, 0]`, test_ood with `[*seed, 1 + t, 1]`
    (`metrics.resampled_group_hits`: rows within each group, or whole source items within each
    class where the split records them), one resample shared by every model and replicate on t,
    so models and seeds stay paired on the same examples."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    out = {}
    for t, test in enumerate(tests):
        mine = [r for r in replicates if r.test == t]
        if not (len(mine) >= 2 or len(replicates) == 1 and mine):
            continue
        m = mine[0].ood_correct.shape[0]
        ood = np.concatenate([r.ood_correct for r in mine])  # (R_t·M, n_ood)
        idc = np.concatenate([r.id_correct for r in mine])
        wga, acc_ood, acc_id = [], [], []
        for hits, sizes in resampled_group_hits(ood, test.g_ood, n_groups, resamples, [*seed, 1 + t, 1],
                                                test.items_ood, test.y_ood):
            with np.errstate(invalid="ignore", divide="ignore"):
                gacc = np.where(sizes[:, None, :] > 0, hits / sizes[:, None, :], np.inf)
            wga.append(gacc.min(axis=2))
            acc_ood.append(hits.sum(axis=2) / sizes.sum(axis=1)[:, None])
        for hits, sizes in resampled_group_hits(idc, test.g_id, n_groups, resamples, [*seed, 1 + t, 0],
                                                test.items_id, test.y_id):
            acc_id.append(hits.sum(axis=2) / sizes.sum(axis=1)[:, None])
        w, a_ood, a_id = (np.concatenate(v).reshape(resamples, len(mine), m) for v in (wga, acc_ood, acc_id))
        out[t] = np.stack([w, a_id - a_ood], axis=3)
    return out


@dataclass
class Interval:
    """The t interval of one contrast's mean gap (worst-group and drop columns)."""

    estimate: np.ndarray  # (2,)
    low: np.ndarray | None
    high: np.ndarray | None
    se: np.ndarray | None
    df: np.ndarray | None
    p_value: float | None  # two-sided, worst-group column
    between_sd: float | None  # sd of the R replicate worst-group gaps


def t_interval(per_rep: np.ndarray, shared_var: np.ndarray, level: float = LEVEL) -> Interval:
    """The mean of `per_rep` (R, 2) ± t_{ν} · se, se² = s²/R + `shared_var` (2,), ν by
    Welch–Satterthwaite with `shared_var` known (∞ when s = 0); R = 1: the sampling variance
    alone on the normal scale (shown, never a verdict). No interval when se is 0 or undefined."""
    r = len(per_rep)
    est = per_rep.mean(axis=0)
    between = per_rep.var(axis=0, ddof=1) / r if r >= 2 else np.zeros(2)
    if r < 2 and not np.any(shared_var > 0):
        return Interval(est, None, None, None, None, None, None)
    var = between + shared_var
    se = np.sqrt(var)
    with np.errstate(invalid="ignore", divide="ignore"):
        df = np.where(between > 0, var**2 / (between**2 / max(r - 1, 1)), np.inf)
    q = stats.t.ppf(0.5 + level / 2.0, df)
    p = None
    if se[0] > 0:
        p = float(2.0 * stats.t.sf(abs(est[0]) / se[0], df[0]))
    elif est[0] != 0:
        p = 0.0
    sd = float(math.sqrt(per_rep[:, 0].var(ddof=1))) if r >= 2 else None
    return Interval(est, est - q * se, est + q * se, se, df, p, sd)


def contrast_interval(
    tests: Sequence[SplitGroups],
    replicates: Sequence[Replicate],
    draws: dict[int, np.ndarray],
    weights: np.ndarray,
    n_groups: int,
) -> tuple[np.ndarray, Interval]:
    """(per-replicate gaps (R, 2), their t interval) of the contrast `weights` over the models."""
    per_rep = replicate_gaps(tests, replicates, weights, n_groups)
    r = len(replicates)
    shared = np.zeros(2)
    for d in draws.values():
        shared += np.einsum("brmk,m->bk", d, weights).var(axis=0, ddof=1) / (r * r)  # Var_b of Σ_{r on t} gap / R
    return per_rep, t_interval(per_rep, shared)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given): p_(i) → max_{j ≤ i} min(1, (m − j + 1)·p_(j))."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: (p_values[i], i))
    out = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def seeds_needed(gap: float, sd: float | None, power: float = POWER, alpha: float = ALPHA) -> int | None:
    """Replicates for a two-sided t test at `alpha` to detect `gap` with probability `power`,
    when replicates scatter with sd `sd`: the least n ≥ 2 with n ≥ ((t_{n−1, 1−α/2} +
    t_{n−1, power}) · sd / |gap|)² (the usual t-based iteration). None without an sd or a gap of 0."""
    if sd is None or gap == 0:
        return None
    ratio = sd / abs(gap)
    for n in range(2, 100_000):
        need = ((stats.t.ppf(1.0 - alpha / 2.0, n - 1) + stats.t.ppf(power, n - 1)) * ratio) ** 2
        if n >= need:
            return n
    return None


def overfitting_flag(record: dict[str, Any]) -> str | None:
    """The over-fitting flag of a run's `convergence` record, or None: its key `overfitting` may
    be a bool, a flag string, or an object with a `flag`; True reads "may be over-fitting"."""
    value = record.get("overfitting")
    if isinstance(value, dict):
        value = value.get("flag")
    if value is True:
        return "may be over-fitting"
    if isinstance(value, str) and value.strip().lower() not in NOT_FLAGGED:
        return value
    return None


def flagged(runs: Sequence[dict[str, Any]], models: Sequence[str], test: Any) -> list[str]:
    """`models` (in order) with a run that `test` flags, as 'name (k/S seeds)' when only some of
    its S runs are."""
    out = []
    for model in models:
        mine = [r for r in runs if r["model"] == model]
        hits = sum(1 for r in mine if test(r))
        if hits:
            out.append(model if hits == len(mine) else f"{model} ({hits}/{len(mine)} seeds)")
    return out


def _gap(est: float | None = None, low: float | None = None, high: float | None = None) -> dict[str, float | None]:
    return {"estimate": est, "low": low, "high": high}


@dataclass
class Pair:
    """One comparison: `model` (generative) − `against`, over the replicates."""

    model: str
    against: str
    comparison: str  # MATCHED or GROUP_AWARE
    replicates: int
    worst_group: dict[str, float | None] = field(default_factory=_gap)
    drop: dict[str, float | None] = field(default_factory=_gap)
    df: float | None = None
    p_value: float | None = None
    p_holm: float | None = None
    family_size: int | None = None  # comparisons in its Holm family
    between_sd: float | None = None
    seeds_needed: int | None = None
    verdict: str = "not distinguishable"
    flags: list[str] = field(default_factory=list)
    blocked_by: list[str] = field(default_factory=list)
    shared_split: bool = False

    def summary(self) -> dict[str, Any]:
        """summary.json's pair: the worst-group gap flat (estimate, low, high), the drop's beside it."""
        return {
            "generative": self.model, "reference": self.against, "comparison": self.comparison,
            "replicates": self.replicates, **self.worst_group, "drop": self.drop,
            "df": self.df, "p_value": self.p_value, "p_holm": self.p_holm, "family_size": self.family_size,
            "verdict": self.verdict, "flags": self.flags, "seeds_needed": self.seeds_needed,
        }

    def verdict_text(self) -> str:
        """The verdict in words: a winner only where the Holm-corrected test says so."""
        if self.verdict == "blocked":
            return f"**blocked**: {', '.join(self.blocked_by)} failed to learn (at chance on val), no comparison"
        text = f"**{self.verdict}**"
        if self.p_holm is not None:
            text += f" (Holm p = {self.p_holm:.2g} over {self.family_size})"
        if self.flags:
            text += "; " + "; ".join(self.flags)
        return text


@dataclass
class Evidence:
    """One base dataset's comparisons over replicates (summary.json `_evidence[<base>]`)."""

    base: str
    datasets: list[str]
    replicates: list[tuple[str, int]]
    generative: list[str]
    reference: list[str]
    matched: str | None
    absent_reference: list[str]
    pairs: list[Pair]
    family: dict[str, Any]
    regime: str | None
    under_trained: list[str]
    overfitting: list[str]
    failed: list[str]
    smallest_group: dict[str, int] = field(default_factory=dict)
    shared_split: bool = False
    note: str = ""

    def matched_pairs(self) -> list[Pair]:
        return [p for p in self.pairs if p.comparison == MATCHED]

    def summary(self) -> dict[str, Any]:
        """The summary.json object (docs/metrics.md, "Evidence over replicates")."""
        return {
            "seeds": len(self.replicates),
            "test_split": "shared by the replicates" if self.shared_split else "one per replicate",
            "pairs": [p.summary() for p in self.pairs],
            "family": self.family,
            "regime": self.regime,
            "under_trained": [n.split(" (")[0] for n in self.under_trained],
            "overfitting": [n.split(" (")[0] for n in self.overfitting],
            "failed_to_learn": [n.split(" (")[0] for n in self.failed],
            "note": self.note,
        }


def fmt_gap(gap: dict[str, float | None]) -> str:
    """'+0.123 [−0.050, +0.300]' (no interval: the estimate and 'no interval')."""
    est, lo, hi = gap.get("estimate"), gap.get("low"), gap.get("high")
    if est is None:
        return "n/a"
    return f"{est:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None and hi is not None else " (no interval)")


def _regime(separations: Sequence[dict[str, Any] | None]) -> str | None:
    """The data's regime in words (`regime.expected_use`: population LDA against logistic
    regression on the data, not the fitted models): a description, never a prediction of the
    verdict; 'mixed …' when the replicates' prepared files differ."""
    uses = ordered([expected_use(s) or "no call" for s in separations])
    if uses == ["no call"]:
        return None
    if len(uses) > 1:
        return f"mixed across replicates ({', '.join(uses)})"
    return f"population LDA uses the cue {uses[0]} than logistic regression"


def _selection_flag(info: dict[str, dict[str, Any]], a: str, b: str) -> str | None:
    sa, sb = info[a].get("selection"), info[b].get("selection")
    if sa and sb and sa != sb:
        return f"selected by different rules ({a}: {sa}, {b}: {sb})"
    return None


def evidence_for(
    base: str,
    datasets: Sequence[str],
    runs: Sequence[dict[str, Any]],
    data: dict[tuple[str, str, int], RunData] | None,
    boot: EvaluateConfig,
    separations: Sequence[dict[str, Any] | None],
    seed: Sequence[int],
    test_keys: dict[str, str | None] | None = None,
) -> Evidence:
    """The evidence of one base dataset from the runs (metrics dicts) of its `datasets`; the
    verdicts wait for `apply_holm` over the whole run (`gather`). `test_keys`: per dataset, what
    identifies its test splits (`comparison.test_split_key`; default the dataset): replicate
    instances with one key share one test split."""
    models = ordered([m["model"] for m in runs])
    info = {m: model_config([r for r in runs if r["model"] == m]) for m in models}
    generative = [m for m in models if model_type(info[m]) == "generative"]
    reference = [m for m in boot.evidence_reference if m in models and m not in generative]
    matched = boot.evidence_matched if boot.evidence_matched in reference else None
    if matched:  # the matched reference first
        reference = [matched, *[m for m in reference if m != matched]]
    absent = [m for m in boot.evidence_reference if m not in models]
    compared = generative + reference
    replicates = ordered([(str(m["dataset"]), int(m["seed"])) for m in runs])  # type: ignore[arg-type]
    by_key = {(m["dataset"], m["model"], int(m["seed"])): m for m in runs}
    complete = [(d, s) for d, s in replicates if all((d, m, s) in by_key for m in compared)]
    first = runs[0]
    n_groups = int(first["n_classes"]) * int(first["n_attrs"])
    mine = [r for r in runs if r["model"] in compared]
    margin = boot.learned_margin
    e = Evidence(
        base=base, datasets=list(datasets), replicates=complete, generative=generative, reference=reference,
        matched=matched, absent_reference=absent, pairs=[], family={}, regime=_regime(separations),
        under_trained=flagged(mine, compared, lambda r: run_convergence(r).get("flag") == UNDER_TRAINED),
        overfitting=flagged(mine, compared, lambda r: overfitting_flag(run_convergence(r)) is not None),
        failed=flagged(mine, compared, lambda r: failed_to_learn(r, margin)),
        smallest_group=smallest_groups(list(runs)),
    )
    if not generative or not reference:
        missing = "generative model" if not generative else "model of the reference family `evaluate.evidence_reference`"
        e.note = f"This run has no {missing}."
        return e
    tests: list[SplitGroups] = []
    reps: list[Replicate] = []
    draws: dict[int, np.ndarray] = {}
    if data is not None:
        tests, reps = replicate_arrays(complete, compared, data, test_keys)
        e.shared_split = len(tests) < len(reps)
        if boot.bootstrap_resamples > 0 and reps:
            draws = sampling_draws(tests, reps, n_groups, boot.bootstrap_resamples, seed)
    val_small = min((int(g["n"]) for r in mine for g in r["splits"]["val"].get("groups", {}).values() if int(g["n"]) > 0),
                    default=None)
    e.smallest_group = {**e.smallest_group, **({"val": val_small} if val_small is not None else {})}
    failed = {n.split(" (")[0]: n for n in e.failed}
    under = {n.split(" (")[0]: n for n in e.under_trained}
    over = {n.split(" (")[0]: n for n in e.overfitting}

    def contrast(weights: np.ndarray) -> tuple[np.ndarray, Interval | None]:
        if data is None:  # no predictions: the estimate from the metrics files, no interval
            vals = np.array([[[by_key[(d, m, s)]["splits"]["test_ood"]["worst_group_acc"],
                               by_key[(d, m, s)]["splits"]["test_id"]["acc"] - by_key[(d, m, s)]["splits"]["test_ood"]["acc"]]
                              for m in compared] for d, s in complete]).reshape(len(complete), len(compared), 2)
            return np.einsum("m,rmk->rk", weights, vals), None
        if boot.bootstrap_resamples == 0 and (len(complete) < 2 or e.shared_split):
            return replicate_gaps(tests, reps, weights, n_groups), None
        return contrast_interval(tests, reps, draws, weights, n_groups)

    for a in generative:
        for b in reference:
            w = np.zeros(len(compared))
            w[compared.index(a)], w[compared.index(b)] = 1.0, -1.0
            p = Pair(a, b, MATCHED if b == matched else GROUP_AWARE, len(complete), shared_split=e.shared_split)
            p.blocked_by = [failed[m] for m in (a, b) if m in failed]
            p.flags = [f"{under[m]} may be under-trained" for m in (a, b) if m in under]
            p.flags += [f"{over[m]} over-fitting flagged" for m in (a, b) if m in over]
            p.flags += [f for f in [_selection_flag(info, a, b)] if f]
            if val_small is not None and val_small < VAL_GROUP_MIN:
                p.flags.append(f"val's smallest group holds {val_small} rows (< {VAL_GROUP_MIN}): selection on it is noisy")
            per_rep, iv = contrast(w)
            _fill(p, per_rep, iv)
            if p.blocked_by:
                p.verdict = "blocked"
            e.pairs.append(p)
    w = np.concatenate([np.full(len(generative), 1.0 / len(generative)), np.full(len(reference), -1.0 / len(reference))])
    fam = Pair("generative family", "reference family", "summary", len(complete))
    per_rep, iv = contrast(w)
    _fill(fam, per_rep, iv)
    e.family = {
        "summary": ("a summary, not a verdict: the mean over the generative models "
                    f"({', '.join(generative)}) minus the mean over the reference models ({', '.join(reference)})"),
        "worst_group": fam.worst_group, "drop": fam.drop,
    }
    notes = []
    if len(complete) < 2:
        notes.append(f"{len(complete)} replicate: the interval holds the test examples' sampling noise only, not the "
                     "variance between seeds (and data draws), so it carries no verdict: run ≥ 2 seeds (`run.seeds`; "
                     "5 or more for a useful t interval).")
    elif data is None or boot.bootstrap_resamples == 0 and e.shared_split:
        notes.append("No interval (no predictions, or `evaluate.bootstrap_resamples` is 0 on a shared test split): no verdict.")
    if len(complete) < len(replicates):
        notes.append(f"{len(replicates) - len(complete)} (dataset, seed) runs lack a compared model and are left out.")
    e.note = " ".join(notes)
    return e


def _fill(p: Pair, per_rep: np.ndarray, iv: Interval | None) -> None:
    """A pair's numbers at the precision the report writes (what follows is decided on them)."""
    est = fixed_precision(per_rep.mean(axis=0).tolist()) if len(per_rep) else [None, None]
    p.worst_group["estimate"], p.drop["estimate"] = est
    if iv is None:
        return
    if iv.low is not None and iv.high is not None:
        for k, gap in enumerate((p.worst_group, p.drop)):
            gap["low"], gap["high"] = fixed_precision([float(iv.low[k]), float(iv.high[k])])
        p.df = fixed_precision(float(iv.df[0])) if iv.df is not None and np.isfinite(iv.df[0]) else None
    if p.replicates >= 2:
        p.p_value = fixed_precision(iv.p_value) if iv.p_value is not None else None
        p.between_sd = fixed_precision(iv.between_sd)


def apply_holm(evidence: dict[str, Evidence], alpha: float = ALPHA) -> None:
    """The verdicts: within each kind of comparison (matched; group-aware) over every base
    dataset of the run, Holm's correction of the pairs that carry a test (R ≥ 2, an interval,
    no model that failed to learn); a winner where the adjusted p-value is below `alpha`."""
    for kind in (MATCHED, GROUP_AWARE):
        pairs = [p for e in evidence.values() for p in e.pairs if p.comparison == kind]
        tested = [p for p in pairs if p.verdict != "blocked" and p.p_value is not None and p.replicates >= 2]
        for p, adj in zip(tested, holm([float(p.p_value) for p in tested]), strict=True):  # type: ignore[arg-type]
            p.p_holm, p.family_size = fixed_precision(adj), len(tested)
            if adj < alpha:
                p.verdict = "generative better" if float(p.worst_group["estimate"] or 0.0) > 0 else "discriminative better"
        for p in pairs:
            if p.verdict == "not distinguishable" and p.replicates >= 2:
                p.seeds_needed = seeds_needed(float(p.worst_group["estimate"] or 0.0), p.between_sd)


def replicate_arrays(
    replicates: Sequence[tuple[str, int]], compared: Sequence[str], data: dict[tuple[str, str, int], RunData],
    test_keys: dict[str, str | None] | None = None,
) -> tuple[list[SplitGroups], list[Replicate]]:
    """The test sets (one per dataset, or per `test_keys` value: instances of a dataset whose
    test splits stay fixed share one) and every replicate's correctness stacks."""
    tests: list[SplitGroups] = []
    index: dict[str, int] = {}
    reps = []
    for d, s in replicates:
        runs = [data[(d, m, s)] for m in compared]
        split = runs[0].split
        id_rows, ood_rows = split == "test_id", split == "test_ood"
        key = (test_keys or {}).get(d) or d
        if key not in index:
            index[key] = len(tests)
            items = runs[0].item
            tests.append(SplitGroups(runs[0].g[id_rows], runs[0].g[ood_rows], runs[0].y[id_rows], runs[0].y[ood_rows],
                                     None if items is None else items[id_rows], None if items is None else items[ood_rows]))
        reps.append(Replicate(index[key], np.stack([r.correct[id_rows] for r in runs]),
                              np.stack([r.correct[ood_rows] for r in runs])))
    return tests, reps


def gather(
    metrics: Sequence[dict[str, Any]],
    data: dict[tuple[str, str, int], RunData] | None,
    boot: EvaluateConfig,
    separations: dict[str, dict[str, Any] | None],
    bases: dict[str, str] | None = None,
    test_keys: dict[str, str | None] | None = None,
) -> dict[str, Evidence]:
    """Per base dataset (`bases[dataset]`, default the dataset itself), in run order, its
    evidence, with the run's verdicts (`apply_holm`); `test_keys` as `evidence_for`'s."""
    datasets = ordered([str(m["dataset"]) for m in metrics])
    base_of = {d: (bases or {}).get(d, d) for d in datasets}
    out = {}
    for i, base in enumerate(ordered([base_of[d] for d in datasets])):
        mine = [d for d in datasets if base_of[d] == base]
        out[base] = evidence_for(
            base, mine, [m for m in metrics if m["dataset"] in mine], data, boot,
            [separations.get(d) for d in mine], [boot.bootstrap_seed, EVIDENCE_STREAM, i], test_keys,
        )
    apply_holm(out)
    return out


def headline(e: Evidence) -> str:
    """One line per base dataset: each matched pair's verdict (for the per-dataset sections)."""
    parts = [f"{p.model} − {p.against} {fmt_gap(p.worst_group)} {p.verdict}" for p in e.matched_pairs()]
    return "; ".join(parts) if parts else "no matched pair (no generative model or no `evaluate.evidence_matched` in the run)"

