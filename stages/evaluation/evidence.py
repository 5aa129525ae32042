"""Evidence over replicates: do the generative classifiers beat the discriminative reference?

For each base dataset, the gap *generative − reference* in OOD worst-group accuracy and in the
ID→OOD accuracy drop, with a 95% interval from a two-level bootstrap, and the verdict it
supports (docs/metrics.md, "Evidence over replicates"):

- A **replicate** is one (dataset, seed) run of every compared model. Datasets redrawn per seed
  (prepared metadata `replicate_of: <base>`) are replicates of their base dataset; a dataset
  without it is its own base, its replicates its seeds.
- **Families**: generative = the run's models whose method is registered generative;
  reference = `evaluate.evidence_reference` (those in the run, none generative). A replicate's
  family value is the mean over the family's models; its gap, generative minus reference.
- **Estimate**: the mean of the replicates' gaps. **Interval**: percentile bootstrap. One
  resample draws R replicates with replacement (level 1), and resamples the test examples
  within each group of each split (level 2, `metrics.bootstrap_indices`): one resample per
  dataset's test split, shared by every model and every drawn replicate that was scored on it
  (models and seeds on the same examples stay paired; a test split shared by several seeds
  contributes its sampling noise once, as it does to the estimate).
- **Verdict**: `generative better` / `discriminative better` only with ≥ 2 replicates and a
  worst-group interval that excludes 0; else `not distinguishable`, with the seeds a power
  estimate asks for.

Nothing here formats a page beyond the verdict's words (`Evidence.verdict_text`, `fmt_gap`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.core.io import fixed_precision
from stages.core.settings import EvaluateConfig
from stages.evaluation.comparison import (
    RunData,
    model_config,
    model_type,
    ordered,
    run_convergence,
    smallest_groups,
)
from stages.evaluation.metrics import bootstrap_indices, group_accuracies, percentile_interval
from stages.evaluation.regime import expected_use

# Bootstrap streams of the evidence: [bootstrap_seed, EVIDENCE_STREAM, base dataset index, ...],
# apart from evaluate's and the report's per-model streams (comparison.REPORT_STREAM = 100..).
EVIDENCE_STREAM = 300
LEVEL = 0.95
# The power estimate: two-sided test at ALPHA, power POWER.
ALPHA = 0.05
POWER = 0.80
UNDER_TRAINED = "may be under-trained"
VERDICTS = ("generative better", "discriminative better", "not distinguishable")
# An `overfitting` value (bool, flag string, or {"flag": ...}) that does not flag the run.
NOT_FLAGGED = frozenset({"", "n/a", "no", "none", "false", "plateaued", "not over-fitting", "not overfitting"})


@dataclass
class SplitGroups:
    """One dataset's test splits: the groups of test_id and test_ood, in file order."""

    g_id: np.ndarray
    g_ood: np.ndarray


@dataclass
class Replicate:
    """One (dataset, seed): every compared model's correctness on its dataset's test splits."""

    test: int  # index of its SplitGroups
    id_correct: np.ndarray  # (M, n_id) bool, models in the order of the family weights
    ood_correct: np.ndarray  # (M, n_ood)


