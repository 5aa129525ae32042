"""`jtt`: Just Train Twice (Liu et al. 2021) — a short ERM run identifies the train examples
it gets wrong (`identify_errors`); a fresh model of the same backbone is retrained with those
examples' weight multiplied by λ (`jtt_weights`, `robust.weighted_cross_entropy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.discriminative import MLPFitConfig, build_classifier, train_mlp

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
    """Just Train Twice: an ERM run's train errors get weight λ in a second run of the same backbone."""

    id_epochs: int = option("epochs of the ERM identification run (its last epoch is used)")
    upweight: float = option("λ: loss weight of the identification run's train errors (1 = plain ERM)")

    def check(self, c: Checks) -> None:
        super().check(c)
        c.require(self.id_epochs >= 1, "id_epochs", f"must be >= 1, got {self.id_epochs}")
        c.require(self.upweight >= 1, "upweight", f"must be >= 1 (1 = plain ERM), got {self.upweight}")


def jtt_weights(errors: torch.Tensor, upweight: float) -> torch.Tensor:
    """Weight λ = `upweight` for the identified errors, 1 for the rest, then scaled to mean 1."""
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
    """The identification run (not checkpointed: short and deterministic), then the
    upweighted second run; config.json records the identification under `jtt`."""

    from stages.models.robust import weighted_cross_entropy
    from stages.models.training import FitOptions

    cfg = job.cfg

    def setup(splits: Any, generator: torch.Generator) -> tuple[Any, dict[str, Any]]:
        first, _ = build_classifier(job)  # the same network as the second run (same backbone and weights)
        ident = identify_errors(
            first, splits, FitOptions.from_config(cfg), cfg.id_epochs, generator,
            job.prepared.n_groups, desc=f"{job.desc} (identify)",
        )
        splits["train"].extra["w"] = jtt_weights(ident.errors, cfg.upweight)
        if "val" in splits:  # the identification model's val errors weigh val's objective (training.held_out)
            splits["val"].extra["w"] = jtt_weights(misclassified(first, splits["val"]), cfg.upweight)
        return weighted_cross_entropy, {"jtt": {**ident.summary, "upweight": cfg.upweight}}

    return train_mlp(job, setup)


register_method("jtt", JTTConfig, train, pretrained="init", model=("mlp", "backbone"), streams=True)
