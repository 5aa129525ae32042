"""The one minibatch training loop, its losses, per-epoch evaluation and checkpoint selection.

erm, groupdro and distill call `fit_classifier` with different loss callables; pretrain's
denoising autoencoder calls the inner `run_epoch` with its own reconstruction loss.

History (`artifacts.HISTORY_SCHEMA`): after every epoch (1..epochs) the model is scored on
every split present; `loss` there is the mean cross-entropy of the labels (whatever the
training objective), `acc` the accuracy, `worst_group_acc` the lowest accuracy over the
groups that occur in the split. A checkpoint is chosen by a named criterion:

    val_avg          best val accuracy                  (no group labels needed)
    val_worst_group  best val worst-group accuracy      (uses validation groups)
    oracle           best test_ood worst-group accuracy (uses test groups; report only)

Ties go to the earlier epoch. The selected state_dict is kept in memory (no disk checkpoints).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from stages.artifacts import HISTORY_SCHEMA, SPLITS, Prepared, prepared_path, read_prepared
from stages.io import ArtifactError
from stages.runtime import progress

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]
"""A training objective: (logits of a batch, the batch's tensors) -> scalar loss."""

SELECTION_METRIC: dict[str, tuple[str, str]] = {
    "val_avg": ("val", "acc"),
    "val_worst_group": ("val", "worst_group_acc"),
    "oracle": ("test_ood", "worst_group_acc"),
}


# ---- data ------------------------------------------------------------------------------------


@dataclass
class SplitData:
    """One split as tensors: x (float32), y and g (int64), plus named extras (e.g. teacher logits)."""

    x: torch.Tensor
    y: torch.Tensor
    g: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> Batch:
        return {"x": self.x, "y": self.y, "g": self.g, **self.extra}

    def __len__(self) -> int:
        return len(self.y)


def split_data(prepared: Prepared) -> dict[str, SplitData]:
    """The prepared splits as tensors, in `SPLITS` order; empty splits are left out."""
    out: dict[str, SplitData] = {}
    for name in SPLITS:
        m = prepared.mask(name)
        if m.any():
            out[name] = SplitData(
                x=torch.from_numpy(np.ascontiguousarray(prepared.x[m], dtype=np.float32)),
                y=torch.from_numpy(prepared.y[m].astype(np.int64)),
                g=torch.from_numpy(prepared.g[m].astype(np.int64)),
            )
    return out


def read_prepared_input(dataset: str, need: tuple[str, ...] = SPLITS) -> Prepared:
    """Read data/prepared/<dataset>.parquet; a missing file or split names the path and its maker."""
    path = prepared_path(dataset)
    if not path.is_file():
        raise ArtifactError(
            f"{path}: prepared data not found; it is made by the prepare stage "
            f"(`python -m stages.prepare {dataset}` or `dvc repro prepare@{dataset}`)"
        )
    prepared = read_prepared(path)
    for name in need:
        if not prepared.mask(name).any():
            raise ArtifactError(f"{path}: split '{name}' has no rows")
    return prepared


# ---- losses ----------------------------------------------------------------------------------


def cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """ERM: mean cross-entropy of the labels."""
    return F.cross_entropy(logits, batch["y"])


class GroupDROLoss:
    """Group DRO (Sagawa et al. 2020, online algorithm): Σ_g q_g · mean loss of group g.

    After each batch q ← q · exp(eta · loss_g), renormalised; q persists across batches,
    so groups that stay bad gain weight. Groups absent from a batch keep their weight.
    """

    def __init__(self, n_groups: int, eta: float) -> None:
        self.n_groups = int(n_groups)
        self.eta = float(eta)
        self.q = torch.full((self.n_groups,), 1.0 / self.n_groups)

    def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        losses = F.cross_entropy(logits, batch["y"], reduction="none")
        onehot = F.one_hot(batch["g"], self.n_groups).to(losses.dtype)  # (b, G)
        counts = onehot.sum(0)
        group_loss = (onehot.T @ losses) / counts.clamp(min=1)
        with torch.no_grad():
            self.q = self.q * torch.exp(self.eta * group_loss.detach())
            self.q = self.q / self.q.sum()
        return group_loss @ self.q


def distillation_loss(temperature: float, alpha: float) -> LossFn:
    """alpha·T²·KL(softmax(teacher/T) ‖ softmax(student/T)) + (1−alpha)·CE(student, y).

    Needs the batch's teacher logits under the key "teacher". T² keeps the soft term's
    gradient scale independent of T (Hinton et al. 2015).
    """
    t = float(temperature)

    def loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        soft = F.kl_div(
            F.log_softmax(logits / t, dim=1),
            F.log_softmax(batch["teacher"] / t, dim=1),
            log_target=True,
            reduction="batchmean",
        )
        out = alpha * t * t * soft
        if alpha < 1.0:
            out = out + (1.0 - alpha) * F.cross_entropy(logits, batch["y"])
        return out

    return loss


# ---- metrics ---------------------------------------------------------------------------------


def split_metrics(logits: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    """Mean cross-entropy, accuracy and worst-group accuracy (over groups present)."""
    logits = logits.double()
    loss = F.cross_entropy(logits, y).item()
    correct = (logits.argmax(1) == y).double()
    groups = torch.unique(g)
    wga = min(correct[g == k].mean().item() for k in groups)
    return {"loss": float(loss), "acc": float(correct.mean().item()), "worst_group_acc": float(wga)}


@torch.no_grad()
def evaluate_splits(model: nn.Module, splits: Mapping[str, SplitData], batch_size: int = 4096) -> dict[str, dict[str, float]]:
    """`split_metrics` of `model` on every split (eval mode, no gradients)."""
    was_training = model.training
    model.eval()
    try:
        out = {}
        for name, s in splits.items():
            logits = torch.cat([model(s.x[i : i + batch_size]) for i in range(0, len(s), batch_size)])
            out[name] = split_metrics(logits, s.y, s.g)
        return out
    finally:
        model.train(was_training)


def history_table(rows: list[dict[str, Any]]) -> pa.Table:
    """History rows (epoch, split, loss, acc, worst_group_acc) as a HISTORY_SCHEMA table."""
    return pa.Table.from_pylist(rows, schema=HISTORY_SCHEMA)


def history_rows(epoch: int, metrics: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    return [{"epoch": epoch, "split": name, **m} for name, m in metrics.items()]


# ---- the loop --------------------------------------------------------------------------------


@dataclass
class FitOptions:
    """Optimisation and selection settings shared by erm, groupdro and distill."""

    lr: float
    epochs: int
    batch_size: int
    selection: str = "val_avg"
    weight_decay: float = 0.0

    @classmethod
    def from_config(cls, cfg: Any) -> FitOptions:
        """From an ErmConfig / GroupDROConfig / DistillConfig (DistillConfig has no weight decay)."""
        return cls(
            lr=cfg.lr,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            selection=cfg.selection,
            weight_decay=getattr(cfg, "weight_decay", 0.0),
        )


@dataclass
class FitResult:
    """The selected checkpoint, its epoch and metrics, and the full per-epoch history."""

    state_dict: dict[str, torch.Tensor]
    selected_epoch: int
    selected_metrics: dict[str, dict[str, float]]
    history: pa.Table


def run_epoch(
    data: Mapping[str, torch.Tensor],
    batch_loss: Callable[[Batch], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    generator: torch.Generator,
) -> float:
    """One pass over `data` in a seeded random order; returns the mean batch loss.

    `data` maps names to tensors with the same first dimension; each step receives the
    batch as a dict of the same names.
    """
    n = len(next(iter(data.values())))
    order = torch.randperm(n, generator=generator)
    total, steps = 0.0, 0
    for i in range(0, n, batch_size):
        idx = order[i : i + batch_size]
        loss = batch_loss({k: v[idx] for k, v in data.items()})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
        steps += 1
    return total / max(steps, 1)


def fit_classifier(
    model: nn.Module,
    splits: Mapping[str, SplitData],
    loss_fn: LossFn,
    opts: FitOptions,
    generator: torch.Generator,
    desc: str = "train",
) -> FitResult:
    """Train `model` on splits["train"] with `loss_fn`; score every split each epoch; select.

    `model` is left holding its last-epoch weights; the selected ones are in the result.
    """
    split_name, metric = SELECTION_METRIC[opts.selection]
    if split_name not in splits:
        raise ArtifactError(f"selection '{opts.selection}' needs split '{split_name}', which has no rows")
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    train = splits["train"].tensors()
    rows: list[dict[str, Any]] = []
    best: tuple[float, int, dict[str, torch.Tensor], dict[str, dict[str, float]]] | None = None

    def step(batch: Batch) -> torch.Tensor:
        return loss_fn(model(batch["x"]), batch)

    for epoch in progress(range(1, opts.epochs + 1), desc=desc, total=opts.epochs, unit="epoch"):
        model.train()
        run_epoch(train, step, optimizer, opts.batch_size, generator)
        metrics = evaluate_splits(model, splits)
        rows += history_rows(epoch, metrics)
        score = metrics[split_name][metric]
        if best is None or score > best[0]:
            best = (score, epoch, copy.deepcopy(model.state_dict()), metrics)
    assert best is not None  # epochs >= 1
    return FitResult(state_dict=best[2], selected_epoch=best[1], selected_metrics=best[3], history=history_table(rows))