def replicate_values(r: Replicate, t: SplitGroups, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per model: (test_ood worst-group accuracy, ID→OOD accuracy drop) on the examples as they are."""
    wga = np.array([group_accuracies(c, t.g_ood, n_groups)[1][np.bincount(t.g_ood, minlength=n_groups) > 0].min()
                    for c in r.ood_correct])
    drop = r.id_correct.mean(axis=1) - r.ood_correct.mean(axis=1)
    return wga, drop


def family_weights(n_generative: int, n_reference: int) -> np.ndarray:
    """Weights w with Σ_m w_m·v_m = mean over the generative models − mean over the reference."""
    return np.concatenate([np.full(n_generative, 1.0 / n_generative), np.full(n_reference, -1.0 / n_reference)])


def replicate_gaps(
    tests: Sequence[SplitGroups], replicates: Sequence[Replicate], weights: np.ndarray, n_groups: int
) -> np.ndarray:
    """(R, 2): each replicate's gap in worst-group accuracy and in the drop (columns)."""
    out = []
    for r in replicates:
        wga, drop = replicate_values(r, tests[r.test], n_groups)
        out.append([float(weights @ wga), float(weights @ drop)])
    return np.asarray(out, dtype=np.float64).reshape(len(replicates), 2)


def two_level_draws(
    tests: Sequence[SplitGroups],
    replicates: Sequence[Replicate],
    weights: np.ndarray,
    resamples: int,
    seed: Sequence[int],
) -> np.ndarray:
    """(resamples, 2): the two-level bootstrap's draws of the mean gap (worst-group, drop).

    Resample b: test set t's examples are resampled within each group, test_id with stream
    `[*seed, 1 + t, 0]` and test_ood with `[*seed, 1 + t, 1]` (`bootstrap_indices`), and every
    replicate's gap is recomputed on them; then R replicates are drawn with replacement
    (`numpy.random.default_rng([*seed, 0]).integers(0, R, (resamples, R))`, row b) and their
    recomputed gaps averaged. A replicate drawn twice counts its gap of resample b twice.
    """
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    R = len(replicates)
    if R == 0:
        raise ValueError("no replicate to resample")
    gaps = np.empty((R, resamples, 2))
    for t, test in enumerate(tests):
        mine = [i for i, r in enumerate(replicates) if r.test == t]
        if not mine:
            continue
        # Stratified resamples keep every position's group, so with the positions ordered by group
        # each group's hits are one contiguous sum (integers: exact, and cheaper than float bincounts).
        order = np.argsort(test.g_ood, kind="stable")
        sizes = np.bincount(test.g_ood)
        sizes = sizes[sizes > 0]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        n_id, n_ood = len(test.g_id), len(test.g_ood)
        done = 0
        chunks = zip(bootstrap_indices(test.g_id, resamples, [*seed, 1 + t, 0]),
                     bootstrap_indices(test.g_ood, resamples, [*seed, 1 + t, 1]), strict=True)
        for idx_id, idx_ood in chunks:
            b = len(idx_id)
            by_group = idx_ood[:, order]
            for i in mine:
                r = replicates[i]
                hits = np.add.reduceat(r.ood_correct[:, by_group], starts, axis=2, dtype=np.int64)  # (M, b, groups)
                wga = (hits / sizes).min(axis=2)
                drop = np.count_nonzero(r.id_correct[:, idx_id], axis=2) / n_id - hits.sum(axis=2) / n_ood
                gaps[i, done : done + b, 0] = weights @ wga
                gaps[i, done : done + b, 1] = weights @ drop
            done += b
    draw = np.random.default_rng([*seed, 0]).integers(0, R, size=(resamples, R))
    return gaps[draw, np.arange(resamples)[:, None], :].mean(axis=1)


def decide(low: float | None, high: float | None, replicates: int) -> str:
    """The verdict on the worst-group gap: a winner only with ≥ 2 replicates and an interval
    that excludes 0 (better = higher OOD worst-group accuracy)."""
    if replicates < 2 or low is None or high is None:
        return "not distinguishable"
    if low > 0:
        return "generative better"
    if high < 0:
        return "discriminative better"
    return "not distinguishable"


def seeds_needed(gap: float, sd: float | None, power: float = POWER, alpha: float = ALPHA) -> int | None:
    """Replicates for a two-sided test at `alpha` to detect `gap` with probability `power`, when
    replicates scatter with sd `sd`: n = ⌈((z_{1−α/2} + z_power) · sd / |gap|)²⌉, at least 2
    (normal approximation to the one-sample t test of the mean gap; a t test needs one or two
    more at small n). None without an sd (fewer than 2 replicates) or a gap of 0."""
    if sd is None or gap == 0:
        return None
    normal = statistics.NormalDist()
    z = normal.inv_cdf(1.0 - alpha / 2.0) + normal.inv_cdf(power)
    ratio = z * sd / abs(gap)
    return max(2, math.ceil(ratio * ratio))


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
    """`models` (in order) with a run whose convergence record `test` flags, as 'name (k/S seeds)'
    when only some of its S runs are."""
    out = []
    for model in models:
        mine = [run_convergence(r) for r in runs if r["model"] == model]
        hits = sum(1 for c in mine if test(c))
        if hits:
            out.append(model if hits == len(mine) else f"{model} ({hits}/{len(mine)} seeds)")
    return out


@dataclass
class Evidence:
    """One base dataset's comparison over replicates (summary.json `_evidence[<base>]`)."""

    base: str
    datasets: list[str]
    replicates: list[tuple[str, int]]
    generative: list[str]
    reference: list[str]
    absent_reference: list[str]
    gap_worst_group: dict[str, float | None]
    gap_drop: dict[str, float | None]
    between_sd: float | None
    seeds_needed: int | None
    verdict: str
    prediction: str | None
    under_trained: list[str]
    overfitting: list[str]
    smallest_group: dict[str, int] = field(default_factory=dict)
    note: str = ""

    @property
    def agreement(self) -> str | None:
        """'as predicted' / 'contrary to the prediction' for a verdict with a winner, else None."""
        if self.verdict == "not distinguishable" or self.prediction is None or self.prediction.startswith("mixed"):
            return None
        expected = {"generative uses the shortcut less": "generative better",
                    "generative uses the shortcut more": "discriminative better"}.get(self.prediction)
        return "as predicted" if expected == self.verdict else "contrary to the prediction"

    def summary(self) -> dict[str, Any]:
        """The summary.json object: the contract's keys, plus seeds_needed, over-fitting and the note."""
        return {
            "seeds": len(self.replicates),
            "gap_worst_group": self.gap_worst_group,
            "gap_drop": self.gap_drop,
            "verdict": self.verdict,
            "prediction": self.prediction,
            "under_trained": [n.split(" (")[0] for n in self.under_trained],
            "overfitting": [n.split(" (")[0] for n in self.overfitting],
            "seeds_needed": self.seeds_needed,
            "note": self.note,
        }

    def verdict_text(self) -> str:
        """The verdict in words: the winner only where the interval excludes 0, with the
        regime's prediction, and the flagged models by name."""
        text = f"**{self.verdict}**"
        if self.agreement:
            text += f" ({self.agreement})"
        if self.under_trained:
            text += f"; under-trained in a compared family: {', '.join(self.under_trained)}"
        if self.overfitting:
            text += f"; over-fitting flagged: {', '.join(self.overfitting)}"
        return text


def fmt_gap(gap: dict[str, float | None]) -> str:
    """'+0.123 [−0.050, +0.300]' (no interval: the estimate and 'no interval')."""
    est, lo, hi = gap.get("estimate"), gap.get("low"), gap.get("high")
    if est is None:
        return "n/a"
    return f"{est:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None and hi is not None else " (no interval)")


def _prediction(separations: Sequence[dict[str, Any] | None]) -> str | None:
    """The regime's prediction (`regime.expected_use`), one for the base dataset; 'mixed …' when
    its replicates' prepared files predict different directions."""
    uses = ordered([expected_use(s) or "no call" for s in separations])
    if uses == ["no call"]:
        return None
    if len(uses) > 1:
        return f"mixed across replicates ({', '.join(uses)})"
    return f"generative uses the shortcut {uses[0]}"


def _power_note(e: Evidence, interval: bool) -> str:
    """Why the verdict is `not distinguishable` and what would settle it."""
    n = len(e.replicates)
    if n < 2:
        return (f"{n} replicate: the interval holds the test examples' sampling noise only, not the variance between "
                "seeds (and data draws), so it cannot carry a verdict; a power estimate needs the between-replicate sd "
                "too: run ≥ 2 seeds (`run.seeds`; 5 or more to estimate that sd usefully).")
    if not interval:
        return ""
    if e.seeds_needed is None:
        return "The replicates' mean gap is 0: no number of seeds would detect it."
    power = (f"Power estimate: ⌈((z₀.₉₇₅ + z₀.₈₀) · sd / |gap|)²⌉ with the observed gap {e.gap_worst_group['estimate']:+.3f} "
             f"and the between-replicate sd {e.between_sd:.3f} asks for {e.seeds_needed} seeds (80% power, two-sided 5%)")
    if e.seeds_needed <= n:
        return (power + f", no more than these {n}: the test examples' noise, not the seeds, keeps the interval "
                "around 0; larger test groups would narrow it, more seeds alone will not.")
    return power + "."


def evidence_for(
    base: str,
    datasets: Sequence[str],
    runs: Sequence[dict[str, Any]],
    data: dict[tuple[str, str, int], RunData] | None,
    boot: EvaluateConfig,
    separations: Sequence[dict[str, Any] | None],
    seed: Sequence[int],
) -> Evidence:
    """The evidence of one base dataset from the runs (metrics dicts) of its `datasets`."""
    models = ordered([m["model"] for m in runs])
    info = {m: model_config([r for r in runs if r["model"] == m]) for m in models}
    generative = [m for m in models if model_type(info[m]) == "generative"]
    reference = [m for m in boot.evidence_reference if m in models and m not in generative]
    absent = [m for m in boot.evidence_reference if m not in models]
    compared = generative + reference
    replicates = ordered([(str(m["dataset"]), int(m["seed"])) for m in runs])  # type: ignore[arg-type]
    by_key = {(m["dataset"], m["model"], int(m["seed"])): m for m in runs}
    complete = [(d, s) for d, s in replicates if all((d, m, s) in by_key for m in compared)]
    first = runs[0]
    n_groups = int(first["n_classes"]) * int(first["n_attrs"])
    mine = [r for r in runs if r["model"] in compared]
    e = Evidence(
        base=base, datasets=list(datasets), replicates=complete, generative=generative, reference=reference,
        absent_reference=absent, gap_worst_group={"estimate": None, "low": None, "high": None},
        gap_drop={"estimate": None, "low": None, "high": None}, between_sd=None, seeds_needed=None,
        verdict="not distinguishable", prediction=_prediction(separations),
        under_trained=flagged(mine, compared, lambda c: c.get("flag") == UNDER_TRAINED),
        overfitting=flagged(mine, compared, lambda c: overfitting_flag(c) is not None),
        smallest_group=smallest_groups(list(runs)),
    )
    if not generative or not reference:
        missing = "generative model" if not generative else "model of the reference family `evaluate.evidence_reference`"
        e.note = f"This run has no {missing}."
        return e
    weights = family_weights(len(generative), len(reference))
    interval = False
    if data is not None:
        tests, reps = replicate_arrays(complete, compared, data)
        per_rep = replicate_gaps(tests, reps, weights, n_groups)
        if boot.bootstrap_resamples > 0 and complete:
            draws = two_level_draws(tests, reps, weights, boot.bootstrap_resamples, seed)
            interval = True
    else:  # no predictions (build_report without data): the estimate from the metrics files, no interval
        per_rep = np.array([[float(weights @ [by_key[(d, m, s)]["splits"]["test_ood"]["worst_group_acc"] for m in compared]),
                             float(weights @ [by_key[(d, m, s)]["splits"]["test_id"]["acc"]
                                              - by_key[(d, m, s)]["splits"]["test_ood"]["acc"] for m in compared])]
                            for d, s in complete]).reshape(len(complete), 2)
    per_rep = fixed_precision(per_rep.tolist())  # what follows is decided on the numbers the report writes
    for k, gap in enumerate((e.gap_worst_group, e.gap_drop)):
        if per_rep:
            gap["estimate"] = fixed_precision(statistics.fmean(r[k] for r in per_rep))
        if interval:
            gap["low"], gap["high"] = fixed_precision(percentile_interval(draws[:, k], LEVEL))
    if len(per_rep) >= 2:
        e.between_sd = fixed_precision(statistics.stdev(r[0] for r in per_rep))
    e.verdict = decide(e.gap_worst_group["low"], e.gap_worst_group["high"], len(complete))
    if e.verdict == "not distinguishable":  # what would settle it
        e.seeds_needed = seeds_needed(float(e.gap_worst_group["estimate"] or 0.0), e.between_sd)
    notes = []
    if e.verdict == "not distinguishable":
        if not interval:
            notes.append("No interval (no predictions, or `evaluate.bootstrap_resamples` is 0): no verdict.")
        notes.append(_power_note(e, interval))
    if len(complete) < len(replicates):
        notes.append(f"{len(replicates) - len(complete)} (dataset, seed) runs lack a compared model and are left out.")
    e.note = " ".join(n for n in notes if n)
    return e


def replicate_arrays(
    replicates: Sequence[tuple[str, int]], compared: Sequence[str], data: dict[tuple[str, str, int], RunData]
) -> tuple[list[SplitGroups], list[Replicate]]:
    """The test sets (one per dataset) and every replicate's correctness stacks."""
    tests: list[SplitGroups] = []
    index: dict[str, int] = {}
    reps = []
    for d, s in replicates:
        runs = [data[(d, m, s)] for m in compared]
        split = runs[0].split
        id_rows, ood_rows = split == "test_id", split == "test_ood"
        if d not in index:
            index[d] = len(tests)
            tests.append(SplitGroups(runs[0].g[id_rows], runs[0].g[ood_rows]))
        reps.append(Replicate(index[d], np.stack([r.correct[id_rows] for r in runs]),
                              np.stack([r.correct[ood_rows] for r in runs])))
    return tests, reps


def gather(
    metrics: Sequence[dict[str, Any]],
    data: dict[tuple[str, str, int], RunData] | None,
    boot: EvaluateConfig,
    separations: dict[str, dict[str, Any] | None],
    bases: dict[str, str] | None = None,
) -> dict[str, Evidence]:
    """Per base dataset (`bases[dataset]`, default the dataset itself), in run order, its evidence."""
    datasets = ordered([str(m["dataset"]) for m in metrics])
    base_of = {d: (bases or {}).get(d, d) for d in datasets}
    out = {}
    for i, base in enumerate(ordered([base_of[d] for d in datasets])):
        mine = [d for d in datasets if base_of[d] == base]
        out[base] = evidence_for(
            base, mine, [m for m in metrics if m["dataset"] in mine], data, boot,
            [separations.get(d) for d in mine], [boot.bootstrap_seed, EVIDENCE_STREAM, i],
        )
    return out
