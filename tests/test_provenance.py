"""Provenance (stages/core/provenance.py): every artifact records what made it, every reader checks it.

A model copied into another method's, seed's or dataset's folder, or trained on another version
of the prepared file, is refused in one line naming both; the records are where the docs say,
hold what they say, and keep the outputs byte-identical.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from stages import distill, evaluate, pretrain, train
from stages.core import provenance
from stages.core.artifacts import (
    metrics_path,
    model_dir,
    predictions_path,
    prepared_path,
    pretrained_dir,
)
from stages.core.config import load_params, section
from stages.core.io import ArtifactError, read_json, read_metadata, read_weights_meta, write_json
from stages.core.settings import EvaluateConfig
from stages.evaluation import comparison
from stages.models import CONFIG, EMBEDDINGS, ENCODER, FINAL_WEIGHTS, HISTORY, WEIGHTS
from tests.test_train import DS, write_prepared

FAST = ["method.erm.epochs=2", "method.erm.hidden=[8]", "method.groupdro.epochs=2", "method.groupdro.hidden=[8]"]
# the toy file has no generator params; FAST: a reader runs under the params its model was trained with
EVAL = [*FAST, "evaluate.shift_regenerate_n=0", "evaluate.bootstrap_resamples=0"]
PRE = ["pretrain.epochs=1", "pretrain.hidden=[8,3]"]
PREPARED = prepared_path(DS).as_posix()


@pytest.fixture
def workdir(workdir):
    """conftest's workdir with a prepared file written."""
    write_prepared(workdir)
    return workdir


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def trained(*methods: str, seed: int = 0) -> None:
    for m in methods:
        assert train.main([DS, m, str(seed), *FAST]) == 0


