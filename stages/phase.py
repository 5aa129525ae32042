"""The phase diagram: where does a generative classifier beat a discriminative one under shift?

    python -m stages.phase [phase.seeds=[0,1]]

`phase.base` is a generated dataset's config (its `kind` names the dataset module, and its
schema validates it, as for `dataset.<name>`). For every cell of every panel in the `phase`
section (two of its knobs, PHASE_KNOBS, on the axes, the others at `phase.base`), and every
seed, it generates the dataset (data seed = the seed), fits on the train split, as toy
analyses of this question do,

- **generative**: the closed-form method `phase.generative` (a method config; by default LDA,
  class-conditional Gaussians with a shared covariance shrunk towards its diagonal — a target
  that does not move as dimensions are added), through its registered `fit`, and
- **discriminative**: binary logistic regression on the raw features, fitted *to convergence*:
  it minimises mean cross-entropy + λ/2 ‖w‖² (λ = `phase.lr_l2`, the bias unpenalised;
  scikit-learn's `C` = 1 / (λ n_train)) by damped Newton steps in float64 until the gradient's
  largest entry is below `phase.lr_tol` (`fit_logistic`). A tiny λ is "near-unregularised":
  when d_noise ≫ n_train the train split is linearly separable, the unregularised optimum is
  at infinity, and the fit approaches the max-margin direction as λ → 0; λ > 0 keeps the
  optimum finite so the solve converges (in ~10–20 steps). The solve runs in the dual
  (w = Xᵀα, an (n+1)-square system) when d ≥ n, so d ≫ n costs no more than n. Every
  λ in `phase.l2_lines` fits one more, regularised, logistic regression beside it.

Both are scored on `test_ood` (agreement `base.rho_ood`; 0 = fully reversed). Each seed
redraws the cell's data (train and test) and refits both, so the per-seed differences are
independent replicates. A cell reports each classifier's worst-group OOD accuracy averaged over
seeds, their difference `diff = generative − discriminative` (positive: the generative
classifier is more robust) with its 95 % Student t interval over the seeds (`diff_low`,
`diff_high`; stages/evaluation/phase_cells.py `seed_interval`) and sample sd, and the
`winner`: "generative" / "discriminative" only where the interval excludes 0, else "tie";
the Newton steps the slowest seed took (`discriminative_iterations`) and logistic
regression's train accuracy (1.0: separable); `l2_lines` (λ, worst-group and plain OOD
accuracy of each regularised fit); `d_over_n` (features per train example); the dataset's
`separation` dict (stages/evaluation/regime.py) and the regime it calls (`predicted`:
`regime.expected_use`, "more" | "less" | None). Where the dataset module has the closed-form
population (`population_groups`: the Gaussian toy data), `population_wga` and
`population_lr_wga`: the worst-group OOD accuracy of the rules LDA and logistic regression
converge to with infinitely many train examples (no shrinkage, no penalty), computed exactly
(stages/evaluation/population.py; each group is Gaussian, so a linear rule's accuracy on it is
Φ(margin / sd)). They depend on neither n_train nor the seed, and since the noise dimensions
carry no signal, not on d_noise either: the lines the sample fits approach as n_train grows
(with a diagonal population covariance, as with one cue dimension, shrinking towards the
diagonal leaves LDA's limit unchanged). Writes data/phase/phase.json: one record per cell (an
empty list when `phase.panels` is empty, the default; experiment=toy_phase_diagram fills it in).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from omegaconf import DictConfig

from stages.core import registry
from stages.core.cli import stage_main
from stages.core.config import dataset_section, method_section, section, section_help
from stages.core.io import check_writable, write_json
from stages.core.schema import ConfigError
from stages.core.settings import PHASE_KNOBS, PhaseConfig
from stages.evaluation.phase_cells import PHASE_PATH, phase_wins, seed_interval, winner

MAX_NEWTON_STEPS = 100  # a strongly convex solve converges in far fewer; more means a bug


def knob_types(base: Any) -> dict[str, type]:
    """The type of each of PHASE_KNOBS in `base`'s schema; ConfigError naming the knobs the
    schema of `phase.base.kind` lacks."""
    hints = typing.get_type_hints(type(base))
    missing = [k for k in PHASE_KNOBS if k not in hints]
    if missing:
        raise ConfigError(
            f"params.yaml: phase.base.kind: dataset kind '{base.kind}' has no key(s) {missing} "
            f"(the phase diagram sweeps {list(PHASE_KNOBS)}); use a generated dataset that has them"
        )
    return {k: hints[k] for k in PHASE_KNOBS}


def cell_config(base: Any, knobs: dict[str, float], seed: int) -> Any:
    """`base` with the cell's knob values (integers where the schema says the knob is an int)
    and data seed."""
    types = knob_types(base)
    values = {k: int(round(v)) if types[k] is int else float(v) for k, v in knobs.items()}
    return dataclasses.replace(base, seed=int(seed), **values)


# ---- the discriminative fit -------------------------------------------------------------------


class LogisticFit(NamedTuple):
    """A binary logistic regression p(y=1 | x) = σ(x·weight + bias), and how its solve ended."""

    weight: np.ndarray  # (d,) float64
    bias: float
    iterations: int  # Newton steps taken
    grad_max: float  # largest |entry| of the objective's gradient at the returned point

    def scores(self, x: np.ndarray) -> np.ndarray:
        """x·w + b (float64, (n,)); > 0 predicts class 1."""
        return np.asarray(x, dtype=np.float64) @ self.weight + self.bias

    def logits(self, x: np.ndarray) -> np.ndarray:
        """(−s/2, +s/2) per example: their softmax is the fitted p(y | x)."""
        s = self.scores(x)
        return np.stack([-s / 2, s / 2], 1)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, tol: float, max_steps: int = MAX_NEWTON_STEPS) -> LogisticFit:
    """Binary logistic regression minimising mean_i CE(x_i·w + b, y_i) + l2/2 ‖w‖² (bias not
    penalised; scikit-learn's LogisticRegression with C = 1 / (l2 · n)), by Newton's method
    with Armijo backtracking, in float64, until max |gradient| < `tol`.

    With n examples in d dimensions it works in the primal (w, b) when d < n, else in the dual
    w = Xᵀα (the optimum lies in the span of the examples since only w is penalised): the
    Newton step of (α, b) solves an (n+1)-square system and equals the primal Newton step, so
    both routes take the same path. `y` must be 0/1 with both present and `l2` > 0; ValueError
    when the solve has not converged after `max_steps` steps.
    """
    import torch
    import torch.nn.functional as F

    if not l2 > 0:
        raise ValueError(f"l2 must be > 0 (the separable optimum is at infinity), got {l2}")
    xt = torch.as_tensor(np.asarray(x, dtype=np.float64))
    yt = torch.as_tensor(np.asarray(y, dtype=np.float64))
    if set(np.unique(y).tolist()) != {0, 1}:
        raise ValueError(f"logistic regression needs labels 0 and 1 both present, got {np.unique(y).tolist()}")
    n, d = xt.shape
    dual = d >= n
    gram = xt @ xt.T if dual else None
    design = None if dual else torch.cat([xt, torch.ones(n, 1, dtype=torch.float64)], 1)
    penalty = torch.full((d + 1,), l2, dtype=torch.float64)
    penalty[d] = 0.0  # the bias (primal route)

    # theta: (α, b) in the dual, (w, b) in the primal, one vector; its last entry is b
    def objective(theta: torch.Tensor) -> tuple[float, torch.Tensor]:
        if dual:
            alpha = theta[:n]
            s = gram @ alpha + theta[n]
            reg = 0.5 * l2 * float(alpha @ (gram @ alpha))
        else:
            s = design @ theta
            reg = 0.5 * float((penalty * theta * theta).sum())
        return float(F.binary_cross_entropy_with_logits(s, yt)) + reg, s

    theta = torch.zeros((n if dual else d) + 1, dtype=torch.float64)
    value, s = objective(theta)
    for step_count in range(max_steps + 1):
        p = torch.sigmoid(s)
        r, curv = (p - yt) / n, p * (1 - p) / n
        if dual:
            g_alpha = r + l2 * theta[:n]  # ∇_w = Xᵀ g_alpha
            grad = torch.cat([xt.T @ g_alpha, r.sum()[None]])  # the primal gradient (w, b)
        else:
            grad = design.T @ r + penalty * theta
        grad_max = float(grad.abs().max())
        if grad_max < tol:
            break
        if step_count == max_steps:
            raise ValueError(f"logistic regression did not converge in {max_steps} Newton steps (max |gradient| {grad_max:.2e})")
        if dual:
            system = torch.empty(n + 1, n + 1, dtype=torch.float64)
            system[:n, :n] = curv[:, None] * gram + l2 * torch.eye(n, dtype=torch.float64)
            system[:n, n] = curv
            system[n, :n] = curv @ gram
            system[n, n] = curv.sum()
            step = torch.linalg.solve(system, torch.cat([g_alpha, r.sum()[None]]))
            decrease = float(grad[:d] @ (xt.T @ step[:n]) + grad[d] * step[n])  # ∇·(primal step)
        else:
            hessian = (design * curv[:, None]).T @ design + torch.diag(penalty)
            step = torch.linalg.solve(hessian, grad)
            decrease = float(grad @ step)
        t = 1.0
        # Near the optimum the decrease a Newton step promises falls below the objective's
        # rounding (~1e-16 of it): no line search can see it, so the full step is taken (Newton
        # converges quadratically there); otherwise Armijo backtracking.
        while decrease >= 1e-14 * max(1.0, abs(value)):
            new_value, new_s = objective(theta - t * step)
            if new_value <= value - 1e-4 * t * decrease or t < 1e-12:
                break
            t *= 0.5
        else:
            new_value, new_s = objective(theta - step)
        theta, value, s = theta - t * step, new_value, new_s
    weight = (xt.T @ theta[:n]) if dual else theta[:d]
    return LogisticFit(weight.numpy().copy(), float(theta[-1]), step_count, grad_max)


# ---- the population answer --------------------------------------------------------------------


def population_worst_groups(cfg: Any) -> tuple[float, float] | None:
    """(population LDA's, population logistic regression's) worst-group test_ood accuracy on
    `cfg`'s dataset, exactly: the rules each converges to with unlimited train data and no
    penalty (stages/evaluation/population.py), scored on the test_ood groups of probability > 0.

    The dataset module's `population_groups(cfg, rho)` gives each group as N(m, C) with its
    probability; the train mixture is at `cfg.rho_train`. None when the module has no closed-form
    population, the groups do not share one covariance, or the task is not binary."""
    from stages.evaluation.population import mahalanobis_d2, population_rules

    module = importlib.import_module(registry.dataset(cfg.kind).module)
    groups_of = getattr(module, "population_groups", None)
    if groups_of is None:
        return None
    train = groups_of(cfg, cfg.rho_train)
    if any(not np.array_equal(g.cov, train[0].cov) for g in train) or {g.y for g in train} != {0, 1}:
        return None
    keep = [g.prob > 0 for g in train]  # a group absent from train is no part of the mixture
    train = [g for g, k in zip(train, keep, strict=True) if k]
    d2 = mahalanobis_d2(np.stack([g.mean for g in train]), train[0].cov)
    rules = population_rules(d2, np.array([g.y for g in train]), np.array([g.prob for g in train]))
    test = {(g.y, g.a): g.prob > 0 for g in groups_of(cfg, cfg.rho_ood)}
    present = np.array([test.get((g.y, g.a), False) for g in train])
    if not present.any():
        return None
    return rules.worst_group(present)


def population_worst_group(cfg: Any) -> float | None:
    """Worst-group test_ood accuracy of the population LDA rule of `cfg`'s dataset (None as above)."""
    both = population_worst_groups(cfg)
    return None if both is None else both[0]


# ---- one cell ---------------------------------------------------------------------------------


def _worst_group(logits: np.ndarray, y: np.ndarray, g: np.ndarray, n_groups: int) -> tuple[float, float]:
    from stages.evaluation.metrics import group_accuracies, predictions

    correct = predictions(logits) == y
    n, acc = group_accuracies(correct, g, n_groups)
    return float(acc[n > 0].min()), float(correct.mean())


def compare_cell(cfg: Any, pcfg: PhaseConfig, gcfg: Any, seed: int) -> dict[str, Any]:
    """Worst-group and plain test_ood accuracy of the generative classifier and the logistic
    regressions on one dataset generated from `cfg` by its kind's generator."""
    from stages.core.runtime import setup_torch

    generate = registry.dataset(cfg.kind).generate
    if generate is None:
        raise ConfigError(f"params.yaml: phase.base.kind: dataset kind '{cfg.kind}' is not generated")
    columns, meta = generate(cfg)
    n_classes, n_attrs = int(meta["n_classes"]), int(meta["n_attrs"])
    if n_classes != 2:
        raise ConfigError(f"params.yaml: phase.base.kind: the phase's logistic regression is binary; '{cfg.kind}' has {n_classes} classes")
    split = columns["split"]
    y, a, x = columns["y"], columns["a"], columns["x"]
    g = y * n_attrs + a
    ood, train = split == "test_ood", split == "train"
    n_groups = n_classes * n_attrs

    setup_torch(seed)  # one thread, deterministic: the same bytes on any machine
    gen = registry.method(gcfg.kind).fit(x[train], y[train], n_classes, gcfg)  # type: ignore[misc]
    gen_wga, gen_acc = _worst_group(gen.logits(x[ood]), y[ood], g[ood], n_groups)

    def logistic(l2: float) -> LogisticFit:
        try:
            return fit_logistic(x[train], y[train], l2, pcfg.lr_tol)
        except ValueError as e:
            raise ConfigError(f"params.yaml: phase: logistic regression (λ {l2:g}, cell {cfg}): {e}") from None

    lr = logistic(pcfg.lr_l2)
    disc_wga, disc_acc = _worst_group(lr.logits(x[ood]), y[ood], g[ood], n_groups)
    lines = []
    for l2 in pcfg.l2_lines:
        wga, acc = _worst_group(logistic(l2).logits(x[ood]), y[ood], g[ood], n_groups)
        lines.append({"l2": float(l2), "wga": wga, "ood_acc": acc})
    return {
        "generative_wga": gen_wga,
        "discriminative_wga": disc_wga,
        "generative_ood_acc": gen_acc,
        "discriminative_ood_acc": disc_acc,
        "discriminative_train_acc": float(((lr.scores(x[train]) > 0) == (y[train] == 1)).mean()),
        "discriminative_iterations": lr.iterations,
        "l2_lines": lines,
        "separation": meta.get("separation"),
        "shape": list(meta["shape"]),
    }


def phase_diagram(pcfg: PhaseConfig, base: Any, gcfg: Any) -> list[dict[str, Any]]:
    """One record per panel cell: knob values, seed-mean accuracies, diff = generative −
    discriminative worst-group OOD accuracy with its 95 % interval over the seeds, the winner
    (a tie where the interval holds 0), the population rules' answers and the dataset's regime.

    `base` is the validated dataset config of `phase.base` (see `base_config`).
    """
    from stages.core.runtime import progress
    from stages.evaluation.regime import expected_use

    knob_types(base)

    cells = [
        (i, p, xv, yv) for i, p in enumerate(pcfg.panels) for yv in p.y_values for xv in p.x_values
    ]
    rows = []
    for i, panel, xv, yv in progress(cells, desc="phase", total=len(cells), unit="cell"):
        configs = {s: cell_config(base, {panel.x: xv, panel.y: yv}, s) for s in pcfg.seeds}
        per_seed = [compare_cell(c, pcfg, gcfg, s) for s, c in configs.items()]
        mean = {
            k: float(np.mean([r[k] for r in per_seed]))
            for k in ("generative_wga", "discriminative_wga", "generative_ood_acc", "discriminative_ood_acc", "discriminative_train_acc")
        }
        diffs = [r["generative_wga"] - r["discriminative_wga"] for r in per_seed]
        diff, low, high = seed_interval(diffs)
        first = next(iter(configs.values()))
        population = population_worst_groups(first)
        sep = per_seed[0]["separation"]
        rows.append(
            {
                "panel": i,
                "panel_name": f"{i}: {panel.x} x {panel.y}",
                "x_knob": panel.x,
                "x": float(xv),
                "y_knob": panel.y,
                "y": float(yv),
                **mean,
                "discriminative_iterations": max(r["discriminative_iterations"] for r in per_seed),
                "l2_lines": [
                    {
                        "l2": float(l2),
                        "wga": float(np.mean([r["l2_lines"][j]["wga"] for r in per_seed])),
                        "ood_acc": float(np.mean([r["l2_lines"][j]["ood_acc"] for r in per_seed])),
                    }
                    for j, l2 in enumerate(pcfg.l2_lines)
                ],
                "population_wga": None if population is None else population[0],
                "population_lr_wga": None if population is None else population[1],
                "separation": sep,
                "predicted": expected_use(sep),
                "d_over_n": int(np.prod(per_seed[0]["shape"])) / first.n_train,
                "diff": diff,
                "diff_low": low,
                "diff_high": high,
                "diff_sd": float(np.std(diffs, ddof=1)) if len(diffs) > 1 else None,
                "seeds": len(per_seed),
                "winner": winner(low, high),
            }
        )
    return rows


def base_config(params: DictConfig) -> Any:
    """`phase.base` validated by the schema its `kind` registered, with PHASE_KNOBS checked
    against that schema's keys."""
    base = dataset_section(params, "phase.base")
    knob_types(base)
    return base


def run(params: DictConfig) -> str:
    pcfg = section(params, "phase", PhaseConfig)
    check_writable(PHASE_PATH)  # before any work, not after it
    rows = phase_diagram(pcfg, base_config(params), generative_config(params))
    write_json(rows, PHASE_PATH, derived=True)
    wins = phase_wins(rows)
    steps = max((r["discriminative_iterations"] for r in rows), default=0)
    return (
        f"{len(rows)} cells in {len(pcfg.panels)} panels, {len(pcfg.seeds)} seeds each: the generative classifier wins "
        f"{wins.generative}, logistic regression {wins.discriminative}, ties (95 % interval holds 0) {wins.tie} "
        f"(at most {steps} Newton steps) -> {PHASE_PATH}"
    )


def generative_config(params: DictConfig) -> Any:
    """`phase.generative` validated by its kind's schema; its kind must have a closed-form `fit`."""
    gcfg = method_section(params, "phase.generative")
    if registry.method(gcfg.kind).fit is None:
        closed = [k for k, spec in registry.methods().items() if spec.fit is not None]
        raise ConfigError(f"params.yaml: phase.generative.kind: '{gcfg.kind}' has no closed-form fit (one of {closed})")
    return gcfg


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("phase", __doc__, [], section_help("phase", PhaseConfig), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
