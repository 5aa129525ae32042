"""Train one method on one dataset with one seed and write its model folder.

    python -m stages.train <dataset> <method> <seed> [key=value ...]

Reads data/prepared/<dataset>.parquet and the section `method.<method>` of params.yaml
(its `kind` picks the family). erm, groupdro, reweight, jtt and probe train an MLP with the
shared minibatch loop and keep the epoch chosen by `selection`; lda and qda are fitted in
closed form on the train split; diffusion and autoregressive (generative classifiers) train
with `stages.models.generative.fit_generative` (the same loop, `training.fit_loop`, with the
model's own likelihood loss) and the same selection criteria; text_erm (a
bag-of-embeddings classifier over the `text` column's word tokens, stages/models/text_classifier.py) trains
with the shared loop like erm and needs a text dataset; dfr fits a linear head on the pretrained embeddings of val only. With
`init: pretrained` the encoder (architecture and weights, including its input
standardisation) comes from data/pretrained/<dataset>/encoder.safetensors and is fine-tuned
(frozen for probe and dfr); `hidden` is then ignored. Writes data/models/<dataset>/<method>/seed=<seed>/.

config.json records, besides the resolved config, `reads_splits` (the splits whose rows can
change the weights; tests/test_robust.py poisons every other split and checks the weights do
not move), `selections` (the epoch and metrics each criterion val_avg / val_worst_group /
oracle would pick; only `selection` chose the weights) and, via `save_model`, `inference_cost`.

Every method trained by epochs (erm, groupdro, reweight, jtt, probe, text_erm, diffusion and
autoregressive; not jtt's short identification run) writes a checkpoint to
scratch/checkpoints/train@<dataset>-<method>-<seed>/ every `train.checkpoint_every` epochs
and when stopped by SIGINT/SIGTERM; running the same
command again resumes from it (byte-identical result) unless `train.resume=false`. The
checkpoint is deleted once the model folder is written (see stages/checkpoint.py).
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
    SELECTION_SPLIT,
    AutoregressiveConfig,
    ConfigError,
    DFRConfig,
    DiffusionConfig,
    ErmConfig,
    GroupDROConfig,
    JTTConfig,
    LDAConfig,
    ProbeConfig,
    QDAConfig,
    ReweightConfig,
    TextErmConfig,
    TrainConfig,
    check_text_input,
    describe,
    method_config,
    section,
    stage_main,
)

if TYPE_CHECKING:
    from stages.artifacts import Prepared
    from stages.checkpoint import Checkpointer
    from stages.models.lda import LDAClassifier
    from stages.models.nets import MLPClassifier
    from stages.models.training import FitResult


def parse_seed(seed: str | int) -> int:
    """The positional seed as an int (ConfigError otherwise)."""
    try:
        return int(seed)
    except ValueError:
        raise ConfigError(f"seed must be an integer, got '{seed}'") from None


def reads_splits(cfg: Any) -> tuple[str, ...]:
    """The splits whose rows can change a method's fitted weights (its `reads_splits()`, or
    train plus the selection split for a config that does not declare them)."""
    declared = getattr(cfg, "reads_splits", None)
    if callable(declared):
        return tuple(declared())
    selection = getattr(cfg, "selection", None)
    return tuple(dict.fromkeys(("train", SELECTION_SPLIT[selection]))) if selection else ("train",)


def train_lda(
    prepared: Prepared, cfg: LDAConfig, method: str = "lda"
) -> tuple[LDAClassifier, dict[str, dict[str, float]], pa.Table]:
    """Fit LDA on the train split; returns (model, metrics per split, epoch-0 history).

    A singular covariance or a class missing from train is a ConfigError naming `method.<method>`.
    """
    import torch

    from stages.models.lda import fit_lda, fit_qda
    from stages.models.training import history_rows, history_table, split_data, split_metrics

    train = prepared.subset("train")
    fit = fit_qda if isinstance(cfg, QDAConfig) else fit_lda
    try:
        model = fit(train.x, train.y, prepared.n_classes, cfg.shrinkage)
    except ValueError as e:
        raise ConfigError(f"method.{method} (shrinkage {cfg.shrinkage}) on the train split: {e}") from None
    metrics = {}
    with torch.no_grad():
        for name, s in split_data(prepared).items():
            metrics[name] = split_metrics(model(s.x), s.y, s.g)
    return model, metrics, history_table(history_rows(0, metrics))


def train_generative(
    prepared: Prepared, cfg: DiffusionConfig | AutoregressiveConfig, method: str, seed: int,
    checkpoint: Checkpointer | None = None,
) -> tuple[Any, FitResult]:
    """Train a diffusion or autoregressive classifier (stages/models/diffusion.py, autoregressive.py).

    A config that does not fit the data (e.g. pruning more classes than it has) is a
    ConfigError naming the key, raised before any training. With `checkpoint`, resumable as erm.
    """
    if isinstance(cfg, DiffusionConfig):
        from stages.models.diffusion import train_diffusion

        cfg.check_data(f"method.{method}", prepared.n_classes)
        return train_diffusion(prepared, cfg, seed, desc=f"train {method}", checkpoint=checkpoint)
    from stages.models.autoregressive import train_autoregressive

    return train_autoregressive(prepared, cfg, seed, desc=f"train {method}", checkpoint=checkpoint)


def pretrained_encoder(dataset: str):
    """The pretrain stage's encoder of `dataset`: (its path, input standardisation, encoder)."""
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
    return path, standardize, encoder


