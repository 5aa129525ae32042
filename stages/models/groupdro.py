"""`groupdro`: Group DRO (Sagawa et al. 2020, online algorithm) — minimise the loss of the
worst groups through exponentiated-gradient weights over the groups of train.

The published training (github.com/kohpangwei/group_DRO, its README commands `run_expt.py ...
--reweight_groups --robust --generalization_adjustment 0`, `loss.py` `LossComputer`, `train.py`)
is the default (conf/method/groupdro.yaml):

- batches drawn group-balanced: `--reweight_groups` (data/dro_dataset.py `get_loader`) samples
  len(train) rows per epoch with replacement, row i with probability ∝ 1 / count(group of i)
  (`robust.group_balanced_sampler`); `sampling: uniform` (one permutation of train per epoch,
  this project's earlier default) is the documented alternative;
- `eta`, the q step size: run_expt.py's `--robust_step_size` default 0.01, which no README command
  changes;
- `adjustment`, the generalization adjustment C (paper §5, `--generalization_adjustment`): the
  q update sees loss_g + C / sqrt(n_g) (n_g: group g's count in train); 0 in every README command;
- weight decay: the paper's "strong ℓ2 penalty" (λ = 1 on Waterbirds, 0.1 on CelebA; the README
  commands use 1e-4, the "standard" regularisation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.discriminative import MLPFitConfig, Plan, train_mlp

if TYPE_CHECKING:
    import torch

    from stages.models.training import Batch, Trained, TrainJob

SAMPLINGS = ("balanced", "uniform")


@dataclass
class GroupDROConfig(MLPFitConfig):
    """Group DRO (Sagawa et al. 2020): exponentiated-gradient weights on the worst groups."""

    eta: float = option("step size of the group-weight update (the code's robust_step_size; published 0.01)")
    adjustment: float = option(
        "generalization adjustment C >= 0: the group-weight update sees loss_g + C/sqrt(n_g), n_g the group's "
        "train count (published README commands: 0)"
    )
    sampling: str = option(
        "rows of an epoch: balanced (published --reweight_groups: len(train) draws with replacement, "
        "P(row) ∝ 1/count(its group)) | uniform (one permutation of train)"
    )

    def check(self, c: Checks) -> None:
        super().check(c)
        c.positive(self.eta, "eta")
        c.non_negative(self.adjustment, "adjustment")
        c.choice(self.sampling, "sampling", list(SAMPLINGS))


class GroupDROLoss:
    """Group DRO (Sagawa et al. 2020, online algorithm; the code's `LossComputer.compute_robust_loss`).

    Per batch, loss_g is the mean loss of group g's rows (0 for a group absent from the batch) and
    adjusted_g = loss_g + C / sqrt(n_g) (the generalization adjustment `adjustment` C, with n_g the
    group's count in train, `group_counts`; none when C = 0). Then q ← q · exp(eta · adjusted),
    renormalised (q persists across batches, so groups that stay bad gain weight; an absent group's
    weight is multiplied by exp(eta · C/sqrt(n_g)) only), and the loss is Σ_g q_g · adjusted_g —
    the code's value (its in-place `+=` adjusts `group_loss` too); the adjustment is constant in
    the weights, so the gradient is that of Σ_g q_g · loss_g.
    """

    def __init__(self, n_groups: int, eta: float, adjustment: float = 0.0, group_counts: torch.Tensor | None = None) -> None:
        import torch

        self.n_groups = int(n_groups)
        self.eta = float(eta)
        self.q = torch.full((self.n_groups,), 1.0 / self.n_groups)
        self.adjust = torch.zeros(self.n_groups)
        if adjustment > 0:
            if group_counts is None:
                raise ValueError("the generalization adjustment needs the train group counts")
            # A group with no train row never occurs in a batch: it gets no adjustment (the code would divide by 0).
            counts = torch.as_tensor(group_counts, dtype=torch.float32)
            self.adjust = torch.where(counts > 0, float(adjustment) / counts.clamp(min=1).sqrt(), torch.zeros(()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The group weights q (what a checkpoint must carry to resume exactly)."""
        return {"q": self.q.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.q = state["q"].clone()

    def group_losses(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The adjusted group losses of a batch, loss_g + C/sqrt(n_g), (G,)."""
        import torch.nn.functional as F

        losses = F.cross_entropy(logits, batch["y"], reduction="none")
        onehot = F.one_hot(batch["g"], self.n_groups).to(losses.dtype)  # (b, G)
        counts = onehot.sum(0)
        return (onehot.T @ losses) / counts.clamp(min=1) + self.adjust.to(losses.device, losses.dtype)

    def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        import torch

        group_loss = self.group_losses(logits, batch)
        with torch.no_grad():
            q = self.q.to(group_loss.device) * torch.exp(self.eta * group_loss.detach())
            self.q = (q / q.sum()).cpu()
        return group_loss @ self.q.to(group_loss.device, group_loss.dtype)

    def held_out(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The objective on a held-out split, q untouched: the worst group's mean loss, max_g
        loss_g over the groups present — the robust loss the online algorithm minimises
        (Sagawa et al. 2020, eq. 2; Σ_g q_g loss_g is a lower bound of it). No adjustment: the
        code's validation `LossComputer` has none."""
        import torch
        import torch.nn.functional as F

        losses = F.cross_entropy(logits, batch["y"], reduction="none")
        return torch.stack([losses[batch["g"] == v].mean() for v in torch.unique(batch["g"])]).max()


def train(job: TrainJob) -> Trained:
    """The group-weighted loss on train (its weights q are checkpointed with the loop), batches
    drawn group-balanced (`sampling: balanced`) or as one permutation of train."""
    cfg = job.cfg

    def setup(splits: Any, generator: torch.Generator) -> Plan:
        import torch

        from stages.models.robust import group_balanced_sampler

        g = splits["train"].g
        counts = torch.bincount(g, minlength=job.prepared.n_groups)
        loss = GroupDROLoss(job.prepared.n_groups, cfg.eta, cfg.adjustment, counts)
        sampler = group_balanced_sampler(g, job.prepared.n_groups) if cfg.sampling == "balanced" else None
        record = {"groupdro": {"sampling": cfg.sampling, "eta": cfg.eta, "adjustment": cfg.adjustment,
                               "train_group_counts": {str(k): int(n) for k, n in enumerate(counts.tolist())}}}
        return Plan(loss, record, sampler)

    return train_mlp(job, setup)


register_method("groupdro", GroupDROConfig, train, pretrained="init", model=("mlp", "backbone"), streams=True)
