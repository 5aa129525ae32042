"""The pretrain, train and distill stages run end to end on a tiny prepared file in tmp_path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages import distill, pretrain, train
from stages.core.artifacts import (
    HISTORY_SCHEMA,
    SPLITS,
    embeddings_schema,
    model_dir,
    prepared_path,
    prepared_schema,
    pretrained_dir,
)
from stages.core.io import (
    load_weights,
    numpy_to_fixed_list,
    read_json,
    read_metadata,
    read_parquet,
    write_parquet,
)
from stages.models import CONFIG, EMBEDDINGS, ENCODER, FINAL_WEIGHTS, HISTORY, WEIGHTS, load_model

REPO = Path(__file__).resolve().parents[1]
DS = "gaussian_shortcut"
SIZES = {"train": 400, "val": 200, "test_id": 200, "test_ood": 200}


def write_prepared(root: Path, seed: int = 0, shuffle_labels: bool = False) -> Path:
    """A gaussian-shortcut-like prepared Parquet (core, spurious, 2 noise dims) under root/data."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("id", "split", "y", "a", "g", "x")}
    for split, n in SIZES.items():
        rho = 0.05 if split == "test_ood" else 0.95
        y = rng.integers(0, 2, n)
        a = np.where(rng.random(n) < rho, y, 1 - y)
        x = np.column_stack([2 * y - 1 + rng.standard_normal(n), (2 * a - 1) + 0.2 * rng.standard_normal(n),
                             rng.standard_normal((n, 2))]).astype(np.float32)
        cols["split"] += [split] * n
        cols["y"].append(y)
        cols["a"].append(a)
        cols["x"].append(x)
    y, a, x = (np.concatenate(cols[k]) for k in ("y", "a", "x"))
    g = y * 2 + a
    if shuffle_labels:  # a different labelling of the same inputs
        perm = np.random.default_rng(99).permutation(len(y))
        y, a, g = y[perm], a[perm], g[perm]
    table = pa.table({"id": np.arange(len(y), dtype=np.int64), "split": cols["split"], "y": y, "a": a, "g": g,
                      "x": numpy_to_fixed_list(x)})
    meta = {"dataset": DS, "kind": DS, "n_classes": 2, "n_attrs": 2, "shape": [4], "rho_train": 0.95, "rho_ood": 0.05}
    return write_parquet(table, root / prepared_path(DS), prepared_schema(4), meta)


@pytest.fixture
def workdir(workdir):
    """conftest's workdir with a prepared file written."""
    write_prepared(workdir)
    return workdir


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


FAST = ["method.erm.epochs=3", "method.groupdro.epochs=3", "method.erm.hidden=[16]", "method.groupdro.hidden=[16]"]


def test_train_erm_writes_the_model_folder(workdir, capsys):
    assert train.main([DS, "erm", "0", *FAST]) == 0
    out = capsys.readouterr().out
    folder = model_dir(DS, "erm", 0)
    assert f"trained erm on {DS} seed 0: epoch " in out and "selected by val_worst_group (val acc " in out and str(folder) in out
    assert {p.name for p in folder.iterdir()} == {WEIGHTS, FINAL_WEIGHTS, CONFIG, HISTORY}  # final: the last epoch's weights
    config = read_json(folder / CONFIG)
    assert config["dataset"] == DS and config["seed"] == 0 and config["selection"] == "val_worst_group"
    assert config["reads_splits"] == ["train", "val"]
    # Every criterion's pick is reported; only `selection` chose the weights.
    assert set(config["selections"]) == {"val_avg", "val_worst_group", "oracle"}
    assert config["selections"]["val_worst_group"]["epoch"] == config["selected_epoch"]
    # Inference cost: 4 inputs -> 16 hidden -> 2 classes.
    assert config["inference_cost"] == {"params": 4 + 4 + 4 * 16 + 16 + 16 * 2 + 2, "macs": 4 * 16 + 16 * 2, "forward_passes": 1}
    assert config["config"]["epochs"] == 3 and config["config"]["kind"] == "erm"
    history = read_parquet(folder / HISTORY, HISTORY_SCHEMA).to_pylist()
    assert [(r["epoch"], r["split"]) for r in history] == [(e, s) for e in (1, 2, 3) for s in SPLITS]
    selected = [r for r in history if r["epoch"] == config["selected_epoch"] and r["split"] == "val"][0]
    assert selected["acc"] == config["metrics"]["val"]["acc"]
    model = load_model(folder)
    assert model.logits(np.zeros((5, 4), np.float32)).shape == (5, 2)
    assert config["metrics"]["test_id"]["acc"] > 0.8  # learned something


