"""The table of bad inputs: each gets a clear error naming the file/column/key/row, and changes nothing.

One row per case. Every row starts from the same small workspace (params.yaml, conf/, a
prepared file that validates, a trained model and its evaluation), breaks one thing, runs
the stage that would meet it, and asserts: the exit code, that the message names what is
wrong, no traceback, and that every file that existed before (outputs and inputs alike) has
the same bytes afterwards. docs/reliability.md lists the same rows (a test keeps them in step).
"""

from __future__ import annotations

import csv
import hashlib
import json
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import inspect
from stages import evaluate, prepare, train, validate
from stages.core import config
from stages.core.artifacts import model_dir, prepared_path, prepared_schema, pretrained_dir
from stages.core.io import numpy_to_fixed_list, save_weights, write_parquet

# One worker runs the module: its module-scoped fixture is built once, not on each xdist worker.
pytestmark = pytest.mark.xdist_group("bad_inputs")

REPO = Path(__file__).resolve().parents[1]
DS = "gaussian_shortcut"
P = prepared_path(DS)
M = model_dir(DS, "erm", 0) / "model.safetensors"
FAST = ["method.erm.epochs=2", "method.erm.hidden=[8]"]
# Exact group counts (g = 2y + a; groups 0 and 3 agree): P(a == y) is 0.9 in train/val/test_id, 0.1 in test_ood.
COUNTS = {"train": (90, 10, 10, 90), "val": (45, 5, 5, 45), "test_id": (45, 5, 5, 45), "test_ood": (5, 45, 45, 5)}
META = {"dataset": DS, "kind": DS, "n_classes": 2, "n_attrs": 2, "shape": [4], "rho_train": 0.9, "rho_ood": 0.1,
        "params": {}}


def columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    split, g = [], []
    for s, counts in COUNTS.items():
        for group, n in enumerate(counts):
            split += [s] * n
            g += [group] * n
    g_arr = np.asarray(g, dtype=np.int64)
    y, a = g_arr // 2, g_arr % 2
    x = np.column_stack([2 * y - 1 + rng.standard_normal(len(g)), 2 * a - 1 + 0.2 * rng.standard_normal(len(g)),
                         rng.standard_normal((len(g), 2))]).astype(np.float32)
    return {"id": np.arange(len(g), dtype=np.int64), "split": np.asarray(split, dtype=object), "y": y, "a": a, "g": g_arr, "x": x}


def table_of(cols: dict[str, np.ndarray]) -> pa.Table:
    return pa.table({**{k: v for k, v in cols.items() if k != "x"}, "split": list(cols["split"]),
                     "x": numpy_to_fixed_list(cols["x"])})


def rewrite(change: Callable[[dict[str, np.ndarray]], None], **meta: object) -> Callable[[], None]:
    """A mutation: the prepared file with `change` applied to its columns and `meta` merged in."""
    def apply() -> None:
        cols = columns()
        change(cols)
        write_parquet(table_of(cols), P, prepared_schema(4), {**META, **meta})
    return apply


def raw_table(table: pa.Table, **meta: object) -> Callable[[], None]:
    """A mutation writing `table` as it is (any schema), with the contract metadata (None drops a key)."""
    def apply() -> None:
        md = {k: json.dumps(v) for k, v in {**META, **meta}.items() if v is not None}
        pq.write_table(table.replace_schema_metadata(md), P)
    return apply


