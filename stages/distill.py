"""Distil a trained teacher into a fast MLP student.

    python -m stages.distill <dataset> <teacher> <seed> [key=value ...]

Loads the teacher from data/models/<dataset>/<teacher>/seed=<seed>/ (any kind: an LDA
teacher's log p(x, y) scores are its logits), scores the train and val splits with it, and trains a
student MLPClassifier (section `distill` of params.yaml) on

    alpha · T² · KL(softmax(teacher / T) ‖ softmax(student / T)) + (1 − alpha) · CE(student, y)

with the shared training loop and checkpoint selection. Writes the student's model folder
data/models/<dataset>/<teacher>_student/seed=<seed>/; its config.json names the teacher
(`teacher`, `teacher_kind`) and carries both inference costs (`inference_cost` of the
student, `teacher_inference_cost`; see stages.models.inference_cost) for the report, and its
`provenance` (stages/core/provenance.py: kind `distill`, the teacher's weights among its inputs). A
teacher whose own provenance names another model, dataset, seed or prepared file is refused.
Any trained model is a valid teacher: only its logits are used, on train (the targets)
and on val (the objective's value on val each epoch, in history.parquet) — `target_logits`
(stages/models/__init__.py): a denoising classifier's full-scoring logits, not the capped stand-ins its
sequential elimination gives dropped classes (docs/results.md, "Distilled students": on one built-in at
the seed paper's regime the student kept 1.05 of the teacher's OOD worst-group accuracy on full
logits, 0.81 on the eliminated ones); any other kind's `logits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from omegaconf import DictConfig

from stages.core.cli import parse_seed, stage_main
from stages.core.config import configure_runtime, maker_config, section, section_help
from stages.core.settings import DistillConfig, student_name

if TYPE_CHECKING:
    from stages.core.artifacts import Prepared
    from stages.models import Classifier
    from stages.models.mlp import MLPClassifier
    from stages.models.training import FitResult


def distill(
    prepared: Prepared, teacher: Classifier, cfg: DistillConfig, seed: int, desc: str = "distill"
) -> tuple[MLPClassifier, FitResult]:
    """Train a student on `teacher`'s train-split logits; returns (student with the selected weights, FitResult)."""
    import torch

    from stages.core.runtime import setup_torch
    from stages.models import target_logits
    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import FitOptions, distillation_loss, fit_classifier, split_data

    generator = setup_torch(seed)
    splits = split_data(prepared)
    train = splits["train"]
    # A teacher whose `input` is "text" (e.g. a byte-level likelihood model) scores the splits' text.
    text_input = getattr(teacher, "input", "x") == "text"
    # Train's teacher logits are the targets; val's give the objective's held-out value each epoch.
    for name in ("train", "val") if "val" in splits else ("train",):
        s = splits[name]
        teacher_logits = target_logits(teacher, prepared.subset(name).text if text_input else s.x.numpy())
        if teacher_logits.shape != (len(s), prepared.n_classes) or not np.isfinite(teacher_logits).all():
            from stages.core.io import ArtifactError

            what = "non-finite logits" if teacher_logits.shape == (len(s), prepared.n_classes) else f"logits of shape {teacher_logits.shape}"
            raise ArtifactError(f"teacher ({teacher.kind}) gives {what} on {name}, expected finite {(len(s), prepared.n_classes)}")
        s.extra["teacher"] = torch.from_numpy(np.ascontiguousarray(teacher_logits, dtype=np.float32))
    in_dim = prepared.x.shape[1]
    student = MLPClassifier(MLPEncoder(in_dim, cfg.hidden), prepared.n_classes, Standardize(in_dim).fit(train.x))
    loss = distillation_loss(cfg.temperature, cfg.alpha)
    result = fit_classifier(student, splits, loss, FitOptions.from_config(cfg), generator, desc=desc)
    student.load_state_dict(result.state_dict)
    return student.eval(), result


def run(params: DictConfig, dataset: str, teacher: str, seed: str) -> str:
    from stages.core import provenance
    from stages.core.artifacts import model_dir, prepared_path
    from stages.core.io import ArtifactError, check_writable
    from stages.models import WEIGHTS, inference_cost, load_model, save_model
    from stages.models.history import convergence, selection_summary
    from stages.models.training import NonFiniteLoss, read_prepared_input

    seed_i = parse_seed(seed)
    cfg = section(params, "distill", DistillConfig)
    rt = configure_runtime(params)  # before any data is read: a device this machine lacks stops it now
    teacher_dir = model_dir(dataset, teacher, seed_i)
    if not (teacher_dir / WEIGHTS).is_file():
        raise ArtifactError(
            f"{teacher_dir / WEIGHTS}: teacher model not found; it is made by the train stage "
            f"(`python -m stages.train {dataset} {teacher} {seed_i}` or `dvc repro train@{dataset}-{teacher}-{seed_i}`)"
        )
    prepared = read_prepared_input(dataset)
    # The teacher must be this method's model for this dataset and seed, trained on this prepared file.
    made_for = provenance.Expected(
        dataset, f"train@{dataset}-{teacher}-{seed_i}", model=teacher, seed=seed_i, inputs=(prepared_path(dataset),),
        config=maker_config(params, f"method.{teacher}"), config_key=f"method.{teacher}",
    )
    teacher_model = load_model(teacher_dir, expect=made_for)
    check_writable(folders=[model_dir(dataset, student_name(teacher), seed_i)])  # before any work, not after it
    try:
        student, result = distill(prepared, teacher_model, cfg, seed_i, desc=f"distill {teacher}")
    except NonFiniteLoss as e:  # one line naming the stage and the key to change
        e.where, e.key, e.lr = f"distill@{dataset}-{teacher}-{seed_i}", "distill.lr", cfg.lr
        raise
    name = student_name(teacher)
    out = model_dir(dataset, name, seed_i)
    record = {
        "dataset": dataset,
        "method": name,
        "seed": seed_i,
        "teacher": teacher,
        "teacher_kind": teacher_model.kind,
        "teacher_inference_cost": inference_cost(teacher_model),
        "config": dataclasses.asdict(cfg),
        "architecture": student.arch(),
        "prepared": str(prepared_path(dataset)),
        "selection": cfg.selection,
        "selected_epoch": result.selected_epoch,
        "selections": selection_summary(result.history),
        "convergence": convergence(result.history, budget=result.budget, stopped=result.stopped),
        "metrics": result.selected_metrics,
        "runtime": rt.record(),
    }
    made = provenance.record(
        dataset=dataset, model=name, kind="distill", seed=seed_i, stage=f"distill@{dataset}-{teacher}-{seed_i}",
        config=cfg, inputs=[prepared_path(dataset), teacher_dir / WEIGHTS],
    )
    save_model(out, student, record, result.history, provenance=made)
    val = result.selected_metrics["val"]
    return (
        f"distilled {teacher} into {name} on {dataset} seed {seed_i}: epoch {result.selected_epoch} selected by "
        f"{cfg.selection} (val acc {val['acc']:.2f}, val worst-group {val['worst_group_acc']:.2f}) -> {Path(out)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("distill", __doc__, ["dataset", "teacher", "seed"], section_help("distill", DistillConfig), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