def test_train_is_byte_identical_for_the_same_seed(workdir):
    def once(seed: int) -> dict[str, bytes]:
        assert train.main([DS, "groupdro", str(seed), *FAST]) == 0
        return folder_bytes(model_dir(DS, "groupdro", seed))

    first = once(1)
    shutil.rmtree(model_dir(DS, "groupdro", 1))
    second = once(1)
    assert first[WEIGHTS] == second[WEIGHTS] and first[HISTORY] == second[HISTORY]
    assert once(2)[WEIGHTS] != first[WEIGHTS]


def test_train_lda_has_a_single_epoch_zero_history(workdir):
    assert train.main([DS, "lda", "0"]) == 0
    folder = model_dir(DS, "lda", 0)
    history = read_parquet(folder / HISTORY, HISTORY_SCHEMA).to_pylist()
    assert [(r["epoch"], r["split"]) for r in history] == [(0, s) for s in SPLITS]
    config = read_json(folder / CONFIG)
    assert config["selection"] is None and config["selected_epoch"] == 0
    assert load_model(folder).kind == "lda"
    # The shortcut: LDA is near-perfect in distribution and breaks on the flipped test split.
    assert config["metrics"]["test_id"]["acc"] > 0.9 > config["metrics"]["test_ood"]["worst_group_acc"]


def test_a_failed_run_keeps_the_previous_model_and_names_the_file(workdir, capsys):
    assert train.main([DS, "erm", "0", *FAST]) == 0
    folder = model_dir(DS, "erm", 0)
    before = folder_bytes(folder)
    prepared_path(DS).unlink()
    capsys.readouterr()
    assert train.main([DS, "erm", "0", *FAST]) == 2
    err = capsys.readouterr().err
    assert str(prepared_path(DS)) in err and "prepare" in err
    assert folder_bytes(folder) == before
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_bad_seed_and_unknown_method_are_config_errors(workdir, capsys):
    assert train.main([DS, "erm", "zero"]) == 2
    assert "seed" in capsys.readouterr().err
    assert train.main([DS, "svm", "0"]) == 2
    assert "method.svm" in capsys.readouterr().err


def test_pretrained_init_needs_the_pretrain_stage(workdir, capsys):
    assert train.main([DS, "erm", "0", "method.erm.init=pretrained"]) == 2
    err = capsys.readouterr().err
    assert str(pretrained_dir(DS) / ENCODER) in err and "pretrain" in err