def drop_split(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    def change(cols: dict[str, np.ndarray]) -> None:
        keep = cols["split"] != name
        for k in list(cols):
            cols[k] = cols[k][keep]
    return change


def drop_group(split: str, group: int) -> Callable[[dict[str, np.ndarray]], None]:
    def change(cols: dict[str, np.ndarray]) -> None:
        keep = ~((cols["split"] == split) & (cols["g"] == group))
        for k in list(cols):
            cols[k] = cols[k][keep]
    return change


def drop_class(split: str, y: int) -> Callable[[dict[str, np.ndarray]], None]:
    def change(cols: dict[str, np.ndarray]) -> None:
        keep = ~((cols["split"] == split) & (cols["y"] == y))
        for k in list(cols):
            cols[k] = cols[k][keep]
    return change


def setitem(column: str, row: int, value: object) -> Callable[[dict[str, np.ndarray]], None]:
    def change(cols: dict[str, np.ndarray]) -> None:
        cols[column] = cols[column].copy()
        cols[column][row] = value
    return change


def truncate(path: Path, keep: float = 0.5) -> Callable[[], None]:
    return lambda: path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def write(path: Path, data: bytes) -> Callable[[], None]:
    return lambda: path.write_bytes(data)


def edit_params(old: str, new: str) -> Callable[[], None]:
    def apply() -> None:
        text = Path("params.yaml").read_text()
        assert old in text
        Path("params.yaml").write_text(text.replace(old, new, 1))
    return apply


# ---- raw data: a tiny Waterbirds folder in the public format (metadata.csv + one JPEG per row) ----

WB = Path("data/raw/waterbirds")
WB_CSV = WB / "metadata.csv"
WB_HEADER = ["img_id", "img_filename", "y", "split", "place", "place_filename"]
WB_FAST = ("dataset.waterbirds.resolution=8", "dataset.waterbirds.workers=1")


def waterbirds_rows() -> list[list[object]]:
    """Every group in every official split (0/1/2 = train/val/test); row i uses image Bird_<i>.jpg."""
    rows, i = [], 0
    for split, counts in {0: (6, 3, 3, 6), 1: (2, 2, 2, 2), 2: (2, 2, 2, 2)}.items():
        for g, n in enumerate(counts):
            y, place = divmod(g, 2)
            for _ in range(n):
                i += 1
                species = "001.Black_footed_Albatross" if y else "002.Laysan_Albatross"
                rows.append([i, f"{species}/Bird_{i:04d}_{100 + i}.jpg", y, split, place, f"/b/bamboo_forest/{i:08d}.jpg"])
    return rows


def waterbirds(change: Callable[[list[str], list[list[object]]], None] = lambda h, r: None) -> Callable[[], None]:
    """A mutation: the raw Waterbirds folder, with `change` applied to metadata.csv's header and rows first."""
    def apply() -> None:
        from PIL import Image

        header, rows = list(WB_HEADER), waterbirds_rows()
        for r in rows:
            path = WB / str(r[1])
            path.parent.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng(int(r[0]))
            Image.fromarray(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8)).save(path, "JPEG")
        change(header, rows)
        with open(WB_CSV, "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
    return apply


def drop_csv_column(name: str) -> Callable[[list[str], list[list[object]]], None]:
    def change(header: list[str], rows: list[list[object]]) -> None:
        j = header.index(name)
        del header[j]
        for r in rows:
            del r[j]
    return change


def set_csv(row: int, column: str, value: object) -> Callable[[list[str], list[list[object]]], None]:
    def change(header: list[str], rows: list[list[object]]) -> None:
        rows[row - 1][header.index(column)] = value
    return change


def duplicate_csv_row(row: int, **changes: object) -> Callable[[list[str], list[list[object]]], None]:
    """Append a copy of data row `row` (1-based) with `changes` (column -> value)."""
    def change(header: list[str], rows: list[list[object]]) -> None:
        copy = list(rows[row - 1])
        for column, value in changes.items():
            copy[header.index(column)] = value
        rows.append(copy)
    return change


def image_of_row(row: int) -> Path:
    return WB / str(waterbirds_rows()[row - 1][1])


def not_an_image(row: int) -> Callable[[], None]:
    def apply() -> None:
        waterbirds()()
        image_of_row(row).write_bytes(b"<html>404 Not Found</html>\n")
    return apply


# ---- inspect CLI ----

INSPECTED = Path("data/inspect")
ESC = "\x1b[2J\x1b]0;pwned\x07\r\u202e"  # clear screen, set title, bell, carriage return, bidi override


def hostile_parquet(meta: dict[str, str]) -> Callable[[], None]:
    def apply() -> None:
        table = pa.table({"id": np.arange(3), f"col{ESC}": [f"v{ESC}"] * 3})
        INSPECTED.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.replace_schema_metadata(meta), INSPECTED / "hostile.parquet")
    return apply


HUGE = {"dataset": json.dumps(DS), "blob": "x" * 5_000_000, **{f"k{i}": str(i) for i in range(500)}}
ESCAPES = {f"key{ESC}": json.dumps(f"value{ESC}"), "plain": f"not json {ESC}", f"{ESC}" * 1000: ESC * 10_000}


