"""`jtt`: Just Train Twice (Liu et al. 2021) — a short ERM run identifies the train examples
it gets wrong (`identify_errors`); a fresh model of the same backbone is retrained with those
examples upsampled.

The published code (github.com/anniesch/jtt, run_expt.py `--up_weight`) upsamples by copies:
the second run's train set is `ConcatDataset([train, Subset(train, errors * up_weight)])`,
shuffled, so an error example appears λ + 1 times and an epoch has n + λ·|errors| rows
(`upsample: copies`, `robust.copies_sampler`; the default). `upsample: weight` keeps one copy of
each row and weighs the errors' loss by λ (`jtt_weights`, `robust.weighted_cross_entropy`; this
project's earlier default). λ (`upweight`) is the paper's Waterbirds value, 100 (its grid in
generate_downstream.py: 20, 50, 100; CelebA 50).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.discriminative import (
    MLPFitConfig,
    Plan,
    build_classifier,
    train_mlp,
)

if TYPE_CHECKING:
    import torch

    from stages.models.training import (
        FitOptions,
        SplitData,
        Trained,
        TrainJob,
    )


@dataclass
class JTTConfig(MLPFitConfig):
    """Just Train Twice: an ERM run's train errors upsampled (λ extra copies, or weight λ) in a second
    run of the same backbone."""

    id_epochs: int = option("epochs of the ERM identification run, T (its last epoch is used); with id_epochs_grid: unused")
    id_epochs_grid: list[int] = option(
        "T tuned as the authors do: one whole JTT run per value, the one whose selected model scores best on the "
        "selection criterion (val worst-group as published) is kept (ties: the smaller T; config.json records every "
        "value) ([] = id_epochs, untuned)"
    )
    upweight: float = option(
        "λ: copies: each identified error is added λ more times (published --up_weight; a whole number) | "
        "weight: its loss weight (1 = plain ERM)"
    )
    upsample: str = option(
        "how the errors are upsampled: copies (published: each error appears λ + 1 times, an epoch has "
        "n + λ·|errors| rows) | weight (one copy of each row, the errors' loss weighted by λ)"
    )

    def check(self, c: Checks) -> None:
        super().check(c)
        c.require(self.id_epochs >= 1, "id_epochs", f"must be >= 1, got {self.id_epochs}")
        c.require(all(t >= 1 for t in self.id_epochs_grid) and len(set(self.id_epochs_grid)) == len(self.id_epochs_grid),
                  "id_epochs_grid", f"must be distinct epochs >= 1, got {list(self.id_epochs_grid)}")
        c.choice(self.upsample, "upsample", list(UPSAMPLES))
        if self.upsample == "copies":
            c.require(self.upweight >= 0 and float(self.upweight).is_integer(), "upweight",
                      f"with upsample=copies, the number of extra copies: a whole number >= 0 (0 = plain ERM), got {self.upweight}")
        else:
            c.require(self.upweight >= 1, "upweight", f"must be >= 1 (1 = plain ERM), got {self.upweight}")


UPSAMPLES = ("copies", "weight")


def jtt_copies(errors: torch.Tensor, upweight: float) -> torch.Tensor:
    """Copies of each train row in the second run: 1 + λ for an identified error, 1 for the rest."""
    import torch

    return torch.where(errors, 1 + int(upweight), 1).to(torch.int64)


def jtt_weights(errors: torch.Tensor, upweight: float) -> torch.Tensor:
    """Weight `upweight` for the identified errors, 1 for the rest, then scaled to mean 1."""
    import torch

    from stages.models.robust import normalised

    return normalised(torch.where(errors, float(upweight), 1.0).double())


def misclassified(model: torch.nn.Module, split: SplitData, batch_size: int = 4096) -> torch.Tensor:
    """Boolean mask of the examples of `split` that `model` (in eval mode) gets wrong."""
    import torch

    from stages.core.runtime import current
    from stages.core.stream import batch_rows, to_input
    from stages.models.nets import model_device
    from stages.models.training import SplitData

    was_training = model.training
    model.eval()
    device, rt = model_device(model), current()
    rows = batch_rows(split.x.shape[1] if isinstance(split, SplitData) else split.file.dim, batch_size)
    try:
        with torch.no_grad(), rt.autocast(on=device):
            pred = torch.cat([model(to_input(x, device)).argmax(1).cpu() for x in split.x_batches(rows)])
    finally:
        model.train(was_training)
    return pred != split.y


@dataclass
class Identification:
    """JTT's first run: which train examples its ERM model got wrong, and a summary for config.json."""

    errors: torch.Tensor
    summary: dict[str, Any] = field(default_factory=dict)


