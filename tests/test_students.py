"""Distilled students against their teachers: summary.json's `_students` (wga_retention,
cost_ratio, agreement) from a tiny real run of the train, distill, evaluate and report stages,
with a diffusion, an autoregressive and an erm teacher."""

from __future__ import annotations

import numpy as np
import pytest

from stages import distill, evaluate, prepare, report, train
from stages.core.artifacts import metrics_path, predictions_path
from stages.core.config import ConfigError, load_params
from stages.core.io import read_json, read_parquet
from stages.core.settings import RunConfig
from stages.evaluation.comparison import ModelSummary, student_numbers

DS = "gaussian_shortcut"
# 4-d inputs (core, cue, 2 noise dimensions), small splits
SMALL = [f"dataset.{DS}.{k}={v}" for k, v in
         (("d_noise", 2), ("n_train", 400), ("n_val", 200), ("n_test_id", 200), ("n_test_ood", 200))]

TEACHERS = ["erm", "diffusion", "autoregressive"]
TINY = [
    "method.erm.hidden=[16]", "method.erm.epochs=20", "method.erm.lr=0.01",
    "method.diffusion.epochs=12", "method.diffusion.eval_every=6", "method.diffusion.width=32", "method.diffusion.draws=8",
    "method.diffusion.select_draws=4", "method.diffusion.stop_first=2",
    "method.autoregressive.epochs=2", "method.autoregressive.eval_every=2",
]
STUDENT = ["distill.hidden=[8]", "distill.epochs=20", "distill.lr=0.01"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.MonkeyPatch) -> dict:
    """Every teacher trained, distilled and both evaluated on a 4-d gaussian-shortcut file; then the report."""
    import os
    import shutil
    from pathlib import Path

    root = tmp_path_factory.mktemp("students")
    shutil.copy(Path(__file__).resolve().parents[1] / "params.yaml", root / "params.yaml")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert prepare.main([DS, *SMALL]) == 0
        for t in TEACHERS:
            assert train.main([DS, t, "0", *TINY]) == 0
            assert distill.main([DS, t, "0", *TINY, *STUDENT]) == 0
            for model in (t, f"{t}_student"):  # under the params they were made with
                assert evaluate.main([DS, model, "0", *TINY, *STUDENT, "evaluate.bootstrap_resamples=0"]) == 0
        models = [*TEACHERS, *(f"{t}_student" for t in TEACHERS)]
        run = [f"run.datasets=[{DS}]", f"run.methods=[{','.join(TEACHERS)}]", f"run.teachers=[{','.join(TEACHERS)}]",
               f"run.models=[{','.join(models)}]", "run.seeds=[0]", "evaluate.bootstrap_resamples=0",
               "evaluate.evidence_reference=[erm]", "evaluate.er_reference=[erm]"]
        assert report.main([*run, *SMALL]) == 0
        out = {"summary": read_json(root / "data/reports/summary.json"), "md": (root / "data/reports/report.md").read_text()}
        for model in models:
            out[model] = read_json(root / metrics_path(DS, model, 0))
            out[f"{model}/pred"] = np.asarray(read_parquet(root / predictions_path(DS, model, 0)).to_pydict()["pred"])
            out[f"{model}/split"] = np.asarray(read_parquet(root / predictions_path(DS, model, 0)).to_pydict()["split"])
        return out
    finally:
        os.chdir(cwd)


def test_every_student_has_its_numbers_in_summary_json(tiny_run):
    students = tiny_run["summary"]["_students"]
    assert set(students) == {DS}
    assert set(students[DS]) == {f"{t}_student" for t in TEACHERS}
    for t in TEACHERS:
        kept = students[DS][f"{t}_student"]
        assert set(kept) == {"wga_retention", "cost_ratio", "agreement"}
        teacher, student = tiny_run[t], tiny_run[f"{t}_student"]
        # Recomputed from the metrics and predictions files.
        t_wga, s_wga = teacher["test_ood_worst_group_acc"], student["test_ood_worst_group_acc"]
        assert kept["wga_retention"] == (pytest.approx(s_wga / t_wga, rel=1e-6) if t_wga > 0 else None)
        assert kept["cost_ratio"] == pytest.approx(student["cost"]["macs_per_example"] / teacher["cost"]["macs_per_example"], rel=1e-6)
        ood = tiny_run[f"{t}/split"] == "test_ood"
        agree = float((tiny_run[f"{t}/pred"][ood] == tiny_run[f"{t}_student/pred"][ood]).mean())
        assert kept["agreement"] == pytest.approx(agree, abs=1e-8)
    assert "## Distilled students: robustness kept at what cost" in tiny_run["md"]
    assert "figures/students-retention-vs-cost.svg" in tiny_run["md"]


