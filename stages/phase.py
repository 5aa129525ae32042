"""The phase diagram: where does a generative classifier beat a discriminative one under shift?

    python -m stages.phase [phase.seeds=[0,1]]

`phase.base` is a generated dataset's config (its `kind` names the dataset module, and its
schema validates it, as for `dataset.<name>`). For every cell of every panel in the `phase`
section (two of its knobs, PHASE_KNOBS, on the axes, the others at `phase.base`), and every
seed, it generates the dataset (data seed = the seed), fits

- **generative**: the closed-form method `phase.generative` (a method config; by default
  LDA, class-conditional Gaussians with a shared covariance), through its registered `fit`, and
- **discriminative**: logistic regression — an `MLPClassifier` with no hidden layer trained
  with the shared loop (`stages.models.training.fit_classifier`, cross-entropy, checkpoint
  selected by `phase.selection`),

and scores both on `test_ood` (agreement `base.rho_ood`; 0 = fully reversed). A cell reports
each classifier's worst-group OOD accuracy averaged over seeds, their difference
`diff = generative − discriminative` (positive: the generative classifier is more robust),
its sample sd over seeds and the winner. Writes data/phase/phase.json: one record per cell (an empty
list when `phase.panels` is empty, the default; experiment=toy_phase_diagram fills it in).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig

from stages import registry
from stages.artifacts import DATA
from stages.cli import stage_main
from stages.config import dataset_section, method_section, section, section_help
from stages.io import write_json
from stages.schema import ConfigError
from stages.settings import PHASE_KNOBS, PhaseConfig

PHASE_PATH = DATA / "phase" / "phase.json"


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


def _worst_group(logits: np.ndarray, y: np.ndarray, g: np.ndarray, n_groups: int) -> tuple[float, float]:
    from stages.metrics import group_accuracies, predictions

    correct = predictions(logits) == y
    n, acc = group_accuracies(correct, g, n_groups)
    return float(acc[n > 0].min()), float(correct.mean())


def compare_cell(cfg: Any, pcfg: PhaseConfig, gcfg: Any, seed: int) -> dict[str, float]:
    """Worst-group and plain test_ood accuracy of the generative classifier and logistic
    regression on one dataset generated from `cfg` by its kind's generator."""
    import torch

    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import FitOptions, SplitData, cross_entropy, fit_classifier
    from stages.runtime import setup_torch

    generate = registry.dataset(cfg.kind).generate
    if generate is None:
        raise ConfigError(f"params.yaml: phase.base.kind: dataset kind '{cfg.kind}' is not generated")
    columns, meta = generate(cfg)
    n_classes, n_attrs = int(meta["n_classes"]), int(meta["n_attrs"])
    split = columns["split"]
    y, a, x = columns["y"], columns["a"], columns["x"]
    g = y * n_attrs + a

    def part(name: str) -> SplitData:
        m = split == name
        return SplitData(torch.from_numpy(np.ascontiguousarray(x[m])), torch.from_numpy(y[m]), torch.from_numpy(g[m]))

    ood = split == "test_ood"
    train = split == "train"
    gen = registry.method(gcfg.kind).fit(x[train], y[train], n_classes, gcfg)  # type: ignore[misc]
    gen_wga, gen_acc = _worst_group(gen.logits(x[ood]), y[ood], g[ood], n_classes * n_attrs)

    generator = setup_torch(seed)
    model = MLPClassifier(MLPEncoder(x.shape[1], []), n_classes, Standardize(x.shape[1]).fit(torch.from_numpy(x[train])))
    needed = {"train", "val"} | ({"test_ood"} if pcfg.selection == "oracle" else set())
    opts = FitOptions(pcfg.lr, pcfg.epochs, pcfg.batch_size, pcfg.selection, pcfg.weight_decay)
    result = fit_classifier(model, {s: part(s) for s in ("train", "val", "test_ood") if s in needed}, cross_entropy, opts, generator, desc="phase logistic regression")
    model.load_state_dict(result.state_dict)
    disc_wga, disc_acc = _worst_group(model.logits(x[ood]), y[ood], g[ood], n_classes * n_attrs)
    return {"generative_wga": gen_wga, "discriminative_wga": disc_wga, "generative_ood_acc": gen_acc,
            "discriminative_ood_acc": disc_acc}


def phase_diagram(pcfg: PhaseConfig, base: Any, gcfg: Any) -> list[dict[str, Any]]:
    """One record per panel cell: knob values, seed-mean accuracies, diff = generative −
    discriminative worst-group OOD accuracy, and the winner.

    `base` is the validated dataset config of `phase.base` (see `base_config`).
    """
    from stages.runtime import progress

    knob_types(base)

    cells = [
        (i, p, xv, yv) for i, p in enumerate(pcfg.panels) for yv in p.y_values for xv in p.x_values
    ]
    rows = []
    for i, panel, xv, yv in progress(cells, desc="phase", total=len(cells), unit="cell"):
        per_seed = [
            compare_cell(cell_config(base, {panel.x: xv, panel.y: yv}, s), pcfg, gcfg, s) for s in pcfg.seeds
        ]
        mean = {k: float(np.mean([r[k] for r in per_seed])) for k in per_seed[0]}
        diffs = [r["generative_wga"] - r["discriminative_wga"] for r in per_seed]
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
                "winner": "generative" if diff > 0 else "discriminative" if diff < 0 else "tie",
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
    rows = phase_diagram(pcfg, base_config(params), generative_config(params))
    write_json(rows, PHASE_PATH)
    wins = {w: sum(r["winner"] == w for r in rows) for w in ("generative", "discriminative", "tie")}
    return (
        f"{len(rows)} cells in {len(pcfg.panels)} panels: the generative classifier wins {wins['generative']}, "
        f"logistic regression {wins['discriminative']}, ties {wins['tie']} -> {PHASE_PATH}"
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
