"""What the trained generative classifiers (diffusion, autoregressive) share: the epoch loop
with checkpoint selection, and class priors.

A generative model is trained by maximum likelihood of x given its label — its training
loss never scores the other classes — so it cannot use `training.fit_classifier`, whose
step is `loss(model(x), batch)` on class logits. `fit_generative` runs the same
`training.run_epoch` over the train split with the model's own per-batch loss and applies
the same named selection criteria (`training.SELECTION_METRIC`: val_avg, val_worst_group,
oracle; ties to the earlier epoch). Classifying is far dearer than a training step (every
class, and for diffusion many noise draws), so the splits are scored every `eval_every`
epochs and at the last epoch (with the model's cheaper selection-time scorer), not after
every epoch; history has rows only for the scored epochs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.io import ArtifactError
from stages.models.training import (
    SELECTION_METRIC,
    Batch,
    FitResult,
    SplitData,
    history_rows,
    history_table,
    run_epoch,
    split_metrics,
)
from stages.runtime import progress

Scorer = Callable[[torch.Tensor], torch.Tensor]
"""Class scores (n, n_classes) of a batch of raw inputs, used only for selection."""


@dataclass
class GenerativeFitOptions:
    """Optimisation and selection settings of a generative model's training run."""

    lr: float
    epochs: int
    batch_size: int
    selection: str = "val_avg"
    weight_decay: float = 0.0
    eval_every: int = 5

    @classmethod
    def from_config(cls, cfg: Any) -> GenerativeFitOptions:
        """From a DiffusionConfig / AutoregressiveConfig."""
        return cls(cfg.lr, cfg.epochs, cfg.batch_size, cfg.selection, cfg.weight_decay, cfg.eval_every)


def fit_generative(
    model: torch.nn.Module,
    splits: Mapping[str, SplitData],
    batch_loss: Callable[[Batch], torch.Tensor],
    scorer: Scorer,
    opts: GenerativeFitOptions,
    generator: torch.Generator,
    desc: str = "train",
) -> FitResult:
    """Train `model` with `batch_loss` on splits["train"]; every `eval_every` epochs (and at the
    last) score every split with `scorer` and keep the best checkpoint by `opts.selection`.

    `model` is left holding its last-epoch weights; the selected ones are in the result.
    """
    split_name, metric = SELECTION_METRIC[opts.selection]
    if split_name not in splits:
        raise ArtifactError(f"selection '{opts.selection}' needs split '{split_name}', which has no rows")
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    train = {"x": splits["train"].x, "y": splits["train"].y}
    rows: list[dict[str, Any]] = []
    best: tuple[float, int, dict[str, torch.Tensor], dict[str, dict[str, float]]] | None = None
    for epoch in progress(range(1, opts.epochs + 1), desc=desc, total=opts.epochs, unit="epoch"):
        model.train()
        run_epoch(train, batch_loss, optimizer, opts.batch_size, generator)
        if epoch % opts.eval_every and epoch != opts.epochs:
            continue
        model.eval()
        with torch.no_grad():
            metrics = {name: split_metrics(scorer(s.x), s.y, s.g) for name, s in splits.items()}
        rows += history_rows(epoch, metrics)
        score = metrics[split_name][metric]
        if best is None or score > best[0]:
            best = (score, epoch, copy.deepcopy(model.state_dict()), metrics)
    assert best is not None  # the last epoch is always scored
    model.eval()
    return FitResult(state_dict=best[2], selected_epoch=best[1], selected_metrics=best[3], history=history_table(rows))


def log_priors(y: np.ndarray | torch.Tensor, n_classes: int) -> torch.Tensor:
    """log π_y from label counts (float64); every class must occur (ValueError otherwise)."""
    counts = torch.bincount(torch.as_tensor(np.asarray(y), dtype=torch.int64), minlength=n_classes)
    if len(counts) > n_classes:
        raise ValueError(f"labels go up to {len(counts) - 1} but n_classes is {n_classes}")
    missing = [k for k in range(n_classes) if counts[k] == 0]
    if missing:
        raise ValueError(f"class(es) {missing} have no training examples")
    return torch.log(counts.double() / counts.sum())


def logsumexp_np(scores: np.ndarray) -> np.ndarray:
    """log Σ_y exp(scores[:, y]) in float64, row-wise."""
    s = np.asarray(scores, dtype=np.float64)
    m = s.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))[:, 0]


LOG_2PI = math.log(2 * math.pi)
