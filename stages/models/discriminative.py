"""What the MLP-trained discriminative methods share: their config keys, the network
(fresh, or the pretrained encoder), and one training routine with a pluggable loss.

Each method module (stages/models/<kind>.py) subclasses `MLPFitConfig` and calls
`train_mlp` with its own loss, per-example weights or frozen encoder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.schema import Checks, option, train_and_selection_splits

if TYPE_CHECKING:
    import torch

    from stages.artifacts import Prepared
    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import SplitData, Trained, TrainJob
    from stages.provenance import Expected


@dataclass
class MLPFitConfig:
    """The keys every MLP-trained discriminative method shares (its own schema adds to them)."""

    kind: str = option("method family")
    init: str = option("scratch | pretrained (encoder from the pretrain stage)")
    hidden: list[int] = option("hidden layer widths (ignored with init=pretrained)")
    lr: float = option("Adam learning rate")
    weight_decay: float = option("AdamW weight decay")
    epochs: int = option("training epochs")
    batch_size: int = option("minibatch size")
    selection: str = option("checkpoint selection: val_avg | val_worst_group | oracle")

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split."""
        return train_and_selection_splits(self.selection)

    def check(self, c: Checks) -> None:
        c.choice(self.init, "init", ["scratch", "pretrained"])
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.minibatch(self)


def uses_pretrained(cfg: Any) -> bool:
    """Whether the config starts from the pretrain stage's encoder."""
    return getattr(cfg, "init", "scratch") == "pretrained"


def pretrained_encoder(dataset: str, in_dim: int) -> tuple[Path, Standardize, MLPEncoder]:
    """The pretrain stage's encoder of `dataset`, for `in_dim` inputs: (its path, input
    standardisation, encoder). It must have been pretrained on this dataset's prepared file as
    it is now (its provenance, stages/provenance.py)."""
    from stages import provenance
    from stages.artifacts import pretrained_dir
    from stages.io import ArtifactError
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
    provenance.check_file(path, pretrained_for(dataset))
    return path, standardize, encoder


def pretrained_for(dataset: str) -> Expected:
    """What the pretrain stage's outputs must be for a method training on `dataset`."""
    from stages import provenance
    from stages.artifacts import prepared_path

    return provenance.Expected(dataset, f"pretrain@{dataset}", inputs=(prepared_path(dataset),), verb="pretrained")


def build_mlp(prepared: Prepared, cfg: MLPFitConfig, dataset: str) -> MLPClassifier:
    """An MLPClassifier: fresh encoder (init=scratch) or the pretrained one (init=pretrained)."""
    import torch

    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize

    in_dim = prepared.x.shape[1]
    if cfg.init == "pretrained":
        _, standardize, encoder = pretrained_encoder(dataset, in_dim)
        return MLPClassifier(encoder, prepared.n_classes, standardize)
    standardize = Standardize(in_dim).fit(torch.from_numpy(prepared.subset("train").x))
    return MLPClassifier(MLPEncoder(in_dim, cfg.hidden), prepared.n_classes, standardize)


# A method's hook into `train_mlp`: given the splits and the loop's generator (after seeding),
# set up the loss (and e.g. per-example train weights in splits["train"].extra) and return it
# with the keys it adds to config.json.
LossSetup = Callable[["dict[str, SplitData]", "torch.Generator"], "tuple[Any, dict[str, Any]]"]


def train_mlp(job: TrainJob, setup: LossSetup | None = None, freeze_encoder: bool = False) -> Trained:
    """Train an MLP classifier on `job` with the loss `setup` returns (cross-entropy when None),
    through the shared loop (selection by `cfg.selection`, checkpoint/resume)."""
    from stages.artifacts import pretrained_dir
    from stages.models import ENCODER
    from stages.models.training import (
        FitOptions,
        cross_entropy,
        epoch_trained,
        fit_classifier,
        split_data,
    )
    from stages.runtime import setup_torch

    cfg = job.cfg
    ckpt = job.checkpointer()
    generator = setup_torch(job.seed)
    splits = split_data(job.prepared)
    loss, record = setup(splits, generator) if setup is not None else (cross_entropy, {})
    model = build_mlp(job.prepared, cfg, job.dataset)
    if freeze_encoder:
        model.encoder.requires_grad_(False)
    opts = FitOptions.from_config(cfg)
    result = fit_classifier(model, splits, loss, opts, generator, desc=job.desc, checkpoint=ckpt)
    model.load_state_dict(result.state_dict)
    if uses_pretrained(cfg):
        record["pretrained_encoder"] = str(pretrained_dir(job.dataset) / ENCODER)
    return epoch_trained(model.eval(), result, cfg.selection, ckpt, **record)