def build_mlp(prepared: Prepared, cfg: ErmConfig, dataset: str) -> MLPClassifier:
    """An MLPClassifier: fresh encoder (init=scratch) or the pretrained one (init=pretrained)."""
    import torch

    from stages.io import ArtifactError
    from stages.models.nets import MLPClassifier, MLPEncoder, Standardize

    in_dim = prepared.x.shape[1]
    if cfg.init == "pretrained":
        path, standardize, encoder = pretrained_encoder(dataset)
        if encoder.in_dim != in_dim:
            raise ArtifactError(f"{path}: encoder expects {encoder.in_dim} inputs, the prepared data has {in_dim}")
        return MLPClassifier(encoder, prepared.n_classes, standardize)
    standardize = Standardize(in_dim).fit(torch.from_numpy(prepared.subset("train").x))
    return MLPClassifier(MLPEncoder(in_dim, cfg.hidden), prepared.n_classes, standardize)


def train_mlp(
    prepared: Prepared,
    cfg: ErmConfig,
    dataset: str,
    seed: int,
    desc: str,
    checkpoint: Checkpointer | None = None,
    info: dict[str, Any] | None = None,
) -> tuple[MLPClassifier, FitResult]:
    """Train an erm/groupdro/reweight/jtt/probe MLP; returns (model holding the selected weights, FitResult).

    reweight and jtt put per-example weights on train (`robust.balanced_weights` /
    `robust.jtt_weights`); jtt first trains an identification model of the same backbone for
    `id_epochs` (not checkpointed: it is short and deterministic) and stores its summary in
    `info["jtt"]`. probe freezes the pretrained encoder.
    """
    from stages.models import robust
    from stages.models.training import (
        FitOptions,
        GroupDROLoss,
        cross_entropy,
        fit_classifier,
        split_data,
    )
    from stages.runtime import setup_torch

    generator = setup_torch(seed)
    splits = split_data(prepared)
    opts = FitOptions.from_config(cfg)
    train = splits["train"]
    loss: Any = cross_entropy
    if isinstance(cfg, GroupDROConfig):
        loss = GroupDROLoss(prepared.n_groups, cfg.eta)
    elif isinstance(cfg, ReweightConfig):
        labels, n_values = (train.g, prepared.n_groups) if cfg.balance == "group" else (train.y, prepared.n_classes)
        train.extra["w"] = robust.balanced_weights(labels, n_values)
        loss = robust.weighted_cross_entropy
    elif isinstance(cfg, JTTConfig):
        ident = robust.identify_errors(
            build_mlp(prepared, cfg, dataset), splits, opts, cfg.id_epochs, generator, prepared.n_groups, desc=f"{desc} (identify)"
        )
        if info is not None:
            info["jtt"] = {**ident.summary, "upweight": cfg.upweight}
        train.extra["w"] = robust.jtt_weights(ident.errors, cfg.upweight)
        loss = robust.weighted_cross_entropy
    model = build_mlp(prepared, cfg, dataset)
    if isinstance(cfg, ProbeConfig):
        model.encoder.requires_grad_(False)
    result = fit_classifier(model, splits, loss, opts, generator, desc=desc, checkpoint=checkpoint)
    model.load_state_dict(result.state_dict)
    return model.eval(), result


