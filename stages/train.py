"""Train one method on one dataset with one seed and write its model folder.

    python -m stages.train <dataset> <method> <seed> [key=value ...]

Reads data/prepared/<dataset>.parquet and the section `method.<method>` of params.yaml; its
`kind` names the method's module (stages/models/<kind>.py, see stages/core/registry.py), whose
registered `train(job)` does the work: epoch-trained methods through the shared loop
(stages/models/training.py) with the epoch chosen by `selection`, closed-form ones in one
fit. Methods with `init: pretrained` (and those reading embeddings) take the pretrain stage's
encoder from data/pretrained/<dataset>/. Writes data/models/<dataset>/<method>/seed=<seed>/.

config.json records, besides the resolved config, `reads_splits` (the splits whose rows can
change the weights; tests/test_robust.py poisons every other split and checks the weights do
not move), `selections` (the epoch and metrics each criterion val_avg / val_worst_group /
oracle would pick; only `selection` chose the weights), via `save_model`, `inference_cost`, and
`provenance` (also in the weights' header; stages/core/provenance.py): the method's name and kind,
the seed, the sha256 of its resolved `method.<method>` section and of every file it read.

A method trained by epochs also keeps its last epoch's weights, final.safetensors (same
architecture and provenance; the base model DFR re-trains the last layer of, `base: final`).

Every method trained by epochs writes a checkpoint to
scratch/checkpoints/train@<dataset>-<method>-<seed>/ every `train.checkpoint_every` epochs
and when stopped by SIGINT/SIGTERM; running the same command again resumes from it
(byte-identical result) unless `train.resume=false`. The checkpoint is deleted once the
model folder is written (see stages/core/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from stages.core import registry
from stages.core.cli import parse_seed, stage_main
from stages.core.config import (
    check_text_input,
    configure_runtime,
    defaults,
    describe_section,
    help_params,
    maker_config,
    method_config,
    section,
)
from stages.core.schema import SELECTION_SPLIT, ConfigError
from stages.core.settings import TrainConfig


def reads_splits(cfg: Any) -> tuple[str, ...]:
    """The splits whose rows can change a method's fitted weights (its `reads_splits()`, or
    train plus the selection split for a config that does not declare them)."""
    declared = getattr(cfg, "reads_splits", None)
    if callable(declared):
        return tuple(declared())
    selection = getattr(cfg, "selection", None)
    return tuple(dict.fromkeys(("train", SELECTION_SPLIT[selection]))) if selection else ("train",)


def input_files(spec: registry.MethodSpec, cfg: Any, dataset: str, seed: int) -> list[Path]:
    """The files a method reads, as its DVC deps name them: the prepared Parquet, the pretrain
    stage's outputs (when the method needs them) and its upstream method's model weights."""
    from stages.core.artifacts import model_dir, prepared_path, pretrained_dir
    from stages.models import EMBEDDINGS, ENCODER, WEIGHTS

    files = [prepared_path(dataset)]
    if spec.needs_pretrained(cfg):
        files += [f for f in (pretrained_dir(dataset) / ENCODER, pretrained_dir(dataset) / EMBEDDINGS) if f.is_file()]
    upstream = spec.upstream_method(cfg)
    if upstream is not None:  # the weights file it reads there (DFR: the last epoch's, by default)
        read = getattr(cfg, "upstream_weights", None)
        files.append(model_dir(dataset, upstream, seed) / (read() if callable(read) else WEIGHTS))
    from stages.models.external import local_files

    return files + local_files(cfg)  # a network's initial weights, its vocabulary


def run(params: DictConfig, dataset: str, method: str, seed: str) -> str:
    seed_i = parse_seed(seed)  # first: a bad seed is refused before torch is imported
    from torch import nn

    from stages.core import provenance
    from stages.core.artifacts import model_dir, prepared_path
    from stages.core.checkpoint import checkpoint_dir
    from stages.core.io import check_writable
    from stages.models import save_model
    from stages.models.training import NonFiniteLoss, TrainJob, model_device, read_prepared_input

    cfg = method_config(params, method)
    spec = registry.method(cfg.kind)
    rt = configure_runtime(params)  # before any data is read: a device this machine lacks stops it now
    # A hand-written params file may lack the `train` section: conf/'s values then.
    has = OmegaConf.select(params, "train") is not None
    settings = section(params, "train", TrainConfig) if has else defaults("train", "default")
    streamed = rt.stream and spec.streams  # a method that cannot stream reads the file whole (recorded below)
    prepared = read_prepared_input(dataset, stream=streamed)
    # Before any work: a clear error naming the method and the dataset, not a crash in tokenising.
    check_text_input(method, cfg, dataset, prepared.meta.get("kind"), has_text=prepared.text is not None)
    why = registry.not_on_features(str(prepared.meta.get("features", "continuous")), cfg.kind)
    if why is not None:  # the DAG makes no such stage; by hand, one line and nothing written
        raise ConfigError(f"method.{method} (kind {cfg.kind}) does not apply to dataset '{dataset}' "
                          f"(kind {prepared.meta.get('kind')}, discrete features): {why}")
    # and every output location takes a file: a read-only folder stops it now, not after training
    check_writable(checkpoint_dir(f"train@{dataset}-{method}-{seed_i}") / "epoch.safetensors", folders=[model_dir(dataset, method, seed_i)])
    # what the artifacts it builds on must have been made under (the params it runs with)
    reads = (["pretrain"] if spec.needs_pretrained(cfg) else []) + [f"method.{m}" for m in [spec.upstream_method(cfg)] if m]
    built_on = {key: made for key in reads if (made := maker_config(params, key)) is not None}
    job = TrainJob(dataset, method, seed_i, cfg, prepared, settings.checkpoint_every, settings.resume, built_on)
    try:
        trained = spec.train(job)
    except NonFiniteLoss as e:  # one line naming the stage and the key to change
        e.where, e.key = f"train@{dataset}-{method}-{seed_i}", f"method.{method}.lr" if hasattr(cfg, "lr") else f"method.{method}"
        e.lr = getattr(cfg, "lr", None)
        raise
    if trained.model.kind not in spec.models:  # stages/dag.py relies on it for evaluate's DVC deps
        raise TypeError(f"method kind {cfg.kind} registered model={spec.model!r} but trained a {trained.model.kind!r} model")
    record: dict[str, Any] = {
        "dataset": dataset,
        "method": method,
        "seed": seed_i,
        "config": dataclasses.asdict(cfg),
        "prepared": str(prepared_path(dataset)),
        "reads_splits": list(reads_splits(cfg)),
        **trained.record,
        # where the model ran: the runtime's device, or the CPU for a model that stays there (training.place)
        "runtime": {**rt.record(), "stream": streamed,
                    "device": str(model_device(trained.model)) if isinstance(trained.model, nn.Module) else "cpu"},
    }
    made = provenance.record(
        dataset=dataset, model=method, kind=cfg.kind, seed=seed_i, stage=f"train@{dataset}-{method}-{seed_i}",
        config=cfg, inputs=input_files(spec, cfg, dataset, seed_i),
    )
    out = model_dir(dataset, method, seed_i)
    save_model(out, trained.model, record, trained.history, provenance=made, final=trained.final)
    if trained.checkpoint is not None:
        trained.checkpoint.clear()  # the model folder is written: nothing left to resume
    val = trained.metrics["val"]
    return (
        f"trained {method} on {dataset} seed {seed_i}: {trained.how} "
        f"(val acc {val['acc']:.2f}, val worst-group {val['worst_group_acc']:.2f}) -> {Path(out)}"
    )


def _help() -> str:
    params = help_params()
    names = list(OmegaConf.select(params, "method") or {}) if params is not None else []
    parts = []
    for name in names:
        kind = OmegaConf.select(params, f"method.{name}.kind")
        try:
            spec = registry.method(kind)
        except Exception:  # an unknown kind is reported when the stage runs
            continue
        parts.append(describe_section(params, f"method.{name}", spec.schema))
    unused = [k for k in registry.methods() if k not in {OmegaConf.select(params, f"method.{n}.kind") for n in names}]
    if unused:
        parts.append("kinds with no section in params.yaml: " + ", ".join(unused))
    return "\n".join(parts) + "\n" + describe_section(params, "train", TrainConfig)


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("train", __doc__, ["dataset", "method", "seed"], _help, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
