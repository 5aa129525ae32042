"""`groupdro`: Group DRO (Sagawa et al. 2020, online algorithm) — minimise the loss of the
worst groups through exponentiated-gradient weights over the groups of train.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.discriminative import MLPFitConfig, train_mlp

if TYPE_CHECKING:
    import torch

    from stages.models.training import Batch, Trained, TrainJob


@dataclass
class GroupDROConfig(MLPFitConfig):
    """Group DRO (Sagawa et al. 2020): exponentiated-gradient weights on the worst groups."""

    eta: float = option("step size of the group-weight update")

    def check(self, c: Checks) -> None:
        super().check(c)
        c.positive(self.eta, "eta")


class GroupDROLoss:
    """Group DRO (Sagawa et al. 2020, online algorithm): Σ_g q_g · mean loss of group g.

    After each batch q ← q · exp(eta · loss_g), renormalised; q persists across batches,
    so groups that stay bad gain weight. Groups absent from a batch keep their weight.
    """

    def __init__(self, n_groups: int, eta: float) -> None:
        import torch

        self.n_groups = int(n_groups)
        self.eta = float(eta)
        self.q = torch.full((self.n_groups,), 1.0 / self.n_groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The group weights q (what a checkpoint must carry to resume exactly)."""
        return {"q": self.q.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.q = state["q"].clone()

    def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        losses = F.cross_entropy(logits, batch["y"], reduction="none")
        onehot = F.one_hot(batch["g"], self.n_groups).to(losses.dtype)  # (b, G)
        counts = onehot.sum(0)
        group_loss = (onehot.T @ losses) / counts.clamp(min=1)
        with torch.no_grad():
            self.q = self.q * torch.exp(self.eta * group_loss.detach())
            self.q = self.q / self.q.sum()
        return group_loss @ self.q

    def held_out(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The objective on a held-out split, q untouched: the worst group's mean loss, max_g
        loss_g over the groups present — the robust loss the online algorithm minimises
        (Sagawa et al. 2020, eq. 2; Σ_g q_g loss_g is a lower bound of it)."""
        import torch
        import torch.nn.functional as F

        losses = F.cross_entropy(logits, batch["y"], reduction="none")
        return torch.stack([losses[batch["g"] == v].mean() for v in torch.unique(batch["g"])]).max()


def train(job: TrainJob) -> Trained:
    """The group-weighted loss on train (its weights q are checkpointed with the loop)."""

    def setup(splits: Any, generator: torch.Generator) -> tuple[Any, dict[str, Any]]:
        return GroupDROLoss(job.prepared.n_groups, job.cfg.eta), {}

    return train_mlp(job, setup)


register_method("groupdro", GroupDROConfig, train, pretrained="init", model=("mlp", "backbone"), streams=True)