class Trap:
    """Unpickling this creates the file `unpickled`: proof that something was unpickled."""

    def __reduce__(self):
        return (Path.touch, (Path("unpickled").resolve(),))


def other_architecture() -> None:
    """Weights of a 16-wide MLP under metadata that declares the trained 8-wide one."""
    import torch

    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder

    meta = {"kind": "mlp", "in_dim": 4, "hidden": [8], "n_classes": 2}
    save_weights(MLPClassifier(MLPEncoder(4, [16]), 2).state_dict(), M, meta)
    assert torch  # the network is real torch


def encoder_of_other_width() -> None:
    from stages.models import save_encoder
    from stages.models.nets import DenoisingAutoencoder

    save_encoder(pretrained_dir(DS) / "encoder.safetensors", DenoisingAutoencoder(7, [8]))


def copy_model(dataset: str, model: str, seed: int, weights_only: bool = False) -> Callable[[], None]:
    """A mutation: the trained erm model (or only its weights) copied into another model's folder."""
    def apply() -> None:
        dest = model_dir(dataset, model, seed)
        if weights_only:
            dest.mkdir(parents=True)
            shutil.copy(M, dest / M.name)
        else:
            shutil.copytree(M.parent, dest)
    return apply


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    stage: str  # module whose main() runs
    args: tuple[str, ...]
    mutate: Callable[[], None] | None
    names: tuple[str, ...]  # each must appear in the error
    code: int = 2
    stream: str = "err"  # where `names` must appear: the error ("err") or, for exit 0, the report ("out")


TRAIN = ("train", (DS, "erm", "0", *FAST))
EVAL = ("evaluate", (DS, "erm", "0"))
VALIDATE = ("validate", (DS,))