def identify_errors(
    model: torch.nn.Module,
    splits: Mapping[str, SplitData],
    opts: FitOptions,
    id_epochs: int,
    generator: torch.Generator,
    n_groups: int,
    desc: str = "jtt identify",
) -> Identification:
    """Train `model` with plain cross-entropy for `id_epochs` epochs; its last-epoch errors on train.

    JTT uses the identification model as it stands after `id_epochs` epochs (no checkpoint
    selection). The summary has the error-set size, its share of train and its group counts.
    """
    import torch

    from stages.models.training import cross_entropy, fit_classifier

    id_opts = dataclasses.replace(opts, epochs=id_epochs)  # the same optimiser, for id_epochs
    fit_classifier(model, splits, cross_entropy, id_opts, generator, desc=desc)  # model keeps its last epoch
    train = splits["train"]
    errors = misclassified(model, train)
    by_group = torch.bincount(train.g[errors], minlength=n_groups).tolist()
    summary = {
        "id_epochs": id_epochs,
        "n_errors": int(errors.sum()),
        "n_train": len(train),
        "error_rate": float(errors.double().mean()),
        "errors_by_group": {str(g): int(n) for g, n in enumerate(by_group)},
    }
    return Identification(errors, summary)


def train(job: TrainJob) -> Trained:
    """JTT at T = `id_epochs`, or tuned over `id_epochs_grid` as the authors tune it (Liu et al.
    2021, §4 and Appendix: T and λ chosen on the val worst-group accuracy of the final model):
    one whole run per T from the same seed, the run whose selected checkpoint scores best on the
    selection criterion (`selection`; val_worst_group as published) kept (ties: the smaller T).
    config.json's `jtt.tuning` records the grid, every T's score and the chosen T."""
    from stages.models.history import SELECTION_METRIC

    cfg = job.cfg
    if not cfg.id_epochs_grid:
        return train_once(job)
    runs = []
    for t in cfg.id_epochs_grid:
        one = dataclasses.replace(job, cfg=dataclasses.replace(cfg, id_epochs=t, id_epochs_grid=[]))
        runs.append((t, train_once(one)))
    split, metric = SELECTION_METRIC[cfg.selection]  # the run's own selection criterion (published: val worst-group)
    scores = {t: float(r.metrics[split][metric]) for t, r in runs}
    chosen, best = max(runs, key=lambda tr: (scores[tr[0]], -tr[0]))
    best.record["jtt"]["tuning"] = {
        "grid": list(cfg.id_epochs_grid), "criterion": f"{split} {metric} of the selected checkpoint ({cfg.selection})",
        "scores": {str(t): v for t, v in scores.items()}, "chosen_id_epochs": chosen,
    }
    best.how += f"; T = {chosen} chosen over {list(cfg.id_epochs_grid)} on {split} {metric}"
    return best


def train_once(job: TrainJob) -> Trained:
    """The identification run (not checkpointed: short and deterministic), then the second run
    on train with the errors upsampled (`upsample`); config.json records the identification
    under `jtt`."""

    from stages.models.robust import copies_sampler, weighted_cross_entropy
    from stages.models.training import FitOptions, cross_entropy

    cfg = job.cfg

    def setup(splits: Any, generator: torch.Generator) -> Plan:
        first, _ = build_classifier(job)  # the same network as the second run (same backbone and weights)
        ident = identify_errors(
            first, splits, FitOptions.from_config(cfg), cfg.id_epochs, generator,
            job.prepared.n_groups, desc=f"{job.desc} (identify)",
        )
        record = {"jtt": {**ident.summary, "upweight": cfg.upweight, "upsample": cfg.upsample}}
        # val's objective (training.held_out) gives the identification model's val errors the same
        # share as train's: weights 1 + λ (copies, normalised: the mean loss over an upsampled val) or λ.
        weight = 1 + cfg.upweight if cfg.upsample == "copies" else cfg.upweight
        if "val" in splits:
            splits["val"].extra["w"] = jtt_weights(misclassified(first, splits["val"]), weight)
        if cfg.upsample == "copies":
            copies = jtt_copies(ident.errors, cfg.upweight)
            record["jtt"]["epoch_rows"] = int(copies.sum())
            return Plan(cross_entropy, record, copies_sampler(copies))
        splits["train"].extra["w"] = jtt_weights(ident.errors, cfg.upweight)
        return Plan(weighted_cross_entropy, record)

    return train_mlp(job, setup)


register_method("jtt", JTTConfig, train, pretrained="init", model=("mlp", "backbone"), streams=True)