def test_a_students_cost_ratio_on_a_known_architecture(tiny_run):
    """erm teacher 4→16→2 (4·16 + 16·2 = 96 multiply-adds), student 4→8→2 (4·8 + 8·2 = 48): 0.5 exactly."""
    assert tiny_run["erm"]["cost"]["macs_per_example"] == 96
    assert tiny_run["erm_student"]["cost"]["macs_per_example"] == 48
    assert tiny_run["summary"]["_students"][DS]["erm_student"]["cost_ratio"] == 0.5


def test_the_students_learned_their_teachers_and_cost_a_fraction_of_a_generative_one(tiny_run):
    students = tiny_run["summary"]["_students"][DS]
    for t in TEACHERS:
        assert tiny_run[f"{t}_student"]["test_id_acc"] > 0.8  # chance 0.5
        assert students[f"{t}_student"]["agreement"] > 0.6
    # 48 multiply-adds against every class × draw of the denoiser (diffusion) or every class's sequence (autoregressive).
    assert students["diffusion_student"]["cost_ratio"] < 0.01
    assert students["autoregressive_student"]["cost_ratio"] < 0.1


def test_run_teachers_can_name_the_autoregressive_and_diffusion_methods_and_nothing_untrained():
    params = load_params("params.yaml", ["run.teachers=[lda,diffusion,autoregressive]"])
    from stages.core.config import section

    run = section(params, "run", RunConfig)
    assert run.teachers == ["lda", "diffusion", "autoregressive"]
    with pytest.raises(ConfigError, match=r"run\.teachers"):
        section(load_params("params.yaml", ["run.teachers=[lda,nope]"]), "run", RunConfig)


def summary(model: str, wga: float, macs: float | None) -> ModelSummary:
    return ModelSummary(model, {}, 1, [0.9], [0.5], [wga], [0.1], cost=None if macs is None else {"macs_per_example": macs})


def test_student_numbers_say_none_where_there_is_nothing_to_divide_by():
    kept = student_numbers(summary("diffusion", 0.0, 1000.0), summary("diffusion_student", 0.2, 10.0), None, DS)
    assert kept == {"wga_retention": None, "cost_ratio": 0.01, "agreement": None}
    kept = student_numbers(summary("lda", 0.4, None), summary("lda_student", 0.3, 10.0), None, DS)
    assert kept == {"wga_retention": pytest.approx(0.75), "cost_ratio": None, "agreement": None}


def test_the_default_teachers_are_those_the_run_trains_and_a_named_one_must_be_trained(tmp_path, monkeypatch):
    """conf/'s run.teachers: lda and diffusion when run.methods has them; a run restricted to other
    methods (docs/extending.md's `-S 'run.methods=[logreg,lda]'`) distils only what it trains, and a
    teacher named by hand must be in run.methods (one line naming the key)."""
    import yaml

    from stages.core import config
    from tests.test_replicates import ROOT

    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"

    def teachers(*overrides: str) -> list[str]:
        config.compose(ROOT / "conf", out, list(overrides))
        return yaml.safe_load(out.read_text())["run"]["teachers"]

    assert teachers() == ["lda", "diffusion"]
    assert teachers("run.methods=[erm,lda]") == ["lda"]
    assert teachers("run.methods=[erm,groupdro]") == []
    with pytest.raises(ConfigError, match=r"run\.teachers: teacher 'diffusion' is not in run\.methods"):
        teachers("run.methods=[erm,lda]", "run.teachers=[diffusion]")