CASES = [
    # prepared Parquet
    Case("truncated-parquet", "prepared", *TRAIN, truncate(P), (str(P), "not a readable Parquet file")),
    Case("not-parquet", "prepared", *TRAIN, write(P, b"id,split,y\n0,train,1\n"), (str(P), "not a readable Parquet file")),
    Case("missing-column", "prepared", *TRAIN, raw_table(table_of(columns()).drop_columns(["g"])), (str(P), "missing column 'g'")),
    Case("wrong-column-type", "prepared", *TRAIN,
         raw_table(table_of(columns()).set_column(2, "y", pa.array(columns()["y"].astype(np.float64)))), (str(P), "column 'y' has type double")),
    Case("missing-metadata", "prepared", *TRAIN, raw_table(table_of(columns()), shape=None), (str(P), "shape")),
    Case("nan-in-features", "prepared", *VALIDATE, rewrite(setitem("x", 7, np.nan)), (str(P), "x_finite", "rows [7]")),
    Case("inf-in-features-hand-run-train", "prepared", *TRAIN, rewrite(setitem("x", 7, np.inf)), (str(P), "column 'x'", "row 7")),
    Case("label-out-of-domain", "prepared", *VALIDATE, rewrite(setitem("y", 3, 2)), (str(P), "domain[y]", "column y", "rows [3]")),
    Case("label-out-of-domain-hand-run-train", "prepared", *TRAIN, rewrite(setitem("y", 3, 2)), (str(P), "column 'y' is outside 0..1", "row 3")),
    Case("duplicate-ids", "prepared", *VALIDATE, rewrite(setitem("id", 5, 4)), (str(P), "id_unique", "column id")),
    Case("duplicate-ids-hand-run-train", "prepared", *TRAIN, rewrite(setitem("id", 5, 4)), (str(P), "column 'id' repeats an id", "row 5")),
    Case("group-missing-from-a-split", "prepared", *VALIDATE, rewrite(drop_group("val", 1)), (str(P), "min_group_count[val]", "column min_count_val")),
    Case("train-correlation-far-from-rho", "prepared", *VALIDATE, rewrite(lambda c: None, rho_train=0.6), (str(P), "train_rho", "agree_rate_train")),
    Case("empty-split", "prepared", *TRAIN, rewrite(drop_split("val")), (str(P), "split 'val' has no rows")),
    Case("empty-split-validate", "prepared", *VALIDATE, rewrite(drop_split("test_id")), (str(P), "min_group_count[test_id]")),
    Case("prepared-file-missing", "prepared", *TRAIN, lambda: P.unlink(), (str(P), "not found", "python -m stages.prepare")),
    Case("class-missing-from-train", "prepared", *VALIDATE, rewrite(drop_class("train", 1)),
         (str(P), "groups_present[train]", "train has 0 example(s) of group g=2 (y=1, a=0)", "train has no example of class y=1")),
    Case("group-missing-from-train", "prepared", *VALIDATE, rewrite(drop_group("train", 1)),
         (str(P), "groups_present[train]", "train has 0 example(s) of group g=1 (y=0, a=1)")),
    Case("another-datasets-file", "prepared", *VALIDATE, rewrite(lambda c: None, dataset="colored_digits", kind="colored_digits"),
         (str(P), "metadata[dataset]", "metadata[kind]", "'colored_digits'")),
    # config
    Case("unknown-key-override", "config", "train", (DS, "erm", "0", "method.erm.lrr=0.1"), None, ("method.erm.lrr", "unknown key")),
    Case("unknown-key-in-params-yaml", "config", *TRAIN, edit_params("    lr: 0.001\n", "    lr: 0.001\n    lrr: 0.1\n"), ("method.erm.lrr",)),
    Case("misspelt-group-option", "config", "config", ("compose", "method@method.erm=ermm"), None, ("method/ermm", "Available options")),
    Case("misspelt-choice", "config", "prepare", (DS, f"dataset.{DS}.kind=gausian_shortcut"), None, (f"dataset.{DS}.kind", "gausian_shortcut")),
    Case("wrong-type", "config", "train", (DS, "erm", "0", "method.erm.epochs=ten"), None, ("method.erm.epochs", "ten")),
    Case("rho-above-1", "config", "prepare", (DS, f"dataset.{DS}.rho_train=1.5"), None, (f"dataset.{DS}.rho_train", "must be in [0, 1]")),
    Case("negative-learning-rate", "config", "train", (DS, "erm", "0", "method.erm.lr=-0.001"), None, ("method.erm.lr", "must be a finite number > 0")),
    Case("zero-epochs", "config", "train", (DS, "erm", "0", "method.erm.epochs=0"), None, ("method.erm.epochs", "must be >= 1")),
    Case("negative-checkpoint-interval", "config", "train", (DS, "erm", "0", "train.checkpoint_every=-1"), None, ("train.checkpoint_every",)),
    Case("experiment-that-does-not-exist", "config", "config", ("compose", "experiment=nope"), None, ("experiment/nope", "tiny")),
    Case("unknown-method", "config", "train", (DS, "nope", "0"), None, ("method.nope", "known")),
    Case("seed-not-an-integer", "config", "train", (DS, "erm", "zero"), None, ("seed", "zero")),
    Case("compose-invalid-value", "config", "config", ("compose", "method.erm.lr=abc"), None,
         ("method.erm.lr", "'abc'", "params.yaml is not written")),
    Case("infinite-learning-rate", "config", "train", (DS, "erm", "0", "method.erm.lr=inf"), None, ("method.erm.lr", "finite")),
    # training
    Case("non-finite-loss", "training", "train", (DS, "erm", "0", *FAST, "method.erm.lr=1e30"), None,
         ("train@gaussian_shortcut-erm-0", "non-finite loss (nan) at epoch 1, batch 2", "method.erm.lr")),
    # raw data (the real-benchmark loaders of stages/datasets)
    Case("raw-folder-missing", "raw", "prepare", ("waterbirds",), None, ("data/raw/waterbirds", "not found", "docs/datasets.md")),
    Case("raw-metadata-column-missing", "raw", "prepare", ("waterbirds", *WB_FAST), waterbirds(drop_csv_column("place")),
         (str(WB_CSV), "missing column(s) ['place']")),
    Case("raw-image-unreadable", "raw", "prepare", ("waterbirds", *WB_FAST), not_an_image(5),
         (str(image_of_row(5)), "cannot decode the image", "row 5 of the metadata CSV", "on_bad_image=skip")),
    Case("raw-label-out-of-domain", "raw", "prepare", ("waterbirds", *WB_FAST), waterbirds(set_csv(3, "y", 2)),
         (str(WB_CSV), "row 3 (line 4)", "column 'y' is '2'", "expected an integer in [0, 1]")),
    Case("raw-image-in-two-splits", "raw", "prepare", ("waterbirds", *WB_FAST), waterbirds(duplicate_csv_row(1, img_id=999, split=2)),
         (str(WB_CSV), "rows 1 and 35 (lines 2 and 36)", "img_filename", str(waterbirds_rows()[0][1]), "split train and split test")),
    Case("raw-duplicate-id", "raw", "prepare", ("waterbirds", *WB_FAST), waterbirds(set_csv(4, "img_id", 1)),
         (str(WB_CSV), "rows 1 and 4 (lines 2 and 5)", "img_id")),
    # the inspect CLI (python -m pipeline.inspect)
    Case("inspect-folder-without-artifacts", "inspect", "inspect", (str(INSPECTED),), lambda: INSPECTED.mkdir(parents=True),
         (str(INSPECTED), "no artifacts here")),
    Case("inspect-not-parquet", "inspect", "inspect", (str(INSPECTED / "table.parquet"),),
         lambda: (INSPECTED.mkdir(parents=True), (INSPECTED / "table.parquet").write_text("id,split,y\n0,train,1\n")),
         (str(INSPECTED / "table.parquet"), "not a readable Parquet file")),
    Case("inspect-huge-metadata", "inspect", "inspect", (str(INSPECTED / "hostile.parquet"),), hostile_parquet(HUGE),
         ("blob: xxxx", "(+4999800 chars)", "+452 more keys"), code=0, stream="out"),
    Case("inspect-escape-sequences-in-metadata", "inspect", "inspect", (str(INSPECTED / "hostile.parquet"),),
         hostile_parquet(ESCAPES), ("key\\x1b[2J\\x1b]0;pwned\\x07\\r\\u202e", "col\\x1b[2J"), code=0, stream="out"),
    Case("inspect-escape-sequences-json", "inspect", "inspect", (str(INSPECTED / "hostile.parquet"), "--json"),
         hostile_parquet(ESCAPES), ("key\\\\x1b[2J", "\\u001b[2J"), code=0, stream="out"),
    # models
    Case("truncated-weights", "models", *EVAL, truncate(M), (str(M), "not a valid safetensors file")),
    Case("weights-of-another-architecture", "models", *EVAL, other_architecture, (str(M), "encoder.net.0.weight", "declared architecture")),
    Case("pickle-instead-of-safetensors", "models", *EVAL, write(M, pickle.dumps(Trap())), (str(M), "not a valid safetensors file")),
    Case("model-folder-missing", "models", *EVAL, lambda: shutil.rmtree(M.parent), (str(M.parent), "not found", "dvc repro")),
    Case("pretrained-encoder-of-another-input-size", "models", "train", (DS, "erm", "0", *FAST, "method.erm.init=pretrained"),
         encoder_of_other_width, ("encoder.safetensors", "expects 7 inputs", "has 4")),
    # provenance (stages/core/provenance.py): a model is what its folder says, made from the prepared file as it is
    Case("weights-of-another-method", "models", "evaluate", (DS, "groupdro", "0"), copy_model(DS, "groupdro", 0, weights_only=True),
         (str(model_dir(DS, "groupdro", 0) / M.name), "trained as method 'erm'", "not 'groupdro'")),
    Case("weights-of-another-seed", "models", "evaluate", (DS, "erm", "1"), copy_model(DS, "erm", 1),
         (str(model_dir(DS, "erm", 1) / M.name), "trained with seed 0, not 1")),
    Case("weights-of-another-dataset", "models", "evaluate", ("colored_digits", "erm", "0"),
         lambda: (shutil.copy(P, prepared_path("colored_digits")), copy_model("colored_digits", "erm", 0)()),
         (str(model_dir("colored_digits", "erm", 0) / M.name), "trained on dataset 'gaussian_shortcut', not 'colored_digits'")),
    Case("prepared-file-changed-since-training", "models", *EVAL, rewrite(setitem("x", 0, 3.0)),
         (str(M), f"trained on another version of {P}", "dvc repro train@gaussian_shortcut-erm-0")),
    Case("weights-trained-under-other-settings", "models", *EVAL, edit_params("    hidden:\n    - 8\n", "    hidden:\n    - 64\n"),
         (str(M), "was trained under other settings of method.erm", "hidden: [8] there, [64] now", "dvc repro train@gaussian_shortcut-erm-0")),
]