def refusal(capsys, main, argv: list[str]) -> str:
    """The one line `main(argv)` prints on stderr when it exits 2."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- what is recorded, and where ----------------------------------------------------------------


def test_every_artifact_records_what_made_it(workdir):
    trained("erm")
    folder = model_dir(DS, "erm", 0)
    made = read_weights_meta(folder / WEIGHTS)["provenance"]
    config = read_json(folder / CONFIG)
    assert config["provenance"] == made
    assert {k: made[k] for k in ("dataset", "model", "kind", "seed", "stage")} == {
        "dataset": DS, "model": "erm", "kind": "erm", "seed": 0, "stage": f"train@{DS}-erm-0"}
    # The hash of the resolved method section (as config.json records it) and of the file it read.
    assert made["config_sha256"] == provenance.config_sha256(config["config"])
    assert made["inputs"] == {PREPARED: sha256(prepared_path(DS))}

    assert evaluate.main([DS, "erm", "0", *EVAL]) == 0
    evaluated = read_metadata(predictions_path(DS, "erm", 0))["provenance"]
    assert read_json(metrics_path(DS, "erm", 0))["provenance"] == evaluated
    assert {k: evaluated[k] for k in ("dataset", "model", "kind", "seed", "stage")} == {
        "dataset": DS, "model": "erm", "kind": "erm", "seed": 0, "stage": f"evaluate@{DS}-erm-0"}
    cfg = section(load_params("params.yaml", EVAL), "evaluate", EvaluateConfig)
    assert evaluated["config_sha256"] == provenance.config_sha256(cfg)
    weights = (folder / WEIGHTS).as_posix()
    assert evaluated["inputs"] == {PREPARED: sha256(prepared_path(DS)), weights: sha256(folder / WEIGHTS)}


def test_models_built_on_another_model_record_its_weights(workdir):
    trained("erm")
    assert train.main([DS, "dfr", "0", *FAST, "method.dfr.c_grid=[0.1]", "method.dfr.n_refits=2"]) == 0
    upstream = model_dir(DS, "erm", 0) / FINAL_WEIGHTS  # dfr's base: erm's last epoch
    made = read_json(model_dir(DS, "dfr", 0) / CONFIG)["provenance"]
    assert made["inputs"] == {PREPARED: sha256(prepared_path(DS)), upstream.as_posix(): sha256(upstream)}

    assert train.main([DS, "lda", "0"]) == 0
    assert distill.main([DS, "lda", "0", "distill.epochs=1", "distill.hidden=[8]"]) == 0
    teacher = model_dir(DS, "lda", 0) / WEIGHTS
    student = read_weights_meta(model_dir(DS, "lda_student", 0) / WEIGHTS)["provenance"]
    assert (student["model"], student["kind"], student["stage"]) == ("lda_student", "distill", f"distill@{DS}-lda-0")
    assert student["inputs"] == {PREPARED: sha256(prepared_path(DS)), teacher.as_posix(): sha256(teacher)}

    assert pretrain.main([DS, *PRE]) == 0
    encoder = read_weights_meta(pretrained_dir(DS) / ENCODER)["provenance"]
    assert read_metadata(pretrained_dir(DS) / EMBEDDINGS)["provenance"] == encoder
    assert (encoder["model"], encoder["stage"], encoder["inputs"]) == ("pretrain", f"pretrain@{DS}", {PREPARED: sha256(prepared_path(DS))})
    assert train.main([DS, "erm", "1", *FAST, *PRE, "method.erm.init=pretrained"]) == 0
    made = read_json(model_dir(DS, "erm", 1) / CONFIG)["provenance"]
    assert set(made["inputs"]) == {PREPARED, (pretrained_dir(DS) / ENCODER).as_posix(), (pretrained_dir(DS) / EMBEDDINGS).as_posix()}


def test_same_params_and_seed_give_byte_identical_files(workdir):
    def once() -> dict[str, bytes]:
        trained("erm")
        assert evaluate.main([DS, "erm", "0", *EVAL]) == 0
        folder = model_dir(DS, "erm", 0)
        files = [folder / WEIGHTS, folder / CONFIG, folder / HISTORY, predictions_path(DS, "erm", 0), metrics_path(DS, "erm", 0)]
        return {f.as_posix(): f.read_bytes() for f in files}

    first = once()
    shutil.rmtree("data/models")
    shutil.rmtree("data/predictions")
    shutil.rmtree("data/metrics")
    assert once() == first
    assert b"/tmp" not in b"".join(first.values()) and str(workdir).encode() not in b"".join(first.values())


# ---- every reader checks it ---------------------------------------------------------------------


def test_evaluate_refuses_the_weights_of_another_method(workdir, capsys):
    trained("erm", "groupdro")
    theirs = model_dir(DS, "groupdro", 0) / WEIGHTS
    shutil.copy(model_dir(DS, "erm", 0) / WEIGHTS, theirs)
    line = refusal(capsys, evaluate.main, [DS, "groupdro", "0", *EVAL])
    assert line == (
        f"evaluate: error: {theirs} was trained as method 'erm' (kind erm), not 'groupdro'; "
        f"re-run `dvc repro train@{DS}-groupdro-0`"
    )
    assert not predictions_path(DS, "groupdro", 0).exists() and not metrics_path(DS, "groupdro", 0).exists()


def test_evaluate_refuses_a_config_json_of_another_folder(workdir, capsys):
    trained("erm", "groupdro")
    shutil.copy(model_dir(DS, "erm", 0) / CONFIG, model_dir(DS, "groupdro", 0) / CONFIG)
    line = refusal(capsys, evaluate.main, [DS, "groupdro", "0", *EVAL])
    assert f"{model_dir(DS, 'groupdro', 0) / CONFIG} does not belong with {model_dir(DS, 'groupdro', 0) / WEIGHTS}" in line
    assert "model 'erm'" in line


def test_evaluate_refuses_another_seed_and_another_dataset(workdir, capsys):
    trained("erm")
    shutil.copytree(model_dir(DS, "erm", 0), model_dir(DS, "erm", 1))
    line = refusal(capsys, evaluate.main, [DS, "erm", "1", *EVAL])
    assert line.startswith(f"evaluate: error: {model_dir(DS, 'erm', 1) / WEIGHTS} was trained with seed 0, not 1;")

    shutil.copy(prepared_path(DS), prepared_path("other"))
    shutil.copytree(model_dir(DS, "erm", 0), model_dir("other", "erm", 0))
    line = refusal(capsys, evaluate.main, ["other", "erm", "0", *EVAL])
    assert line == (
        f"evaluate: error: {model_dir('other', 'erm', 0) / WEIGHTS} was trained on dataset '{DS}', not 'other'; "
        "re-run `dvc repro train@other-erm-0`"
    )


def test_evaluate_refuses_a_model_trained_on_another_prepared_file(workdir, capsys):
    trained("erm")
    then = sha256(prepared_path(DS))
    write_prepared(workdir, seed=1)  # the same shape, other rows
    now = sha256(prepared_path(DS))
    line = refusal(capsys, evaluate.main, [DS, "erm", "0", *EVAL])
    assert line == (
        f"evaluate: error: {model_dir(DS, 'erm', 0) / WEIGHTS} was trained on another version of {PREPARED} "
        f"(sha256 {then[:12]}… then, {now[:12]}… now); re-run `dvc repro train@{DS}-erm-0`"
    )


def test_distill_and_dfr_refuse_a_foreign_model_they_build_on(workdir, capsys):
    trained("erm", "groupdro")
    # distill's teacher: groupdro's weights in lda's folder
    shutil.copytree(model_dir(DS, "groupdro", 0), model_dir(DS, "lda", 0))
    line = refusal(capsys, distill.main, [DS, "lda", "0"])
    assert line.startswith(f"distill: error: {model_dir(DS, 'lda', 0) / WEIGHTS} was trained as method 'groupdro' (kind groupdro), not 'lda';")
    # dfr's upstream (method.dfr.features: erm): groupdro's folder in erm's place
    shutil.rmtree(model_dir(DS, "erm", 0))
    shutil.copytree(model_dir(DS, "groupdro", 0), model_dir(DS, "erm", 0))
    line = refusal(capsys, train.main, [DS, "dfr", "0"])
    assert line.startswith(f"train: error: {model_dir(DS, 'erm', 0) / FINAL_WEIGHTS} was trained as method 'groupdro' (kind groupdro), not 'erm';")
    assert not model_dir(DS, "dfr", 0).exists()


def test_train_refuses_an_encoder_pretrained_on_another_prepared_file(workdir, capsys):
    assert pretrain.main([DS, "pretrain.epochs=1", "pretrain.hidden=[8]"]) == 0
    write_prepared(workdir, seed=1)
    line = refusal(capsys, train.main, [DS, "erm", "0", *FAST, "method.erm.init=pretrained"])
    assert line.startswith(f"train: error: {pretrained_dir(DS) / ENCODER} was pretrained on another version of {PREPARED} (sha256 ")
    assert line.endswith(f"re-run `dvc repro pretrain@{DS}`")
    # dfr on the pretrained features meets the same check
    line = refusal(capsys, train.main, [DS, "dfr", "0", "method.dfr.features=pretrained"])
    assert f"{pretrained_dir(DS) / ENCODER} was pretrained on another version of {PREPARED}" in line


def test_every_reader_of_weights_refuses_weights_made_under_other_settings(workdir, capsys):
    """Weights made under other params than the reader runs with (another architecture, other
    training) are refused in one line naming the section, both config hashes and the keys that
    differ; the same params read them."""
    trained("erm")  # hidden [8], 2 epochs
    folder = model_dir(DS, "erm", 0)
    wanted = [*EVAL[len(FAST):], "method.erm.hidden=[32]", "method.erm.epochs=2", "method.groupdro.epochs=2"]
    line = refusal(capsys, evaluate.main, [DS, "erm", "0", *wanted])
    assert line.startswith(f"evaluate: error: {folder / WEIGHTS} was trained under other settings of method.erm than "
                           "the params it is read with (config_sha256 ")
    assert "; hidden: [8] there, [32] now)" in line and "epochs" not in line
    assert line.endswith(f"re-run `dvc repro train@{DS}-erm-0`")
    assert not metrics_path(DS, "erm", 0).exists()
    assert evaluate.main([DS, "erm", "0", *EVAL]) == 0  # the params it was trained under

    # distill's teacher, dfr's upstream model: the same check, naming their own section
    line = refusal(capsys, distill.main, [DS, "erm", "0", "distill.epochs=1", "distill.hidden=[8]", "method.erm.hidden=[16]"])
    assert line.startswith(f"distill: error: {folder / WEIGHTS} was trained under other settings of method.erm")
    assert "hidden: [8] there, [16] now" in line and not model_dir(DS, "erm_student", 0).exists()
    line = refusal(capsys, train.main, [DS, "dfr", "0", "method.erm.epochs=2", "method.dfr.n_refits=2"])
    assert line.startswith(f"train: error: {folder / FINAL_WEIGHTS} was trained under other settings of method.erm")
    assert "hidden: [8] there, [64] now" in line and not model_dir(DS, "dfr", 0).exists()

    # a student read by evaluate: the `distill` section
    assert distill.main([DS, "erm", "0", *FAST, "distill.epochs=1", "distill.hidden=[8]"]) == 0
    line = refusal(capsys, evaluate.main, [DS, "erm_student", "0", *EVAL, "distill.epochs=1", "distill.hidden=[4]"])
    assert f"{model_dir(DS, 'erm_student', 0) / WEIGHTS} was trained under other settings of distill " in line
    assert "hidden: [8] there, [4] now" in line and line.endswith(f"re-run `dvc repro distill@{DS}-erm-0`")

    # the pretrained encoder a method starts from (and dfr's features=pretrained reads): `pretrain`
    assert pretrain.main([DS, *PRE]) == 0
    line = refusal(capsys, train.main, [DS, "erm", "1", *FAST, "pretrain.epochs=1", "method.erm.init=pretrained"])
    assert line.startswith(f"train: error: {pretrained_dir(DS) / ENCODER} was pretrained under other settings of pretrain")
    assert line.endswith(f"re-run `dvc repro pretrain@{DS}`") and not model_dir(DS, "erm", 1).exists()
    line = refusal(capsys, train.main, [DS, "dfr", "1", "pretrain.epochs=3", "pretrain.hidden=[8,3]", "method.dfr.features=pretrained"])
    assert f"{pretrained_dir(DS) / ENCODER} was pretrained under other settings of pretrain" in line
    assert train.main([DS, "erm", "1", *FAST, *PRE, "method.erm.init=pretrained"]) == 0


def test_the_report_refuses_predictions_and_metrics_whose_provenance_disagrees_with_their_path(workdir):
    trained("erm")
    assert evaluate.main([DS, "erm", "0", *EVAL]) == 0
    ours = predictions_path(DS, "groupdro", 0)
    ours.parent.mkdir(parents=True)
    shutil.copy(predictions_path(DS, "erm", 0), ours)
    with pytest.raises(ArtifactError) as e:
        comparison.load_run_data(DS, "groupdro", 0, 2)
    assert str(e.value) == f"{ours} was evaluated with model 'erm' (kind erm), not 'groupdro'; re-run `dvc repro evaluate@{DS}-groupdro-0`"
    comparison.load_run_data(DS, "erm", 0, 2)  # its own file is fine

    m = read_json(metrics_path(DS, "erm", 0))
    comparison.check_metrics(m, "m.json", DS, "erm", 0)
    with pytest.raises(ArtifactError, match=r"m\.json was evaluated with seed 0, not 1"):
        comparison.check_metrics({**m, "seed": 1}, "m.json", DS, "erm", 1)
    del m["provenance"]
    write_json(m, "m.json")
    with pytest.raises(ArtifactError, match=r"m\.json has no provenance record"):
        comparison.check_metrics(m, "m.json", DS, "erm", 0)
