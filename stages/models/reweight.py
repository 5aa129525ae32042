"""`reweight`: cross-entropy with per-example weights ∝ 1 / frequency of the example's class
or group in train, so every class (or group) of train carries the same total weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.discriminative import MLPFitConfig, Plan, train_mlp

if TYPE_CHECKING:
    import torch

    from stages.models.training import Trained, TrainJob


@dataclass
class ReweightConfig(MLPFitConfig):
    """Cross-entropy with weights ∝ 1/frequency, so every class (or group) of train weighs the same."""

    balance: str = option("what the inverse-frequency weights balance: class | group")

    def check(self, c: Checks) -> None:
        super().check(c)
        c.choice(self.balance, "balance", ["class", "group"])


def balanced_weights(labels: torch.Tensor, n_values: int) -> torch.Tensor:
    """Per-example weights ∝ 1 / count of the example's label (class or group) in `labels`.

    Every value present then carries the same total weight; weights have mean 1.
    """
    import torch

    from stages.models.robust import normalised

    counts = torch.bincount(labels, minlength=n_values).double()
    if len(counts) > n_values:
        raise ValueError(f"labels go up to {int(labels.max())} but there are {n_values} values")
    return normalised(1.0 / counts[labels])


def train(job: TrainJob) -> Trained:
    """Inverse-frequency weights on train (class or group, by `balance`)."""
    from stages.models.robust import weighted_cross_entropy

    def setup(splits: Any, generator: torch.Generator) -> Plan:
        train = splits["train"]
        prepared = job.prepared
        labels, n_values = (train.g, prepared.n_groups) if job.cfg.balance == "group" else (train.y, prepared.n_classes)
        train.extra["w"] = balanced_weights(labels, n_values)
        if "val" in splits:  # the same rule on val, for the objective's held-out value (training.held_out)
            val = splits["val"]
            splits["val"].extra["w"] = balanced_weights(val.g if job.cfg.balance == "group" else val.y, n_values)
        return Plan(weighted_cross_entropy)

    return train_mlp(job, setup)


register_method("reweight", ReweightConfig, train, pretrained="init", model=("mlp", "backbone"), streams=True)
