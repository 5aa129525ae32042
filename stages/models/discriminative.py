"""What the MLP-trained discriminative methods share: their config keys, the network
(an MLP, fresh or from the pretrained encoder; or, on image datasets, a timm backbone), and
one training routine with a pluggable loss.

Each method module (stages/models/<kind>.py) subclasses `MLPFitConfig` and calls
`train_mlp` with its own loss, per-example weights or frozen encoder. `backbone: mlp` (every
default) keeps the hand-written MLP; a timm model name trains that network instead, through
the same loop, from random initialisation or from a local `weights` file
(stages/models/backbone.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.core.schema import OPTIMIZERS, Checks, option, train_and_selection_splits
from stages.models.timm_catalog import MLP, name_problem

if TYPE_CHECKING:
    import torch
    from torch import nn

    from stages.core.artifacts import Prepared
    from stages.core.provenance import Expected
    from stages.core.stream import PreparedFile
    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import SplitData, Trained, TrainJob


@dataclass
class MLPFitConfig:
    """The keys every MLP-trained discriminative method shares (its own schema adds to them)."""

    kind: str = option("method family")
    init: str = option("scratch | pretrained (the pretrain stage's MLP encoder; backbone=mlp only)")
    backbone: str = option(
        "the network: mlp (standardise -> MLP of `hidden` widths -> linear head) | a timm model name, "
        "e.g. resnet18, resnet50, vit_small_patch16_224 (image datasets only; stages/models/backbone.py)"
    )
    weights: str | None = option(
        "a timm backbone's weights: a local .safetensors file (absolute, or relative to the project root) of its "
        "timm state_dict (the head is not loaded; inputs are then normalised with the weights' mean/std); "
        "null = random initialisation"
    )
    hidden: list[int] = option("hidden layer widths of the MLP (ignored with init=pretrained or a timm backbone)")
    optimizer: str = option(
        "adamw | sgd (with `momentum`, weight decay as an L2 term: the optimiser of the GroupDRO, JTT and DFR "
        "code for their ResNet-50 recipes)"
    )
    momentum: float = option("sgd's momentum (ignored by adamw)")
    lr: float = option("learning rate")
    weight_decay: float = option("weight decay (AdamW's decoupled decay; SGD's L2 term)")
    epochs: int = option("training epochs")
    batch_size: int = option("minibatch size")
    selection: str = option("checkpoint selection: val_avg | val_worst_group | oracle")

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split."""
        return train_and_selection_splits(self.selection)

    def model_kind(self) -> str:
        """The model kind this config trains and saves (`registry.register_model`): `mlp`
        (stages/models/mlp.py), or `backbone` for a timm backbone (stages/models/backbone.py)."""
        return MLP if self.backbone == MLP else "backbone"

    def check(self, c: Checks) -> None:
        c.choice(self.init, "init", ["scratch", "pretrained"])
        c.choice(self.optimizer, "optimizer", list(OPTIMIZERS))
        c.require(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.minibatch(self)
        if self.backbone == MLP:
            c.require(self.weights is None, "weights", f"only a timm backbone loads weights: set backbone to a timm model name, or weights to null (got '{self.weights}')")
            return
        problem = name_problem(self.backbone)
        c.require(problem is None, "backbone", problem or "")
        c.require(
            self.init != "pretrained", "init",
            f"'pretrained' starts from the pretrain stage's MLP encoder, which the timm backbone '{self.backbone}' "
            "cannot use: set init=scratch (and `weights` for the backbone's own pretrained weights), or backbone=mlp",
        )
        c.require(self.weights is None or bool(str(self.weights).strip()), "weights", "must name a .safetensors file, or be null")


def uses_pretrained(cfg: Any) -> bool:
    """Whether the config starts from the pretrain stage's encoder."""
    return getattr(cfg, "init", "scratch") == "pretrained"


def pretrained_encoder(dataset: str, in_dim: int, config: Any = None) -> tuple[Path, Standardize, MLPEncoder]:
    """The pretrain stage's encoder of `dataset`, for `in_dim` inputs: (its path, input
    standardisation, encoder). It must have been pretrained on this dataset's prepared file as
    it is now (its provenance, stages/core/provenance.py), and under `config` (the `pretrain`
    section the reader runs with) when given."""
    from stages.core import provenance
    from stages.core.artifacts import pretrained_dir
    from stages.core.io import ArtifactError
    from stages.models import ENCODER, load_encoder

    path = pretrained_dir(dataset) / ENCODER
    if not path.is_file():
        raise ArtifactError(
            f"{path}: pretrained encoder not found; it is made by the pretrain stage "
            f"(`python -m stages.pretrain {dataset}` or `dvc repro pretrain@{dataset}`)"
        )
    standardize, encoder = load_encoder(path)
    if encoder.in_dim != in_dim:
        raise ArtifactError(f"{path}: encoder expects {encoder.in_dim} inputs, the prepared data has {in_dim}")
    provenance.check_file(path, pretrained_for(dataset, config))
    return path, standardize, encoder


def pretrained_for(dataset: str, config: Any = None) -> Expected:
    """What the pretrain stage's outputs must be for a method training on `dataset` (made under
    `config`, the `pretrain` section it runs with, when given)."""
    from stages.core import provenance
    from stages.core.artifacts import prepared_path

    return provenance.Expected(dataset, f"pretrain@{dataset}", inputs=(prepared_path(dataset),), verb="pretrained",
                               config=config, config_key="pretrain")


def build_classifier(job: TrainJob) -> tuple[nn.Module, dict[str, Any]]:
    """The network `job.cfg` configures, untrained (its head at least), and the keys it adds to
    config.json: the MLP (`build_mlp`) for backbone=mlp; else the timm backbone, with `weights`
    loaded when given (stages/models/backbone.py: `backbone`, `weights: {path, sha256}`)."""
    cfg = job.cfg
    if cfg.backbone == MLP:
        return build_mlp(job.prepared, cfg, job.dataset, job.built_on.get("pretrain")), {}
    from stages.models.backbone import build

    return build(job.prepared, cfg.backbone, cfg.weights, job.key)


def check_input(job: TrainJob) -> None:
    """ConfigError, before any work, when the configured network cannot read the prepared inputs
    (a timm backbone on a dataset that is not images)."""
    if job.cfg.backbone != MLP:
        from stages.models.backbone import image_shape

        image_shape(job.prepared, job.cfg.backbone, job.key)


def build_mlp(prepared: Prepared | PreparedFile, cfg: MLPFitConfig, dataset: str, pretrain: Any = None) -> MLPClassifier:
    """An MLPClassifier: fresh encoder (init=scratch) or the pretrained one (init=pretrained; made
    under `pretrain`, the section the stage runs with, when given)."""
    import numpy as np

    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder
    from stages.models.training import train_standardize

    in_dim = int(np.prod(prepared.shape))
    if cfg.init == "pretrained":
        _, standardize, encoder = pretrained_encoder(dataset, in_dim, pretrain)
        return MLPClassifier(encoder, prepared.n_classes, standardize)
    return MLPClassifier(MLPEncoder(in_dim, cfg.hidden), prepared.n_classes, train_standardize(prepared))


@dataclass
class Plan:
    """What a method's setup hands `train_mlp`: the loss, the keys it adds to config.json, and the
    rows an epoch trains on (`training.Sampler`; None: one permutation of train per epoch)."""

    loss: Any
    record: dict[str, Any] = field(default_factory=dict)
    sampler: Any = None


# A method's hook into `train_mlp`: given the splits and the loop's generator (after seeding),
# set up the loss (and e.g. per-example train weights in splits["train"].extra) and return it
# as a `Plan`.
LossSetup = Callable[["dict[str, SplitData]", "torch.Generator"], Plan]


def train_mlp(job: TrainJob, setup: LossSetup | None = None, freeze_encoder: bool = False) -> Trained:
    """Train the classifier `job.cfg` configures (`build_classifier`: the MLP, or a timm
    backbone) on `job` with the loss and sampler of the `Plan` `setup` returns (cross-entropy,
    each epoch one permutation of train, when None), through the shared loop (selection by
    `cfg.selection`, checkpoint/resume)."""
    from stages.core.artifacts import pretrained_dir
    from stages.core.runtime import setup_torch
    from stages.models import ENCODER
    from stages.models.training import (
        FitOptions,
        cross_entropy,
        epoch_trained,
        fit_classifier,
        split_data,
    )

    cfg = job.cfg
    check_input(job)
    ckpt = job.checkpointer()
    generator = setup_torch(job.seed)
    splits = split_data(job.prepared)
    plan = setup(splits, generator) if setup is not None else Plan(cross_entropy)
    record = dict(plan.record)
    model, built = build_classifier(job)
    record.update(built)
    if freeze_encoder:
        model.encoder.requires_grad_(False)
    opts = FitOptions.from_config(cfg)
    result = fit_classifier(model, splits, plan.loss, opts, generator, desc=job.desc, checkpoint=ckpt, sampler=plan.sampler)
    model.load_state_dict(result.state_dict)
    if uses_pretrained(cfg):
        record["pretrained_encoder"] = str(pretrained_dir(job.dataset) / ENCODER)
    return epoch_trained(model.eval(), result, cfg.selection, ckpt, **record)