def read_embeddings(dataset: str, prepared: Prepared, splits: tuple[str, ...]) -> dict[str, Any]:
    """`robust.Embedded` for each split in `splits`, from data/pretrained/<dataset>/embeddings.parquet.

    Only the rows of `splits` are kept (matched to the prepared rows by id, in prepared
    order); a missing file, or ids that do not match the prepared data, name the file.
    """
    import numpy as np

    from stages.artifacts import embeddings_schema, pretrained_dir
    from stages.io import ArtifactError, fixed_list_to_numpy, read_metadata, read_parquet
    from stages.models import EMBEDDINGS
    from stages.models.robust import Embedded

    path = pretrained_dir(dataset) / EMBEDDINGS
    if not path.is_file():
        raise ArtifactError(
            f"{path}: pretrained embeddings not found; they are made by the pretrain stage "
            f"(`python -m stages.pretrain {dataset}` or `dvc repro pretrain@{dataset}`)"
        )
    hidden = read_metadata(path).get("hidden")
    if not isinstance(hidden, list) or not hidden:
        raise ArtifactError(f"{path}: file metadata lacks the encoder widths 'hidden'")
    table = read_parquet(path, embeddings_schema(int(hidden[-1])))
    ids = table.column("id").to_numpy()
    split_col = np.asarray(table.column("split").to_pylist(), dtype=object)
    out = {}
    for name in splits:
        keep = np.flatnonzero(split_col == name)
        row_of = {int(i): k for k, i in enumerate(ids[keep])}
        part = prepared.subset(name)
        missing = [int(i) for i in part.id if int(i) not in row_of]
        if missing or len(keep) != len(part.id):
            first = f" (first missing id {missing[0]})" if missing else ""
            raise ArtifactError(f"{path}: split '{name}' rows do not match the prepared data{first}; re-run the pretrain stage")
        z = fixed_list_to_numpy(table.column("z").take(keep))[[row_of[int(i)] for i in part.id]]
        out[name] = Embedded(z, part.y.astype(np.int64), part.g.astype(np.int64))
    return out


