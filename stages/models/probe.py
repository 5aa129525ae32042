"""`probe`: a linear probe — the pretrain stage's encoder frozen, a linear head trained on train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.discriminative import MLPFitConfig, train_mlp

if TYPE_CHECKING:
    from stages.models.training import Trained, TrainJob


@dataclass
class ProbeConfig(MLPFitConfig):
    """Linear probe: the pretrained encoder frozen, a linear head trained on train (hidden is ignored)."""

    init: str = option("must be pretrained: the frozen encoder comes from the pretrain stage")

    def check(self, c: Checks) -> None:
        super().check(c)
        c.require(self.init == "pretrained", "init", f"a linear probe needs init 'pretrained', got '{self.init}'")


def train(job: TrainJob) -> Trained:
    """Cross-entropy on train through the frozen encoder (only the head learns)."""
    return train_mlp(job, freeze_encoder=True)


register_method("probe", ProbeConfig, train, pretrained="init")
