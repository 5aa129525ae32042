"""Config schemas several methods share, apart from their implementations: importing them (as
every config check does) costs no torch. `MLPFitConfig`, the discriminative methods' base, is in
stages/models/discriminative.py, itself light."""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.schema import Checks, option, train_and_selection_splits


@dataclass
class GenerativeFitConfig:
    """Optimisation and selection keys shared by the trained generative classifiers."""

    kind: str = option("method family")
    lr: float = option("AdamW learning rate")
    weight_decay: float = option("AdamW weight decay")
    epochs: int = option("the epoch budget: training stops here unless the plateau test stopped it earlier (patience)")
    patience: int = option(
        "stop once the plateau test of the under-training flag (docs/metrics.md) finds the val objective "
        "plateaued at this many epochs in a row (0 = train every epoch of the budget)"
    )
    min_epochs: int = option(
        "the minimum budget: the plateau test never stops training before this epoch (0 = from the first "
        "epoch it can judge); a model at chance is not 'plateaued' (the report calls it 'failed to learn')"
    )
    batch_size: int = option("minibatch size")
    selection: str = option("checkpoint selection: val_avg | val_worst_group | oracle")
    eval_every: int = option("score the splits (for selection and history) every N epochs, at the last and where training stops")

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split
        (with patience, val also decides when training stops)."""
        return tuple(dict.fromkeys([*train_and_selection_splits(self.selection), *(("val",) if self.patience else ())]))

    def check(self, c: Checks) -> None:
        c.minibatch(self)
        c.require(self.patience >= 0, "patience", f"must be >= 0 (0 = no early stop), got {self.patience}")
        c.require(0 <= self.min_epochs <= self.epochs, "min_epochs",
                  f"must be in [0, epochs = {self.epochs}], got {self.min_epochs}")
        c.require(self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}")


SHRINK_TARGETS = ("scaled_identity", "diagonal", "identity")


@dataclass
class GaussianConfig:
    """The keys of a Gaussian classifier fitted in closed form (its own schema names it)."""

    kind: str = option("method family")
    shrinkage: float = option("covariance shrinkage λ towards `shrink_target` (per class where each has its own), in [0, 1]")
    shrink_target: str = option("what the covariance shrinks towards: scaled_identity ((tr Σ/d)·I) | diagonal (diag Σ) | identity (I)")

    def reads_splits(self) -> tuple[str, ...]:
        """Fitted in closed form on train."""
        return ("train",)

    def check(self, c: Checks) -> None:
        c.prob(self.shrinkage, "shrinkage")
        c.choice(self.shrink_target, "shrink_target", SHRINK_TARGETS)