def file_hashes(root: Path) -> dict[str, str]:
    files = [p for p in sorted((root / "data").rglob("*")) if p.is_file()] + [root / "params.yaml"]
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A workspace with a prepared file that validates, a trained erm model and its evaluation."""
    import os

    root = tmp_path_factory.mktemp("base")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        shutil.copy(REPO / "params.yaml", "params.yaml")
        shutil.copytree(REPO / "conf", "conf")
        assert config.main(["compose", *FAST]) == 0  # params.yaml holds FAST: every stage reads the same settings
        rewrite(lambda c: None)()
        assert validate.main([DS]) == 0
        assert train.main([DS, "erm", "0", *FAST]) == 0
        # META's kind is the real one (validate checks it against params.yaml) but its generator
        # params are empty: no regenerated shift curve
        assert evaluate.main([DS, "erm", "0", "evaluate.shift_regenerate_n=0"]) == 0
        (root / pretrained_dir(DS)).mkdir(parents=True)
    finally:
        os.chdir(cwd)
    return root


MAINS = {"train": train.main, "validate": validate.main, "evaluate": evaluate.main, "prepare": prepare.main, "config": config.main,
         "inspect": inspect.main}
# What a terminal would act on: C0/C1 control characters (ANSI escapes start with ESC) and bidi overrides.
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_a_clear_error_and_changes_nothing(case, base, tmp_path, monkeypatch, capsys):
    work = tmp_path / "w"
    shutil.copytree(base, work)
    monkeypatch.chdir(work)
    if case.mutate is not None:
        case.mutate()
    before = file_hashes(work)
    capsys.readouterr()

    code = MAINS[case.stage](list(case.args))

    out, err = capsys.readouterr()
    assert code == case.code, err
    assert "Traceback" not in out + err
    assert len(out) + len(err) < 20_000, len(out) + len(err)  # bounded, whatever the input holds
    assert not RAW_CONTROL.search(out + err), "raw control characters reach the terminal"
    if case.code:
        first = err.strip().splitlines()[0]
        assert first.startswith(f"{case.stage}: error: "), err
    else:
        assert not err, err
    shown = err if case.stream == "err" else out
    for name in case.names:
        assert name in shown, f"{name!r} not in {shown[:2000]!r}"
    documented = documented_message(case.id)
    if documented and case.code:  # docs/reliability.md shows what is printed (long ones cut at "…")
        printed = " ".join(shown.replace("`", "").split())
        for piece in (p.strip() for p in documented.split("…")):
            assert " ".join(piece.split()) in printed, f"docs/reliability.md row {case.id!r} is stale: {piece!r} not in {printed[:600]!r}"
    after = file_hashes(work)
    assert {k: after.get(k) for k in before} == before, "an existing file changed or vanished"
    assert all(re.fullmatch(r"data/validated/.*\.failed\.json", k) for k in set(after) - set(before)), set(after) - set(before)
    assert not (work / "unpickled").exists(), "a pickle was unpickled"


def test_errors_are_one_line_where_a_single_thing_is_wrong(base, tmp_path, monkeypatch, capsys):
    # Config and artifact errors about one key or file print exactly one line (validate lists each failed expectation).
    monkeypatch.chdir(base)
    for argv in (["compose", "experiment=nope"], ["check", "method.erm.lr=-1"]):
        assert config.main(argv) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def documented_message(case_id: str) -> str:
    """The "what the user gets" cell of `case_id`'s row in docs/reliability.md, without markdown escapes."""
    text = (REPO / "docs" / "reliability.md").read_text()
    m = re.search(rf"^\| `{re.escape(case_id)}` \|(.*)\|\s*$", text, flags=re.M)
    if m is None:
        return ""
    cell = re.split(r"(?<!\\)\|", m.group(1))[-1].strip()
    return cell.replace("\\|", "|").replace("`", "")


def test_docs_list_every_case():
    text = (REPO / "docs" / "reliability.md").read_text()
    text = text.split("\n## Bad inputs", 1)[1].split("\n## ", 1)[0]  # this table's section (tests/test_one_line_errors.py has the next)
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", text, flags=re.M)
    assert rows == [c.id for c in CASES]
    assert f"{len(CASES)} rows" in text

