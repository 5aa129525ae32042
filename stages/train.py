"""Train one method on one dataset with one seed and write its model folder.

    python -m stages.train <dataset> <method> <seed> [key=value ...]

Reads data/prepared/<dataset>.parquet and the section `method.<method>` of params.yaml
(its `kind` picks the family: erm | groupdro | lda). erm and groupdro train an MLP with the
shared minibatch loop and keep the epoch chosen by `selection`; lda is fitted in closed form
on the train split. With `init: pretrained` the encoder (architecture and weights, including
its input standardisation) comes from data/pretrained/<dataset>/encoder.safetensors and is
fine-tuned; `hidden` is then ignored. Writes data/models/<dataset>/<method>/seed=<seed>/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from omegaconf import DictConfig

from stages.config import (
    METHOD_SCHEMAS,
    ConfigError,
    ErmConfig,
    GroupDROConfig,
    LDAConfig,
    describe,
    method_config,
    stage_main,
)

if TYPE_CHECKING:
    from stages.artifacts import Prepared
    from stages.models.lda import LDAClassifier
    from stages.models.nets import MLPClassifier
    from stages.models.training import FitResult


def parse_seed(seed: str | int) -> int:
    """The positional seed as an int (ConfigError otherwise)."""
    try:
        return int(seed)
    except ValueError:
        raise ConfigError(f"seed must be an integer, got '{seed}'") from None


def train_lda(
    prepared: Prepared, cfg: LDAConfig, method: str = "lda"
) -> tuple[LDAClassifier, dict[str, dict[str, float]], pa.Table]:
    """Fit LDA on the train split; returns (model, metrics per split, epoch-0 history).

    A singular covariance or a class missing from train is a ConfigError naming `method.<method>`.
    """
    import torch

    from stages.models.lda import fit_lda
    from stages.models.training import history_rows, history_table, split_data, split_metrics

    train = prepared.subset("train")
    try:
        model = fit_lda(train.x, train.y, prepared.n_classes, cfg.shrinkage)
    except ValueError as e:
        raise ConfigError(f"method.{method} (shrinkage {cfg.shrinkage}) on the train split: {e}") from None
    metrics = {}
    with torch.no_grad():
        for name, s in split_data(prepared).items():
            metrics[name] = split_metrics(model(s.x), s.y, s.g)
    return model, metrics, history_table(history_rows(0, metrics))


def build_mlp(prepared: Prepared, cfg: ErmConfig, dataset: str) -> MLPClassifier:
    """An MLPClassifier: fresh encoder (init=scratch) or the pretrained one (init=pretrained)."""
    import torch

    from stages.artifacts import pretrained_dir
    from stages.io import ArtifactError
    from stages.models import ENCODER, load_encoder
    from stages.models.nets import MLPClassifier, MLPEncoder, Standardize

    in_dim = prepared.x.shape[1]
    if cfg.init == "pretrained":
        path = pretrained_dir(dataset) / ENCODER
        if not path.is_file():
            raise ArtifactError(
                f"{path}: pretrained encoder not found; it is made by the pretrain stage "
                f"(`python -m stages.pretrain {dataset}` or `dvc repro pretrain@{dataset}`)"
            )
        standardize, encoder = load_encoder(path)
        if encoder.in_dim != in_dim:
            raise ArtifactError(f"{path}: encoder expects {encoder.in_dim} inputs, the prepared data has {in_dim}")
        return MLPClassifier(encoder, prepared.n_classes, standardize)
    standardize = Standardize(in_dim).fit(torch.from_numpy(prepared.subset("train").x))
    return MLPClassifier(MLPEncoder(in_dim, cfg.hidden), prepared.n_classes, standardize)


def train_mlp(
    prepared: Prepared, cfg: ErmConfig, dataset: str, seed: int, desc: str
) -> tuple[MLPClassifier, FitResult]:
    """Train an erm/groupdro MLP; returns (model holding the selected weights, FitResult)."""
    from stages.models.training import (
        FitOptions,
        GroupDROLoss,
        cross_entropy,
        fit_classifier,
        split_data,
    )
    from stages.runtime import setup_torch

    generator = setup_torch(seed)
    model = build_mlp(prepared, cfg, dataset)
    loss = GroupDROLoss(prepared.n_groups, cfg.eta) if isinstance(cfg, GroupDROConfig) else cross_entropy
    result = fit_classifier(model, split_data(prepared), loss, FitOptions.from_config(cfg), generator, desc=desc)
    model.load_state_dict(result.state_dict)
    return model.eval(), result


def run(params: DictConfig, dataset: str, method: str, seed: str) -> str:
    from stages.artifacts import model_dir, prepared_path, pretrained_dir
    from stages.models import ENCODER, save_model
    from stages.models.training import read_prepared_input

    seed_i = parse_seed(seed)
    cfg = method_config(params, method)
    prepared = read_prepared_input(dataset)
    record: dict[str, Any] = {
        "dataset": dataset,
        "method": method,
        "seed": seed_i,
        "config": dataclasses.asdict(cfg),
        "prepared": str(prepared_path(dataset)),
    }
    out = model_dir(dataset, method, seed_i)
    if isinstance(cfg, LDAConfig):
        model, metrics, history = train_lda(prepared, cfg, method)
        record.update(architecture=model.arch(), selection=None, selected_epoch=0, metrics=metrics)
        save_model(out, model, record, history)
        how = "closed form"
    else:
        model, result = train_mlp(prepared, cfg, dataset, seed_i, desc=f"train {method}")
        metrics = result.selected_metrics
        record.update(architecture=model.arch(), selection=cfg.selection, selected_epoch=result.selected_epoch, metrics=metrics)
        if cfg.init == "pretrained":
            record["pretrained_encoder"] = str(pretrained_dir(dataset) / ENCODER)
        save_model(out, model, record, result.history)
        how = f"epoch {result.selected_epoch} selected by {cfg.selection}"
    val = metrics["val"]
    return (
        f"trained {method} on {dataset} seed {seed_i}: {how} "
        f"(val acc {val['acc']:.2f}, val worst-group {val['worst_group_acc']:.2f}) -> {Path(out)}"
    )


def _help() -> str:
    return "\n".join(f"with kind: {kind}\n" + describe(schema, "method.<name>") for kind, schema in METHOD_SCHEMAS.items())


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("train", __doc__, ["dataset", "method", "seed"], _help, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