def train_dfr(
    prepared: Prepared, cfg: DFRConfig, dataset: str, seed: int
) -> tuple[MLPClassifier, dict[str, dict[str, float]], pa.Table, dict[str, Any]]:
    """DFR: a linear head on the frozen pretrained encoder, fitted on val embeddings only.

    Returns (model mapping raw x to logits, metrics per split, epoch-0 history, summary for
    config.json). The fit reads only the `cfg.reads_splits()` rows of the embeddings file,
    and checks that the stored val embeddings are what the stored encoder gives (else the
    pretrained folder is stale). After the fit, every C's head is also scored on test_ood
    for the report (`grid[*].test_ood_worst_group_acc`); that score never chooses C unless
    `selection` is oracle.
    """
    import numpy as np
    import torch

    from stages.io import ArtifactError
    from stages.models.robust import dfr_classifier, fit_dfr, group_scores
    from stages.models.training import history_rows, history_table, split_data, split_metrics
    from stages.runtime import setup_torch

    setup_torch(seed)
    path, standardize, encoder = pretrained_encoder(dataset)
    embedded = read_embeddings(dataset, prepared, cfg.reads_splits())
    val = embedded["val"]
    with torch.no_grad():
        z_check = encoder(standardize(torch.from_numpy(np.ascontiguousarray(prepared.subset("val").x)))).numpy()
    if z_check.shape != val.z.shape or not np.allclose(z_check, val.z, rtol=1e-4, atol=1e-4):
        raise ArtifactError(f"{path.parent}: embeddings.parquet does not match encoder.safetensors; re-run the pretrain stage")
    try:
        fit = fit_dfr(
            val, prepared.n_classes, cfg.c_grid, cfg.n_fits, cfg.selection, seed, embedded.get("test_ood"), cfg.balance
        )
    except ValueError as e:
        raise ConfigError(f"method dfr on {dataset}: {e}") from None
    model = dfr_classifier(standardize, encoder, fit.weight, fit.bias)
    splits = split_data(prepared)
    metrics = {}
    with torch.no_grad():
        for name, s in splits.items():
            metrics[name] = split_metrics(model(s.x), s.y, s.g)
    summary = dict(fit.summary)
    if "test_ood" in splits:  # what the oracle would have chosen, for the report only
        ood = splits["test_ood"]
        with torch.no_grad():
            z_ood = encoder(standardize(ood.x)).double().numpy()
        for cand, row in zip(fit.candidates, summary["grid"], strict=True):
            scores = group_scores(z_ood @ cand.weight.T + cand.bias, ood.y.numpy(), ood.g.numpy())
            row["test_ood_worst_group_acc"] = scores["worst_group_acc"]
    # The C each criterion picks (ties to the smaller C), in the shape of `selections` elsewhere.
    keys = {"val_avg": "tune_acc", "val_worst_group": "tune_worst_group_acc", "oracle": "test_ood_worst_group_acc"}
    summary["selections"] = {
        criterion: max(summary["grid"], key=lambda row, k=key: row[k])  # type: ignore[misc]
        for criterion, key in keys.items()
        if key in summary["grid"][0]
    }
    return model, metrics, history_table(history_rows(0, metrics)), summary


def train_settings(params: DictConfig) -> TrainConfig:
    """The `train` section (checkpointing); defaults when a hand-written params file lacks it."""
    from omegaconf import OmegaConf

    return TrainConfig() if OmegaConf.select(params, "train") is None else section(params, "train", TrainConfig)


def checkpointer(
    dataset: str, method: str, seed: int, cfg: ErmConfig | TextErmConfig | DiffusionConfig | AutoregressiveConfig,
    settings: TrainConfig,
) -> Checkpointer:
    """The Checkpointer of stage train@<dataset>-<method>-<seed>, fingerprinted by config, inputs and code."""
    from stages.artifacts import prepared_path, pretrained_dir
    from stages.checkpoint import Checkpointer, fingerprint
    from stages.models import ENCODER

    here = Path(__file__).resolve().parent
    pretrained = getattr(cfg, "init", "scratch") == "pretrained"  # text_erm and the generative models have no init
    inputs = [prepared_path(dataset)] + ([pretrained_dir(dataset) / ENCODER] if pretrained else [])
    code = [here / "train.py", here / "models", here / "checkpoint.py", here / "runtime.py"]
    config = {"dataset": dataset, "method": method, "seed": seed, "config": dataclasses.asdict(cfg)}
    return Checkpointer(
        stage=f"train@{dataset}-{method}-{seed}",
        fingerprint=fingerprint(config, inputs, code),
        every=settings.checkpoint_every,
        resume=settings.resume,
    )


def save_epoch_trained(
    out: Path, model: Any, record: dict[str, Any], result: FitResult, selection: str, ckpt: Checkpointer
) -> tuple[dict[str, dict[str, float]], str]:
    """Record what the loop selected, write the model folder, drop the checkpoint; (metrics, how).

    `record` may already hold an `architecture` (text_erm's, without its vocabulary).
    """
    from stages.models import save_model
    from stages.models.robust import selection_summary

    record.setdefault("architecture", model.arch())
    record.update(selection=selection, selected_epoch=result.selected_epoch, metrics=result.selected_metrics)
    record.update(selections=selection_summary(result.history))
    save_model(out, model, record, result.history)
    ckpt.clear()  # the model folder is written: nothing left to resume
    return result.selected_metrics, f"epoch {result.selected_epoch} selected by {selection}"


