"""The one minibatch training loop, its losses, per-epoch evaluation and checkpoint selection.

`fit_loop` is the only epoch / selection / checkpoint loop: the discriminative methods and
distill reach it through `fit_classifier` (a loss on class logits), the trained generative
classifiers through `generative.fit_generative` (the model's own likelihood loss, scored
every `eval_every` epochs); pretrain's denoising autoencoder calls the inner `run_epoch`
with its own reconstruction loss.

`TrainJob` is what the train stage hands a method's registered `train` function, `Trained`
what the function returns (stages/core/registry.py).

History (`artifacts.HISTORY_SCHEMA`): after every epoch (1..epochs) there is a row for train
and val with `objective`, the value of the model's training objective: on train the mean of
the epoch's minibatch losses (what the optimiser minimised, during the epoch), on val the same
objective on the whole split at the end of the epoch, deterministic and without side effects
(`held_out`; classifiers take it from the val logits the epoch's scoring computes anyway, the
generative models pass a `val_objective`: one pass, no per-class scoring). On the epochs the
model is scored (every epoch for the classifiers, every `eval_every` for the generative ones)
every split present has a row with `loss`, the mean cross-entropy of the labels (whatever the
training objective), `acc` the accuracy, `worst_group_acc` the lowest accuracy over the
groups that occur in the split; those columns are null on a row of an unscored epoch, and
`objective` is null on the test splits. `convergence` turns the val objective curve into the
under-training flag (docs/metrics.md). A checkpoint is chosen by a named criterion:

    val_avg          best val accuracy                  (no group labels needed)
    val_worst_group  best val worst-group accuracy      (uses validation groups)
    oracle           best test_ood worst-group accuracy (uses test groups; report only)

A non-finite loss stops training at its first occurrence (`NonFiniteLoss`: the epoch and batch;
the stage adds the key to change, e.g. method.<name>.lr), before the optimiser steps on it, as do
non-finite weights at the end of an epoch; `fit_loop` then deletes the stage's checkpoints (a
resume would only diverge again) and no output is written.

Ties go to the earlier epoch. The selected state_dict is kept in memory; with a
`stages.core.checkpoint.Checkpointer` the whole loop state (model, optimiser, loss state, RNGs,
history, best-so-far) is also written every few epochs and on SIGINT/SIGTERM, and a re-run
resumes from it with byte-identical results — for every model trained through `fit_loop`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from stages.core.artifacts import SPLITS, Prepared, prepared_path, read_prepared
from stages.core.io import ArtifactError, StageInterrupted, fault_point
from stages.core.runtime import progress
from stages.models.history import (
    SELECTION_METRIC,
    convergence,
    history_rows,
    history_table,
    plateau_stop,
    selection_summary,
    val_objective_curve,
)
from stages.models.nets import model_device, place

if TYPE_CHECKING:
    from stages.core.checkpoint import Checkpoint, Checkpointer
    from stages.core.stream import PreparedFile, StreamSplit
    from stages.models.nets import Standardize

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]
"""A training objective: (logits of a batch, the batch's tensors) -> scalar loss."""
Sampler = Callable[[torch.Generator], torch.Tensor]
"""An epoch's rows of train, drawn with the loop's generator: int64 positions in the split, repeats
allowed, in the order they are trained on (e.g. `robust.group_balanced_sampler`, JTT's copies).
Without one an epoch is one seeded permutation of the rows. A streamed split trains on the same
rows, in its own windowed shuffle (`_batches`)."""

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

    def x_batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """The split's inputs in order, `batch_size` rows at a time (as `stream.StreamSplit`)."""
        for i in range(0, len(self), batch_size):
            yield self.x[i : i + batch_size]


Split = Union[SplitData, "StreamSplit"]
"""A split in memory, or read in row groups (`runtime.stream`; stages/core/stream.py): both give
`len`, `y`, `g`, `extra` and `x_batches`; `fit_loop` trains on either."""


def split_data(prepared: Prepared | PreparedFile) -> dict[str, Split]:
    """The prepared splits as tensors, in `SPLITS` order; empty splits are left out. A file opened
    for streaming (`runtime.stream`) gives its splits as streams (stages/core/stream.py)."""
    from stages.core.stream import PreparedFile

    if isinstance(prepared, PreparedFile):
        return dict(prepared.splits(SPLITS))
    out: dict[str, Split] = {}
    for name in SPLITS:
        m = prepared.mask(name)
        if m.any():
            out[name] = SplitData(
                x=torch.from_numpy(np.ascontiguousarray(prepared.x[m], dtype=np.float32)),
                y=torch.from_numpy(prepared.y[m].astype(np.int64)),
                g=torch.from_numpy(prepared.g[m].astype(np.int64)),
            )
    return out


def train_standardize(prepared: Prepared | PreparedFile) -> Standardize:
    """Input standardisation fitted on the train split: in memory, or in one pass over the stream."""
    from stages.core.runtime import current
    from stages.core.stream import PreparedFile, batch_rows, to_input
    from stages.models.nets import Standardize

    in_dim = int(np.prod(prepared.shape))
    if isinstance(prepared, PreparedFile):
        split = prepared.splits(["train"])["train"]
        rows = batch_rows(in_dim, 4096, itemsize=8)  # fit_batches works in float64
        return Standardize(in_dim).fit_batches(to_input(x) for x in split.x_batches(rows, current().workers))
    return Standardize(in_dim).fit(torch.from_numpy(prepared.subset("train").x))


def read_prepared_input(dataset: str, need: tuple[str, ...] = SPLITS, stream: bool = False) -> Prepared | PreparedFile:
    """Read data/prepared/<dataset>.parquet (with `stream`, open it for reading in row groups; its
    `x` values are checked as they are read); a missing file or split names the path and its maker."""
    from stages.core.stream import PreparedFile

    path = prepared_path(dataset)
    if not path.is_file():
        raise ArtifactError(
            f"{path}: prepared data not found; it is made by the prepare stage "
            f"(`python -m stages.prepare {dataset}` or `dvc repro prepare@{dataset}`)"
        )
    prepared = PreparedFile.open(path) if stream else read_prepared(path)
    check_values(prepared, path)
    for name in need:
        if not prepared.mask(name).any():
            raise ArtifactError(f"{path}: split '{name}' has no rows")
    return prepared


def check_values(prepared: Prepared | PreparedFile, path: Any) -> None:
    """The value-level contract training relies on; errors name the file, column and first bad row.

    The validate stage checks all of this and more before training in `dvc repro`; these
    cheap checks keep a hand-run stage from failing deep inside torch instead.
    """
    def bad(column: str, rows: np.ndarray, what: str) -> None:
        idx = np.flatnonzero(rows)
        if len(idx):
            raise ArtifactError(f"{path}: column '{column}' {what} in {len(idx)} row(s), first at row {idx[0]} (id {prepared.id[idx[0]]})")

    _, first, counts = np.unique(prepared.id, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = np.zeros(len(prepared.id), dtype=bool)
        dup[np.setdiff1d(np.arange(len(prepared.id)), first)] = True
        bad("id", dup, "repeats an id")
    bad("y", (prepared.y < 0) | (prepared.y >= prepared.n_classes), f"is outside 0..{prepared.n_classes - 1}")
    bad("a", (prepared.a < 0) | (prepared.a >= prepared.n_attrs), f"is outside 0..{prepared.n_attrs - 1}")
    bad("g", prepared.g != prepared.y * prepared.n_attrs + prepared.a, "differs from y * n_attrs + a")
    if isinstance(prepared, Prepared):  # a streamed file's x is checked row group by row group as it is read
        bad("x", ~np.isfinite(prepared.x).all(axis=1), "has NaN or inf values")


# ---- losses ----------------------------------------------------------------------------------


def cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """ERM: mean cross-entropy of the labels."""
    return F.cross_entropy(logits, batch["y"])


def held_out(loss_fn: LossFn) -> LossFn:
    """The form of a training loss that gives its value on a held-out split (val): the loss's own
    `held_out` method where calling it has side effects (Group DRO's updates its group weights),
    else the loss itself. It reads the split's tensors as a batch: y, g and the split's extras
    (per-example weights "w", teacher logits "teacher"), which the method sets on val as on train.
    """
    return getattr(loss_fn, "held_out", loss_fn)


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
def evaluate_splits(
    model: nn.Module, splits: Mapping[str, Split], batch_size: int = 4096, objective: LossFn | None = None
) -> dict[str, dict[str, float]]:
    """`split_metrics` of `model` on every split (eval mode, no gradients); with `objective` (a
    `held_out` loss), val's metrics also hold "objective", its value on val's logits.

    Batches go to the model's device under the runtime's autocast; logits come back as float32
    on the CPU (both no-ops in the default CPU fp32 run)."""
    from stages.core.runtime import current
    from stages.core.stream import batch_rows, to_input

    rt, device = current(), model_device(model)
    was_training = model.training
    model.eval()
    try:
        out = {}
        for name, s in splits.items():
            with rt.autocast(on=device):
                rows = batch_rows(s.x.shape[1] if isinstance(s, SplitData) else s.file.dim, batch_size)
                logits = torch.cat([model(to_input(x, device)).float().cpu() for x in s.x_batches(rows)])
            out[name] = split_metrics(logits, s.y, s.g)
            if objective is not None and name == "val":
                out[name]["objective"] = float(objective(logits, {"y": s.y, "g": s.g, **s.extra}).item())
        return out
    finally:
        model.train(was_training)


# ---- the loop --------------------------------------------------------------------------------


class NonFiniteLoss(ArtifactError):
    """Training diverged: a minibatch loss (or, after an epoch, a weight) is NaN or inf.

    `run_epoch` raises it with the value and the 1-based batch; `fit_loop` (or the stage's own
    epoch loop) sets `epoch`, and the stage `where` (its DVC name) and `key` (the learning-rate
    key to change) before it reaches the user as one line.
    """

    def __init__(self, value: float, batch: int, what: str = "loss") -> None:
        super().__init__(what)
        self.value, self.batch, self.what = value, batch, what
        self.epoch: int | None = None
        self.where = ""
        self.key = ""
        self.lr: float | None = None
        self.checkpoints_deleted = False

    def __str__(self) -> str:
        where = f"{self.where}: " if self.where else ""
        at = f"epoch {self.epoch}, batch {self.batch}" if self.epoch is not None else f"batch {self.batch}"
        change = f"lower {self.key}" + (f" (now {self.lr:g})" if self.lr is not None else "") if self.key else "lower the learning rate"
        kept = " and this run's checkpoints were deleted" if self.checkpoints_deleted else ""
        return (
            f"{where}non-finite {self.what} ({self.value}) at {at}; training diverged: {change} and run again "
            f"(no output was written{kept})"
        )


@dataclass
class FitOptions:
    """Optimisation and selection settings of `fit_loop` (any minibatch-trained method, distill)."""

    lr: float
    epochs: int
    batch_size: int
    selection: str = "val_avg"
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # stages.core.schema.OPTIMIZERS
    momentum: float = 0.9  # sgd only
    patience: int = 0  # stop on the plateau test after this many plateaued epochs in a row (0: run every epoch)
    min_epochs: int = 0  # never stop on the plateau test before this epoch (a minimum budget)

    @classmethod
    def from_config(cls, cfg: Any) -> FitOptions:
        """From an ErmConfig / GroupDROConfig / DistillConfig (DistillConfig has no weight decay;
        configs without `optimizer` train with AdamW)."""
        return cls(
            lr=cfg.lr,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            selection=cfg.selection,
            weight_decay=getattr(cfg, "weight_decay", 0.0),
            optimizer=getattr(cfg, "optimizer", "adamw"),
            momentum=getattr(cfg, "momentum", 0.9),
        )


def make_optimizer(params: Any, opts: FitOptions) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay), or SGD with momentum and weight decay as an L2 term (torch's
    SGD, as the GroupDRO/JTT/DFR code trains its ResNet-50s)."""
    if opts.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opts.lr, momentum=opts.momentum, weight_decay=opts.weight_decay)
    return torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)


@dataclass
class FitResult:
    """The selected checkpoint, its epoch and metrics, the full per-epoch history, the weights of
    the last epoch run (`final_state_dict`), the epoch budget and why training ended (`stopped`:
    "budget", every epoch allowed was run; "plateau", `history.plateau_stop` ended it)."""

    state_dict: dict[str, torch.Tensor]
    selected_epoch: int
    selected_metrics: dict[str, dict[str, float]]
    history: pa.Table
    final_state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    budget: int = 0
    stopped: str = "budget"


def run_epoch(
    data: Mapping[str, torch.Tensor],
    batch_loss: Callable[[Batch], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    generator: torch.Generator,
    sampler: Sampler | None = None,
) -> float:
    """One pass over `data` in a seeded random order (or over the rows `sampler` draws); returns
    the mean batch loss.

    `data` maps names to tensors with the same first dimension; each step receives the
    batch as a dict of the same names. A non-finite batch loss raises `NonFiniteLoss` before the
    optimiser steps on it; so do non-finite weights at the end of the pass (a last step that
    diverged), so no caller ever scores or checkpoints NaN weights.
    """
    from stages.core.runtime import current
    from stages.core.stream import to_input

    rt = current()
    device = optimizer.param_groups[0]["params"][0].device
    scaler = rt.grad_scaler() if device.type == "cuda" else None
    total, steps = 0.0, 0
    for batch in _batches(data, batch_size, generator, sampler):
        batch = {k: to_input(v, device) if k == "x" else v.to(device, non_blocking=True) for k, v in batch.items()}
        with rt.autocast(on=device):
            loss = batch_loss(batch)
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteLoss(value, steps + 1)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        total += value
        steps += 1
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not bool(torch.isfinite(p).all()):
                    bad = p[~torch.isfinite(p)].flatten()[0].item()
                    raise NonFiniteLoss(bad, steps, what="weights")
    return total / max(steps, 1)


def _batches(
    data: Mapping[str, torch.Tensor] | StreamSplit, batch_size: int, generator: torch.Generator, sampler: Sampler | None = None
) -> Iterator[Batch]:
    """One epoch's minibatches: of tensors in memory, one seeded permutation of the rows, or the
    rows `sampler` draws, in its order; of a stream (stages/core/stream.py), its seeded row-group
    and window shuffle — of the rows `sampler` draws, with their repeats, when given (the same
    rows as in memory; their order, like a stream's permutation, is shuffled within windows)."""
    if not isinstance(data, Mapping):
        from stages.core.runtime import current

        rt = current()
        counts = None if sampler is None else torch.bincount(sampler(generator), minlength=len(data)).numpy()
        yield from data.epoch(batch_size, generator, rt.shuffle_buffer, rt.workers, counts=counts)
        return
    n = len(next(iter(data.values())))
    order = torch.randperm(n, generator=generator) if sampler is None else sampler(generator)
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        yield {k: v[idx] for k, v in data.items()}


def fit_classifier(
    model: nn.Module,
    splits: Mapping[str, Split],
    loss_fn: LossFn,
    opts: FitOptions,
    generator: torch.Generator,
    desc: str = "train",
    checkpoint: Checkpointer | None = None,
    sampler: Sampler | None = None,
) -> FitResult:
    """Train `model` on splits["train"] with `loss_fn`; score every split each epoch; select.

    An epoch is one seeded permutation of train, or the rows `sampler` draws (e.g. GroupDRO's
    group-balanced sampling). `model` is left holding its last-epoch weights; the selected ones
    are in the result.
    With `checkpoint`, training resumes from its latest valid checkpoint, writes one every
    `checkpoint.every` epochs, and on SIGINT/SIGTERM writes one and raises StageInterrupted
    (see `fit_loop`). A `loss_fn` with `state_dict` (e.g. Group DRO's group weights) has its state checkpointed.
    """
    def step(batch: Batch) -> torch.Tensor:
        return loss_fn(model(batch["x"]), batch)

    def evaluate() -> dict[str, dict[str, float]]:
        return evaluate_splits(model, splits, objective=held_out(loss_fn))

    train = splits["train"]
    return fit_loop(
        model, splits, train.tensors() if isinstance(train, SplitData) else train, step, evaluate, opts, generator,
        desc=desc, checkpoint=checkpoint, loss_state=loss_fn if hasattr(loss_fn, "state_dict") else None, sampler=sampler,
    )


def fit_loop(
    model: nn.Module,
    splits: Mapping[str, Split],
    train: Mapping[str, torch.Tensor] | StreamSplit,
    step: Callable[[Batch], torch.Tensor],
    evaluate: Callable[[], dict[str, dict[str, float]]],
    opts: FitOptions,
    generator: torch.Generator,
    desc: str = "train",
    checkpoint: Checkpointer | None = None,
    eval_every: int = 1,
    loss_state: Any = None,
    val_objective: Callable[[], float] | None = None,
    sampler: Sampler | None = None,
) -> FitResult:
    """The one epoch / selection / checkpoint loop of every trained model (classifiers and generative).

    Each epoch runs `run_epoch(train, step, ...)` (`opts.optimizer` over `model`, batches drawn with
    `generator`; `train` is the split's tensors, or a `stream.StreamSplit`); the model runs on
    the runtime's device if it can (`place`), under its autocast; every `eval_every` epochs and at the last one `evaluate()` gives the
    metrics of every split (one history row each) and the best epoch by `opts.selection`
    is kept (ties to the earlier epoch). `model` is left holding its last-epoch weights in
    train mode; the selected ones are in the result.

    Every epoch records the training objective (module docstring): on train the epoch's mean
    minibatch loss, on val the "objective" `evaluate()` put in val's metrics, else (an
    unscored epoch, or an `evaluate` that gives none) `val_objective()`, which must be
    deterministic and leave every RNG alone; without either, val's objective is null.

    An epoch trains on the rows `sampler` draws when given (`Sampler`; it draws from `generator`,
    so a resumed run draws the same rows). With `opts.patience` > 0 training stops early, after
    the first epoch at which `history.plateau_stop` finds the val objective plateaued for
    `patience` epochs in a row (the plateau test of the under-training flag, so a model stopped
    there is not flagged); that epoch is scored like the last one. `opts.epochs` is then a budget.

    With `checkpoint`, training resumes from its latest valid checkpoint, writes one every
    `checkpoint.every` epochs (scored or not), and on SIGINT/SIGTERM writes one and raises
    StageInterrupted. A checkpoint holds model, optimiser, `loss_state` (an object with
    state_dict/load_state_dict, e.g. Group DRO's loss; None if the loss keeps no state), the RNGs
    (torch's global one, `generator`, Python's, numpy's), history and best so far — all a
    step or `evaluate` may consume, so a resumed run is byte-identical. `step` and `evaluate`
    must not draw from any other stateful RNG (a generative scorer seeds its own generator
    afresh on every call, so it needs nothing saved).
    """
    from stages.core.checkpoint import StopRequest, stop_requests

    split_name, metric = SELECTION_METRIC[opts.selection]
    if split_name not in splits:
        raise ArtifactError(f"selection '{opts.selection}' needs split '{split_name}', which has no rows")
    place(model)
    optimizer = make_optimizer(model.parameters(), opts)
    rows: list[dict[str, Any]] = []
    best: _Best | None = None
    start = 1
    if checkpoint is not None:
        ckpt = checkpoint.latest()
        if ckpt is not None:
            try:
                rows, best = _restore(ckpt, model, optimizer, loss_state, generator)
                start = ckpt.epoch + 1
            except ArtifactError as e:
                checkpoint.say(f"ignoring checkpoint {ckpt.path}: {e}")
                ckpt = None
        if ckpt is None:
            checkpoint.start_fresh()

    def save(epoch: int) -> str:
        assert checkpoint is not None
        return str(checkpoint.save(epoch, *_loop_state(model, optimizer, loss_state, generator, rows, best)))

    with stop_requests() if checkpoint is not None else nullcontext(StopRequest()) as stop:
        stopped = "budget"
        # A checkpoint written at the epoch the plateau test stopped on: that run is complete.
        if (opts.patience and 1 < start <= opts.epochs and start - 1 >= opts.min_epochs
                and plateau_stop(val_objective_curve(rows), opts.patience)):
            stopped, start = "plateau", opts.epochs + 1
        bar = progress(range(start, opts.epochs + 1), desc=desc, total=opts.epochs - start + 1, unit="epoch")
        for epoch in bar:
            model.train()
            try:
                loss = run_epoch(train, step, optimizer, opts.batch_size, generator, sampler)
            except NonFiniteLoss as e:
                e.epoch = epoch
                if checkpoint is not None:  # resuming would diverge again: start over next time
                    checkpoint.clear()
                    e.checkpoints_deleted = True
                raise
            objective: dict[str, float | None] = {"train": loss}
            scored = epoch % eval_every == 0 or epoch == opts.epochs
            metrics = evaluate() if scored else {}
            if "val" in splits:
                given = metrics["val"].pop("objective", None) if "val" in metrics else None
                objective["val"] = given if given is not None else val_objective() if val_objective is not None else None
            if opts.patience and objective.get("val") is not None and opts.min_epochs <= epoch < opts.epochs:
                curve = [*val_objective_curve(rows), objective["val"]]
                if plateau_stop(curve, opts.patience):
                    stopped = "plateau"
                    if not scored:  # the last epoch run is always scored (selection, history)
                        scored, metrics = True, evaluate()
                        metrics.get("val", {}).pop("objective", None)
            rows += history_rows(epoch, metrics, objective)
            status = [f"loss {objective['train']:.4f}"]
            if "val" in metrics:
                val = metrics["val"]
                status.append(f"val acc {val['acc']:.3f}, worst-group {val['worst_group_acc']:.3f}")
            bar.set_postfix_str(", ".join(status), refresh=False)
            if scored:
                score = metrics[split_name][metric]
                if best is None or score > best[0]:
                    best = (score, epoch, copy.deepcopy(model.state_dict()), metrics)
            saved = checkpoint is not None and checkpoint.due(epoch) and bool(save(epoch))
            fault_point("after_epoch", epoch)
            if stopped == "plateau":
                break
            if stop.requested and epoch < opts.epochs and checkpoint is not None:
                path = checkpoint.files()[0] if saved else save(epoch)
                raise StageInterrupted(
                    f"stopped by {stop.name} after epoch {epoch}/{opts.epochs}; checkpoint {path} "
                    f"written: run the same command (or `dvc repro`) again to resume from it "
                    f"(train.resume=false starts over)",
                    exit_code=stop.exit_code,
                )
    assert best is not None  # epochs >= 1 and the last epoch is always scored
    return FitResult(state_dict=best[2], selected_epoch=best[1], selected_metrics=best[3], history=history_table(rows),
                     final_state_dict=copy.deepcopy(model.state_dict()), budget=opts.epochs, stopped=stopped)


_Best = tuple[float, int, dict[str, torch.Tensor], dict[str, dict[str, float]]]
"""Best so far: (selection score, epoch, state_dict, metrics of every split)."""


def _loop_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_state: Any, generator: torch.Generator,
    rows: list[dict[str, Any]], best: _Best | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything `fit_loop` needs to continue: (tensors, JSON meta) for a checkpoint."""
    from stages.core.checkpoint import optimizer_tensors, prefixed, rng_state

    tensors = {**prefixed("model", model.state_dict()), **optimizer_tensors(optimizer)}
    if loss_state is not None:
        tensors.update(prefixed("loss", loss_state.state_dict()))
    rng_tensors, rng_meta = rng_state(generator)
    tensors.update(rng_tensors)
    meta: dict[str, Any] = {"history": rows, "rng": rng_meta, "best": None}
    if best is not None:
        tensors.update(prefixed("best", best[2]))
        meta["best"] = {"score": best[0], "epoch": best[1], "metrics": best[3]}
    return tensors, meta


def _restore(
    ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, loss_state: Any, generator: torch.Generator
) -> tuple[list[dict[str, Any]], _Best | None]:
    """Load a checkpoint into the loop's objects, after checking every tensor fits (else ArtifactError)."""
    from stages.core.checkpoint import load_optimizer, set_rng_state, unprefixed

    t, meta = ckpt.tensors, ckpt.meta
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for prefix in ("model", "best") if meta.get("best") else ("model",):
        expected.update({f"{prefix}.{k}": (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()})
    for i, p in enumerate(model.parameters()):
        if isinstance(optimizer, torch.optim.SGD):
            if optimizer.defaults["momentum"]:
                expected[f"optim.{i}.momentum_buffer"] = (tuple(p.shape), p.dtype)
            continue
        expected.update({f"optim.{i}.exp_avg": (tuple(p.shape), p.dtype), f"optim.{i}.exp_avg_sq": (tuple(p.shape), p.dtype),
                         f"optim.{i}.step": ((), torch.float32)})
    if loss_state is not None:
        expected.update({f"loss.{k}": (tuple(v.shape), v.dtype) for k, v in loss_state.state_dict().items()})
    expected["rng.torch"] = (tuple(torch.get_rng_state().shape), torch.uint8)
    expected["rng.generator"] = (tuple(generator.get_state().shape), torch.uint8)
    got = {k: (tuple(v.shape), v.dtype) for k, v in t.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(k for k in got if got[k] != expected[k])
        raise ArtifactError(f"its tensors do not fit this model and optimiser (e.g. {wrong[:3]})")
    try:
        history = [dict(r) for r in meta["history"]]
        best_meta = meta["best"]
        best = None
        if best_meta is not None:
            best = (float(best_meta["score"]), int(best_meta["epoch"]), {k: v.clone() for k, v in unprefixed("best", t).items()},
                    best_meta["metrics"])
        rng = meta["rng"]
        _ = rng["python"][1], rng["numpy"]["state"]["key"]  # complete before anything is loaded
        model.load_state_dict(unprefixed("model", t), strict=True)
        load_optimizer(optimizer, t)
        if loss_state is not None:
            loss_state.load_state_dict(unprefixed("loss", t))
        set_rng_state(generator, t, rng)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"its metadata is incomplete ({e!r})") from None
    return history, best


# ---- the train stage's interface to a method -------------------------------------------------


@dataclass
class TrainJob:
    """One train stage, train@<dataset>-<method>-<seed>, as a method's `train` function sees it."""

    dataset: str
    method: str  # the name under `method:` in params.yaml
    seed: int
    cfg: Any  # the validated config, of the schema the method's kind registered
    prepared: Prepared
    checkpoint_every: int  # the `train` section (stages/core/settings.py TrainConfig)
    resume: bool
    # The params sections the artifacts it reads were made under, by key (`pretrain`,
    # `method.<upstream>`): a reader refuses one whose provenance records other settings.
    built_on: dict[str, Any] = field(default_factory=dict)

    @property
    def desc(self) -> str:
        """Progress-bar label."""
        return f"train {self.method}"

    @property
    def key(self) -> str:
        """The params key of the method's config (for error messages)."""
        return f"method.{self.method}"

    def checkpointer(self, code: list[Any] | None = None) -> Any:
        """The Checkpointer of this stage, fingerprinted by its config, inputs and code
        (resuming never crosses a change of any of them; see stages/core/checkpoint.py)."""
        import dataclasses
        from pathlib import Path

        from stages.core.artifacts import pretrained_dir
        from stages.core.checkpoint import Checkpointer, fingerprint
        from stages.models import ENCODER
        from stages.models.external import local_files

        here = Path(__file__).resolve().parent.parent
        pretrained = getattr(self.cfg, "init", "scratch") == "pretrained"
        inputs = [prepared_path(self.dataset)] + ([pretrained_dir(self.dataset) / ENCODER] if pretrained else [])
        inputs += local_files(self.cfg)  # a network's initial weights, its vocabulary
        code = code or [here / "train.py", here / "models", here / "checkpoint.py", here / "runtime.py"]
        config = {"dataset": self.dataset, "method": self.method, "seed": self.seed, "config": dataclasses.asdict(self.cfg)}
        return Checkpointer(
            stage=f"train@{self.dataset}-{self.method}-{self.seed}",
            fingerprint=fingerprint(config, inputs, code),
            every=self.checkpoint_every,
            resume=self.resume,
        )


@dataclass
class Trained:
    """What a method's `train` returns: the model (holding the weights to save), its metrics
    per split, its history, a few words on how the weights were chosen, the keys it adds to
    config.json (`architecture`, `selection`, ... — see stages/train.py), the checkpoint
    to drop once the model folder is written, and for a model trained by epochs the weights of
    its last epoch (`final`: the train stage writes them beside the selected ones as
    `models.FINAL_WEIGHTS`, the base model DFR's authors re-train the last layer of)."""

    model: Any
    metrics: dict[str, dict[str, float]]
    history: pa.Table
    how: str
    record: dict[str, Any] = field(default_factory=dict)
    checkpoint: Any = None
    final: dict[str, torch.Tensor] | None = None


def epoch_trained(model: Any, result: FitResult, selection: str, checkpoint: Any, **record: Any) -> Trained:
    """A model trained by epochs through `fit_loop`: the epoch `selection` chose, what every
    criterion would have chosen (`selections`), the last epoch run (`final_epoch`, whose weights
    come with it), and the plateau test on what was run (`convergence`, with the budget and why
    training ended)."""

    record.setdefault("architecture", model.arch())
    epochs = max((int(r["epoch"]) for r in result.history.to_pylist()), default=0)
    record.update(selection=selection, selected_epoch=result.selected_epoch, final_epoch=epochs, metrics=result.selected_metrics)
    record.update(selections=selection_summary(result.history),
                  convergence=convergence(result.history, budget=result.budget, stopped=result.stopped))
    how = f"epoch {result.selected_epoch} selected by {selection}"
    if result.stopped == "plateau":
        how += f" (stopped on a plateau of the val objective after {epochs} of {result.budget} epochs)"
    return Trained(model, result.selected_metrics, result.history, how, record, checkpoint, result.final_state_dict or None)


def fitted_once(model: Any, prepared: Prepared, how: str, **record: Any) -> Trained:
    """A model fitted without epochs (closed form, or a head on frozen features): every split
    scored once, history as epoch 0."""
    metrics = {}
    with torch.no_grad():
        for name, s in split_data(prepared).items():
            metrics[name] = split_metrics(model(s.x), s.y, s.g)
    record.setdefault("architecture", model.arch())
    record.setdefault("selected_epoch", 0)
    record["metrics"] = metrics
    history = history_table(history_rows(0, metrics))
    record["convergence"] = convergence(history)
    return Trained(model, metrics, history, how, record)
