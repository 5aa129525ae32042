"""`erm`: empirical risk minimisation — an MLP trained with plain cross-entropy.

The baseline every shortcut-robust method is measured against; with `init: pretrained`
it fine-tunes the pretrain stage's encoder (every layer trains).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.core.registry import register_method
from stages.models.discriminative import MLPFitConfig, train_mlp

if TYPE_CHECKING:
    from stages.models.training import Trained, TrainJob


@dataclass
class ErmConfig(MLPFitConfig):
    """Empirical risk minimisation with an MLP."""


def train(job: TrainJob) -> Trained:
    """Cross-entropy on train; the epoch chosen by `selection`."""
    return train_mlp(job)


register_method("erm", ErmConfig, train, pretrained="init", model=("mlp", "backbone"), streams=True)
