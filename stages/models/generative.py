"""What the trained generative classifiers share: their config keys (`schemas.GenerativeFitConfig`),
their entry to the training loop, and class priors.

A generative model is trained by maximum likelihood of x given its label — its training
loss never scores the other classes — so its step is the model's own per-batch loss, not
`loss(model(x), batch)` on class logits as in `training.fit_classifier`. `fit_generative`
runs that step through the one loop `training.fit_loop` (same `run_epoch`, the same named
selection criteria `history.SELECTION_METRIC`: val_avg, val_worst_group, oracle; ties to
the earlier epoch; the same checkpoint/resume). Classifying is far dearer than a training
step (every class, and for a denoising model many noise draws), so the splits are scored every
`eval_every` epochs and at the last epoch (with the model's cheaper selection-time scorer),
not after every epoch; their classification columns in history are null on the other epochs.
The training objective is recorded every epoch (train and val rows, `objective`): on val by
the model's `val_objective`, its training loss on the whole val split given the labels — one
pass, no per-class scoring, on fixed draws where the loss is stochastic. Training stops on a
plateau of that val objective (`patience`: the plateau test of the under-training flag,
`history.plateau_stop`), or at the epoch budget `epochs`; the flag is computed on what was run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stages.models.training import Batch, FitOptions, FitResult, SplitData, fit_loop, split_metrics

if TYPE_CHECKING:
    from stages.core.checkpoint import Checkpointer


# The splits scored at every evaluation: what the selection rules read (val_avg and
# val_worst_group: val; oracle: test_ood, whose pick config.json reports for every model).
SCORED_DURING_TRAINING = ("val", "test_ood")

Scorer = Callable[[torch.Tensor], torch.Tensor]
"""Class scores (n, n_classes) of a batch of raw inputs, used only for selection."""


@dataclass
class GenerativeFitOptions(FitOptions):
    """`training.FitOptions` plus how often (in epochs) the splits are scored for selection."""

    eval_every: int = 5

    @classmethod
    def from_config(cls, cfg: Any) -> GenerativeFitOptions:
        """From a `GenerativeFitConfig` (or a subclass; a namespace without `patience`, as the
        benchmarks build, trains every epoch)."""
        return cls(lr=cfg.lr, epochs=cfg.epochs, batch_size=cfg.batch_size, selection=cfg.selection,
                   weight_decay=cfg.weight_decay, eval_every=cfg.eval_every, patience=getattr(cfg, "patience", 0),
                   min_epochs=getattr(cfg, "min_epochs", 0))


def fit_generative(
    model: torch.nn.Module,
    splits: Mapping[str, SplitData],
    batch_loss: Callable[[Batch], torch.Tensor],
    scorer: Scorer,
    opts: GenerativeFitOptions,
    generator: torch.Generator,
    desc: str = "train",
    checkpoint: Checkpointer | None = None,
    val_objective: Callable[[SplitData], float] | None = None,
) -> FitResult:
    """Train `model` with `batch_loss` on splits["train"] (x and y); every `eval_every` epochs
    (and at the last) score the SCORED_DURING_TRAINING splits with `scorer` and keep the best
    by `opts.selection`; the selected weights are then scored on the other splits (train,
    test_id), so the result's metrics cover every split and history has their rows only where
    scored.
    After every epoch `val_objective(splits["val"])` (in eval mode) is val's `objective` in
    history: it must be deterministic and draw from no shared RNG (it runs between epochs). With
    `opts.patience`, training stops after the epoch at which the plateau test found it plateaued
    `patience` times in a row (`training.fit_loop`); that epoch is scored.

    `model` is left holding the selected weights (also in the result), in eval mode. With
    `checkpoint`, resumable exactly as `training.fit_classifier` (the loop is
    `training.fit_loop`); `batch_loss` may draw from `generator` (e.g. a denoiser's t and ε),
    whose state the checkpoint carries.
    """
    @torch.no_grad()
    def score(names: list[str]) -> dict[str, dict[str, float]]:
        model.eval()
        return {name: split_metrics(scorer(splits[name].x), splits[name].y, splits[name].g) for name in names}

    # Scoring is the dear part (every class, many draws): each evaluation scores the splits any
    # selection rule reads (val, test_ood: the oracle's choice is reported too), and the
    # selected weights alone are scored on the others once, after the loop.
    during = [name for name in splits if name in SCORED_DURING_TRAINING]

    def evaluate() -> dict[str, dict[str, float]]:
        return score(during)

    @torch.no_grad()
    def objective() -> float:
        model.eval()
        return val_objective(splits["val"])  # type: ignore[misc]

    train = {"x": splits["train"].x, "y": splits["train"].y}
    result = fit_loop(model, splits, train, batch_loss, evaluate, opts, generator, desc=desc, checkpoint=checkpoint,
                      eval_every=opts.eval_every,
                      val_objective=objective if val_objective is not None and "val" in splits else None)
    model.load_state_dict(result.state_dict)
    rest = [name for name in splits if name not in during]
    if rest:
        result.selected_metrics = {**result.selected_metrics, **score(rest)}
    model.eval()
    return result


def class_counts(y: np.ndarray | torch.Tensor, n_classes: int) -> torch.Tensor:
    """Examples per class (int64, (n_classes,)); ValueError if a label is out of range or a class is missing."""
    counts = torch.bincount(torch.as_tensor(np.asarray(y), dtype=torch.int64), minlength=n_classes)
    if len(counts) > n_classes:
        raise ValueError(f"labels go up to {len(counts) - 1} but n_classes is {n_classes}")
    missing = [k for k in range(n_classes) if counts[k] == 0]
    if missing:
        raise ValueError(f"class(es) {missing} have no training examples")
    return counts


def log_priors(y: np.ndarray | torch.Tensor, n_classes: int) -> torch.Tensor:
    """log π_y from label counts (float64); every class must occur (ValueError otherwise)."""
    counts = class_counts(y, n_classes)
    return torch.log(counts.double() / counts.sum())


def logsumexp_np(scores: np.ndarray) -> np.ndarray:
    """log Σ_y exp(scores[:, y]) in float64, row-wise."""
    s = np.asarray(scores, dtype=np.float64)
    m = s.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))[:, 0]


LOG_2PI = math.log(2 * math.pi)