def test_pretrain_reads_no_labels_and_feeds_train(workdir):
    args = [DS, "pretrain.epochs=2", "pretrain.hidden=[8,3]"]
    assert pretrain.main(args) == 0
    out = pretrained_dir(DS)
    first = folder_bytes(out)
    assert set(first) == {ENCODER, EMBEDDINGS}
    emb = read_parquet(out / EMBEDDINGS, embeddings_schema(3))
    assert emb.num_rows == sum(SIZES.values()) and set(emb.column("split").to_pylist()) == set(SPLITS)
    _, meta = load_weights(out / ENCODER)
    assert meta["hidden"] == [8, 3] and meta["in_dim"] == 4

    def outputs() -> tuple:
        """The encoder's tensors and metadata and the embeddings with their metadata, provenance aside."""
        tensors, meta = load_weights(out / ENCODER)
        emb_meta = {k: v for k, v in read_metadata(out / EMBEDDINGS).items() if k != "provenance"}
        return {k: v.tolist() for k, v in tensors.items()}, meta, read_parquet(out / EMBEDDINGS).to_pylist(), emb_meta

    before = outputs()
    write_prepared(workdir, shuffle_labels=True)  # same inputs, different y/a/g
    assert pretrain.main(args) == 0
    # Nothing it computes changes; only its provenance records the new prepared file's hash.
    assert outputs() == before and folder_bytes(out) != first

    # Fine-tuning starts from the pretrained encoder; its architecture wins over method.erm.hidden.
    assert train.main([DS, "erm", "0", *args[1:], "method.erm.init=pretrained", "method.erm.epochs=1"]) == 0
    _, meta = load_weights(model_dir(DS, "erm", 0) / WEIGHTS)
    assert meta["hidden"] == [8, 3]
    config = read_json(model_dir(DS, "erm", 0) / CONFIG)
    assert config["architecture"]["hidden"] == [8, 3] and config["pretrained_encoder"] == str(out / ENCODER)


def test_distilled_student_agrees_with_its_lda_teacher(workdir, capsys):
    assert distill.main([DS, "lda", "0"]) == 2
    err = capsys.readouterr().err
    assert str(model_dir(DS, "lda", 0) / WEIGHTS) in err and "stages.train" in err

    assert train.main([DS, "lda", "0"]) == 0
    assert distill.main([DS, "lda", "0", "distill.epochs=15", "distill.hidden=[16]", "distill.lr=0.01"]) == 0
    assert "distilled lda into lda_student" in capsys.readouterr().out
    folder = model_dir(DS, "lda_student", 0)
    config = read_json(folder / CONFIG)
    assert config["teacher"] == "lda" and config["teacher_kind"] == "lda"
    assert len(read_parquet(folder / HISTORY).to_pylist()) == 15 * len(SPLITS)

    from stages.core.artifacts import read_prepared

    x = read_prepared(prepared_path(DS)).x
    teacher, student = load_model(model_dir(DS, "lda", 0)), load_model(folder)
    assert student.kind == "mlp"
    agreement = (teacher.logits(x).argmax(1) == student.logits(x).argmax(1)).mean()
    assert agreement > 0.95


def test_any_trained_model_can_be_a_teacher(workdir, capsys):
    """An erm (mlp) teacher as well as an lda one; the student records both inference costs."""
    assert train.main([DS, "erm", "0", *FAST]) == 0
    assert distill.main([DS, "erm", "0", *FAST, "distill.epochs=4", "distill.hidden=[8]", "distill.lr=0.01"]) == 0
    assert "distilled erm into erm_student" in capsys.readouterr().out
    config = read_json(model_dir(DS, "erm_student", 0) / CONFIG)
    assert config["teacher"] == "erm" and config["teacher_kind"] == "mlp"
    teacher_cost = read_json(model_dir(DS, "erm", 0) / CONFIG)["inference_cost"]
    assert config["teacher_inference_cost"] == teacher_cost
    assert config["inference_cost"]["macs"] == 4 * 8 + 8 * 2 < teacher_cost["macs"]
    assert set(config["selections"]) == {"val_avg", "val_worst_group", "oracle"}
    assert config["metrics"]["test_id"]["acc"] > 0.8

    assert train.main([DS, "lda", "0"]) == 0
    assert distill.main([DS, "lda", "0", "distill.epochs=2", "distill.hidden=[8]"]) == 0
    config = read_json(model_dir(DS, "lda_student", 0) / CONFIG)
    assert config["teacher_kind"] == "lda"
    # LDA scores one example with a d×d triangular solve plus K·d for the distances.
    assert config["teacher_inference_cost"] == {"params": 2 * 4 + 4 * 4 + 2, "macs": 4 * 5 // 2 + 2 * 4, "forward_passes": 1}
