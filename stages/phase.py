"""The phase diagram: where does a generative classifier beat a discriminative one under shift?

    python -m stages.phase [phase.seeds=[0,1]]

For every cell of every panel in the `phase` section (two `gaussian_shortcut` knobs on the
axes, the others at `phase.base`), and every seed, it generates the dataset (data seed =
the seed), fits

- **lda**: class-conditional Gaussians with a shared covariance (`stages.models.lda.fit_lda`,
  closed form, shrinkage `phase.shrinkage`), and
- **erm**: logistic regression — an `MLPClassifier` with no hidden layer trained with the
  shared loop (`stages.models.training.fit_classifier`, cross-entropy, checkpoint selected
  by `phase.selection`),

and scores both on `test_ood` (agreement `base.rho_ood`; 0 = fully reversed). A cell reports
each classifier's worst-group OOD accuracy averaged over seeds, their difference
`diff = lda − erm` (positive: the generative classifier is more robust), its sample sd
over seeds and the winner. Writes data/phase/phase.json: one record per cell (an empty
list when `phase.panels` is empty, the default; experiment=toy_phase_diagram fills it in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig

from stages.artifacts import DATA
from stages.config import GaussianShortcutConfig, PhaseConfig, describe, section, stage_main
from stages.io import write_json

PHASE_PATH = DATA / "phase" / "phase.json"
INT_KNOBS = frozenset({"d_noise", "n_train"})


def cell_config(base: GaussianShortcutConfig, knobs: dict[str, float], seed: int) -> GaussianShortcutConfig:
    """`base` with the cell's knob values (integers where the knob is a count) and data seed."""
    values = {k: int(round(v)) if k in INT_KNOBS else float(v) for k, v in knobs.items()}
    return dataclasses.replace(base, seed=int(seed), **values)


def _worst_group(logits: np.ndarray, y: np.ndarray, g: np.ndarray) -> tuple[float, float]:
    from stages.metrics import group_accuracies, predictions

    correct = predictions(logits) == y
    n, acc = group_accuracies(correct, g, 4)
    return float(acc[n > 0].min()), float(correct.mean())


def compare_cell(cfg: GaussianShortcutConfig, pcfg: PhaseConfig, seed: int) -> dict[str, float]:
    """Worst-group and plain test_ood accuracy of lda and erm (logistic regression) on one dataset."""
    import torch

    from stages.datasets.gaussian_shortcut import generate
    from stages.models.lda import fit_lda
    from stages.models.nets import MLPClassifier, MLPEncoder, Standardize
    from stages.models.training import FitOptions, SplitData, cross_entropy, fit_classifier
    from stages.runtime import setup_torch

    columns, _ = generate(cfg)
    split = columns["split"]
    y, a, x = columns["y"], columns["a"], columns["x"]
    g = y * 2 + a

    def part(name: str) -> SplitData:
        m = split == name
        return SplitData(torch.from_numpy(np.ascontiguousarray(x[m])), torch.from_numpy(y[m]), torch.from_numpy(g[m]))

    ood = split == "test_ood"
    train = split == "train"
    lda = fit_lda(x[train], y[train], 2, pcfg.shrinkage)
    lda_wga, lda_acc = _worst_group(lda.logits(x[ood]), y[ood], g[ood])

    generator = setup_torch(seed)
    model = MLPClassifier(MLPEncoder(x.shape[1], []), 2, Standardize(x.shape[1]).fit(torch.from_numpy(x[train])))
    needed = {"train", "val"} | ({"test_ood"} if pcfg.selection == "oracle" else set())
    opts = FitOptions(pcfg.lr, pcfg.epochs, pcfg.batch_size, pcfg.selection, pcfg.weight_decay)
    result = fit_classifier(model, {s: part(s) for s in ("train", "val", "test_ood") if s in needed}, cross_entropy, opts, generator, desc="phase erm")
    model.load_state_dict(result.state_dict)
    erm_wga, erm_acc = _worst_group(model.logits(x[ood]), y[ood], g[ood])
    return {"lda_wga": lda_wga, "erm_wga": erm_wga, "lda_ood_acc": lda_acc, "erm_ood_acc": erm_acc}


def phase_diagram(pcfg: PhaseConfig) -> list[dict[str, Any]]:
    """One record per panel cell: knob values, seed-mean accuracies, diff = lda − erm and the winner."""
    from stages.runtime import progress

    cells = [
        (i, p, xv, yv) for i, p in enumerate(pcfg.panels) for yv in p.y_values for xv in p.x_values
    ]
    rows = []
    for i, panel, xv, yv in progress(cells, desc="phase", total=len(cells), unit="cell"):
        per_seed = [
            compare_cell(cell_config(pcfg.base, {panel.x: xv, panel.y: yv}, s), pcfg, s) for s in pcfg.seeds
        ]
        mean = {k: float(np.mean([r[k] for r in per_seed])) for k in per_seed[0]}
        diffs = [r["lda_wga"] - r["erm_wga"] for r in per_seed]
        diff = float(np.mean(diffs))
        rows.append(
            {
                "panel": i,
                "panel_name": f"{i}: {panel.x} x {panel.y}",
                "x_knob": panel.x,
                "x": float(xv),
                "y_knob": panel.y,
                "y": float(yv),
                **mean,
                "diff": diff,
                "diff_sd": float(np.std(diffs, ddof=1)) if len(diffs) > 1 else None,
                "seeds": len(per_seed),
                "winner": "lda" if diff > 0 else "erm" if diff < 0 else "tie",
            }
        )
    return rows


def run(params: DictConfig) -> str:
    pcfg = section(params, "phase", PhaseConfig)
    rows = phase_diagram(pcfg)
    write_json(rows, PHASE_PATH)
    wins = {w: sum(r["winner"] == w for r in rows) for w in ("lda", "erm", "tie")}
    return (
        f"{len(rows)} cells in {len(pcfg.panels)} panels: lda wins {wins['lda']}, erm wins {wins['erm']}, "
        f"ties {wins['tie']} -> {PHASE_PATH}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("phase", __doc__, [], lambda: describe(PhaseConfig, "phase"), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