def run(params: DictConfig, dataset: str, method: str, seed: str) -> str:
    from stages.artifacts import model_dir, prepared_path, pretrained_dir
    from stages.models import ENCODER, save_model
    from stages.models.training import read_prepared_input

    seed_i = parse_seed(seed)
    cfg = method_config(params, method)
    settings = train_settings(params)
    prepared = read_prepared_input(dataset)
    record: dict[str, Any] = {
        "dataset": dataset,
        "method": method,
        "seed": seed_i,
        "config": dataclasses.asdict(cfg),
        "prepared": str(prepared_path(dataset)),
    }
    record["reads_splits"] = list(reads_splits(cfg))
    out = model_dir(dataset, method, seed_i)
    if isinstance(cfg, DFRConfig):
        model, metrics, history, summary = train_dfr(prepared, cfg, dataset, seed_i)
        selections = summary.pop("selections")
        record.update(architecture=model.arch(), selection=cfg.selection, selected_epoch=0, metrics=metrics)
        record.update(selections=selections, dfr=summary)
        record["pretrained_encoder"] = str(pretrained_dir(dataset) / ENCODER)
        save_model(out, model, record, history)
        how = f"C={summary['c']:g} selected by {cfg.selection} on {summary['tuned_on']}"
    elif isinstance(cfg, (DiffusionConfig, AutoregressiveConfig)):
        ckpt = checkpointer(dataset, method, seed_i, cfg, settings)
        model, result = train_generative(prepared, cfg, method, seed_i, checkpoint=ckpt)
        metrics, how = save_epoch_trained(out, model, record, result, cfg.selection, ckpt)
    elif isinstance(cfg, TextErmConfig):
        # Before any work: a clear error naming the method and the dataset, not a crash in tokenising.
        check_text_input(method, cfg, dataset, prepared.meta.get("kind"), has_text=prepared.text is not None)
        from stages.models.text_classifier import train_text

        ckpt = checkpointer(dataset, method, seed_i, cfg, settings)
        model, result = train_text(prepared, cfg, seed_i, desc=f"train {method}", checkpoint=ckpt)
        # The vocabulary lives in model.safetensors' metadata; config.json records only its size.
        arch = {k: v for k, v in model.arch().items() if k != "vocab"}
        record["architecture"] = {**arch, "vocab_words": len(model.vocab)}
        metrics, how = save_epoch_trained(out, model, record, result, cfg.selection, ckpt)
    elif isinstance(cfg, LDAConfig):  # and QDAConfig
        model, metrics, history = train_lda(prepared, cfg, method)
        record.update(architecture=model.arch(), selection=None, selected_epoch=0, metrics=metrics)
        save_model(out, model, record, history)
        how = "closed form"
    else:
        ckpt = checkpointer(dataset, method, seed_i, cfg, settings)
        info: dict[str, Any] = {}
        model, result = train_mlp(prepared, cfg, dataset, seed_i, desc=f"train {method}", checkpoint=ckpt, info=info)
        record.update(info)
        if cfg.init == "pretrained":
            record["pretrained_encoder"] = str(pretrained_dir(dataset) / ENCODER)
        metrics, how = save_epoch_trained(out, model, record, result, cfg.selection, ckpt)
    val = metrics["val"]
    return (
        f"trained {method} on {dataset} seed {seed_i}: {how} "
        f"(val acc {val['acc']:.2f}, val worst-group {val['worst_group_acc']:.2f}) -> {Path(out)}"
    )


def _help() -> str:
    methods = "\n".join(f"with kind: {kind}\n" + describe(schema, "method.<name>") for kind, schema in METHOD_SCHEMAS.items())
    return methods + "\n" + describe(TrainConfig, "train")


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("train", __doc__, ["dataset", "method", "seed"], _help, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
