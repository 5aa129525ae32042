"""The validate stage: a GX suite built from the prepared file's metadata guards the pipeline."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages import validate as stage
from stages.core.artifacts import data_docs_dir, prepared_path, prepared_schema, validated_path
from stages.core.config import defaults
from stages.core.io import (
    iter_parquet_batches,
    numpy_to_fixed_list,
    read_parquet,
    write_parquet,
    write_parquet_stream,
)
from stages.datasets.images import PIXEL_ENCODING
from stages.validation import expectations, suite

DIM = 3
PARAMS = "validate:\n  min_group_count: 3\n  rho_tolerance: 0.05\n  min_shift: 0.2\n"
# Rows per group g = 2*y + a; groups 0 and 3 agree (a == y): agreement 0.75 in train, 0.25 in test_ood.
COUNTS = {
    "train": (9, 3, 3, 9),
    "val": (9, 3, 3, 9),
    "test_id": (9, 3, 3, 9),
    "test_ood": (3, 9, 9, 3),
}


def make_columns(counts: dict[str, tuple[int, ...]] = COUNTS) -> dict[str, np.ndarray]:
    """A valid 2-class × 2-attribute dataset as numpy columns (split as an object array)."""
    split, g = [], []
    for s, per_group in counts.items():
        for group, n in enumerate(per_group):
            split += [s] * n
            g += [group] * n
    g_arr = np.asarray(g, dtype=np.int64)
    return {
        "id": np.arange(len(g), dtype=np.int64) + 100,
        "split": np.asarray(split, dtype=object),
        "y": g_arr // 2,
        "a": g_arr % 2,
        "g": g_arr,
        "x": np.random.default_rng(0).normal(size=(len(g), DIM)).astype(np.float32),
    }


# The metadata keys stages.prepare writes that the suite's bounds come from.
BASE_META = {"kind": "test", "n_classes": 2, "n_attrs": 2, "shape": [DIM], "rho_train": 0.75, "rho_ood": 0.25}


def contract_table(cols: dict[str, np.ndarray], x: pa.Array) -> pa.Table:
    """The contract's columns from `cols`, with `x` as given (any list type, to test bad ones too)."""
    split = pa.array(cols["split"].tolist(), pa.string())
    return pa.table({"id": cols["id"], "split": split, "y": cols["y"], "a": cols["a"], "g": cols["g"], "x": x})


def write_prepared(
    dataset: str, cols: dict[str, np.ndarray], drop: tuple[str, ...] = (), **meta: object
) -> Path:
    """Write `cols` as a contract Parquet with the metadata keys stages.prepare writes."""
    metadata = {
        "dataset": dataset,
        **BASE_META,
        "params": {},
        "split_sizes": {s: int((cols["split"] == s).sum()) for s in COUNTS},
    } | meta
    metadata = {k: v for k, v in metadata.items() if k not in drop}
    table = contract_table(cols, numpy_to_fixed_list(cols["x"]))
    return write_parquet(table, prepared_path(dataset), prepared_schema(DIM), metadata)


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """One passing run, shared by the tests that inspect or must preserve its outputs."""
    root = tmp_path_factory.mktemp("validate")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        (root / "params.yaml").write_text(PARAMS)
        write_prepared("toy", make_columns())
        assert stage.main(["toy"]) == 0
    return root


@pytest.fixture
def validated_cwd(validated, monkeypatch):
    monkeypatch.chdir(validated)
    return validated


def outputs_hash() -> str:
    return hashlib.sha256(validated_path("toy").read_bytes()).hexdigest() + tree_hash(
        data_docs_dir("toy")
    )


def test_valid_data_passes_and_writes_json_and_docs(validated_cwd):
    report = json.loads(validated_path("toy").read_text())
    assert report["success"] and report["dataset"] == "toy" and report["n_failed"] == 0
    names = [e["name"] for e in report["expectations"]]
    for name in (
        "g_consistent",
        "train_rho",
        "ood_shifted",
        "x_finite",
        "id_unique",
        "min_group_count[test_ood]",
    ):
        assert name in names
    by_name = {e["name"]: e for e in report["expectations"]}
    assert by_name["train_rho"]["observed"] == pytest.approx(0.75)
    assert by_name["ood_shifted"]["observed"] == pytest.approx(0.5)
    assert by_name["min_group_count[val]"]["observed"] == 3
    assert all(e["success"] and e["type"].startswith("expect_") for e in report["expectations"])
    index = data_docs_dir("toy") / "index.html"
    assert index.is_file()
    # GX's remote tracking logo (current time + random context id) is replaced by the local copy
    assert "dataContextId" not in index.read_text()
    assert list((data_docs_dir("toy") / "validations").rglob("*.html"))


def test_rerun_gives_identical_json_and_docs(validated_cwd, capsys):
    before = outputs_hash()
    # A staging folder left by a killed run (its pid is gone) is swept by the next run.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = data_docs_dir("toy").parent / f".toy_docs.{dead}.k1lled00.tmp"
    (stale / "site").mkdir(parents=True)
    assert stage.main(["toy"]) == 0
    assert not stale.exists()
    out = capsys.readouterr().out.strip()
    n = json.loads(validated_path("toy").read_text())["n_expectations"]
    assert out == (
        f"validate: validated data/prepared/toy.parquet: {n}/{n} expectations passed; "
        "docs in data/validated/toy_docs/index.html; "
        + expectations.MISSING_SEPARATION.format(path="data/prepared/toy.parquet", dataset="toy")
    )
    assert outputs_hash() == before


def test_separation_and_prediction_are_reported_and_a_missing_one_is_a_note(validated_cwd, capsys):
    # toy's file predates `separation`: it validates, and the report says how to record it
    report = json.loads(validated_path("toy").read_text())
    assert report["separation"] is None and "re-run `dvc repro -f prepare@toy`" in report["predicted_direction"]
    # a closed-form regime: cue 10, core 2, its call "more"
    from stages.datasets.gaussian_shortcut import separation
    sep = separation(defaults("dataset", "gaussian_shortcut"))
    write_prepared("regime", make_columns(), separation=sep)
    assert stage.main(["regime"]) == 0
    out = capsys.readouterr().out
    more = "in the population, the LDA rule uses the cue more than logistic regression (a description of the data, not a prediction about the fitted models)"
    assert "separation cue 10 vs core 2" in out and more in out
    report = json.loads(validated_path("regime").read_text())
    assert report["success"] and report["separation"] == sep
    assert report["predicted_direction"] == more and report["metadata"]["separation"] == report["separation"]
    # an exact cue (closed form inf) is written as a string, never as invalid JSON
    write_prepared("exact", make_columns(), separation={"cue": float("inf"), "core": 2.0})
    assert stage.main(["exact"]) == 0
    assert json.loads(validated_path("exact").read_text())["separation"] == {"cue": "inf", "core": 2.0}
    write_prepared("badsep", make_columns(), separation={"cue": 1.0})
    assert stage.main(["badsep"]) == 2
    assert "'separation' must be {cue, core}" in capsys.readouterr().err


def _nan_feature(c):
    c["x"][5, 1] = np.nan


def _duplicate_id(c):
    c["id"][7] = c["id"][3]


def _inconsistent_g(c):
    c["g"][0] = 1  # row 0 is y=0, a=0, so g must be 0


def _missing_ood_group(c):
    keep = ~((c["split"] == "test_ood") & (c["g"] == 1))
    for k in c:
        c[k] = c[k][keep]


def _train_rho_off(c):
    # train becomes balanced (agreement 0.5) while the metadata still says 0.75
    c.update(make_columns({**COUNTS, "train": (6, 6, 6, 6)}))


def _no_shift(c):
    c.update(make_columns({**COUNTS, "test_ood": COUNTS["train"]}))


def _train_without_a_group(c):
    # group 2 (y=1, a=0) absent from train; the others keep train's agreement rate at 0.75
    c.update(make_columns({**COUNTS, "train": (3, 2, 0, 3)}))


@pytest.mark.parametrize(
    ("breakage", "failing", "detail"),
    [
        (_nan_feature, "x_finite", "column x_finite"),
        (_missing_ood_group, "min_group_count[test_ood]", "observed 0"),
        (_train_rho_off, "train_rho", "observed 0.5"),
        (_duplicate_id, "id_unique", "column id"),
        (_inconsistent_g, "g_consistent", "expect_column_pair_values_to_be_equal"),
        (_no_shift, "ood_shifted", "observed 0.0"),
        (_train_without_a_group, "groups_present[train]", "train has 0 example(s) of group g=2 (y=1, a=0)"),
    ],
)
def test_broken_data_fails_and_keeps_previous_outputs(validated_cwd, capsys, breakage, failing, detail):
    before = outputs_hash()
    cols = make_columns()
    breakage(cols)
    write_prepared("toy", cols)
    try:
        assert stage.main(["toy"]) == 2
    finally:
        write_prepared("toy", make_columns())
    err = capsys.readouterr().err
    failed_lines = [line for line in err.splitlines() if line.strip().startswith("- ")]
    assert [line.split(" (")[0].strip("- ") for line in failed_lines] == [failing], err
    assert detail in failed_lines[0]
    assert outputs_hash() == before
    failed = json.loads(validated_path("toy").with_suffix(".failed.json").read_text())
    assert not failed["success"] and failed["n_failed"] == 1
    assert [e["name"] for e in failed["expectations"] if not e["success"]] == [failing]
    # the next successful run clears the stale failure report
    assert stage.main(["toy"]) == 0
    assert not validated_path("toy").with_suffix(".failed.json").exists()


def failing(dataset: str) -> list[str]:
    """The names of the expectations the last (failed) run of `dataset` failed."""
    report = json.loads(validated_path(dataset).with_suffix(".failed.json").read_text())
    return [e["name"] for e in report["expectations"] if not e["success"]]


def test_a_file_prepared_for_another_dataset_or_kind_fails(validated_cwd, capsys):
    # the metadata names the dataset prepare was asked for: a file copied over another's fails
    cols = make_columns()
    write_parquet(contract_table(cols, numpy_to_fixed_list(cols["x"])), prepared_path("ident"), prepared_schema(DIM),
                  {"dataset": "other", **BASE_META, "params": {}})
    assert stage.main(["ident"]) == 2
    assert failing("ident") == ["metadata[dataset]"]
    assert "e.g. ['other']" in capsys.readouterr().err
    # where params.yaml declares the dataset's kind, the file's must be the same
    Path("kinds.yaml").write_text(PARAMS + "dataset:\n  ident:\n    kind: gaussian_shortcut\n")
    write_prepared("ident", make_columns())  # kind "test"
    assert stage.main(["ident", "--params", "kinds.yaml"]) == 2
    assert failing("ident") == ["metadata[kind]"]
    err = capsys.readouterr().err
    assert "e.g. ['test']" in err and "value_set=['gaussian_shortcut']" in err
    write_prepared("ident", make_columns(), kind="gaussian_shortcut")
    assert stage.main(["ident", "--params", "kinds.yaml"]) == 0


def test_an_image_file_listed_twice_fails(validated_cwd):
    cols = make_columns()
    files = [f"img/{i:03d}.jpg" for i in range(len(cols["id"]))]
    files[40] = files[1]  # a train image again, in val
    table = contract_table(cols, numpy_to_fixed_list(cols["x"])).append_column("file", pa.array(files, pa.string()))
    write_parquet(table, prepared_path("files"), table.schema, {"dataset": "files", **BASE_META, "params": {}})
    assert stage.main(["files"]) == 2
    bad = [e for e in report_of("files")["expectations"] if not e["success"]]
    assert [e["name"] for e in bad] == ["file_unique"] and bad[0]["unexpected_rows"] == [1, 40]


def test_missing_metadata_key_is_a_clear_error(validated_cwd, capsys):
    write_prepared("nometa", make_columns(), drop=("rho_train",))
    assert stage.main(["nometa"]) == 2
    assert "rho_train" in capsys.readouterr().err
    assert not validated_path("nometa").exists()


def test_required_shift_follows_configured_shift():
    cfg = defaults("validate", "default", min_group_count=3, rho_tolerance=0.05, min_shift=0.2)
    assert expectations.required_shift(0.95, 0.05, cfg) == 0.2
    assert expectations.required_shift(0.9, 0.8, cfg) == pytest.approx(0.05)  # small configured shift
    # a no-shift control still gets the expectation, with a bound it can meet
    assert expectations.required_shift(0.9, 0.9, cfg) == 0.0


def test_suite_bounds_come_from_metadata():
    meta = {"n_classes": 3, "n_attrs": 4, "shape": [2, 5], "rho_train": 0.9, "rho_ood": 0.1}
    suite = expectations.build_checks(meta, defaults("validate", "default"))
    checks = {c.name: c for c in suite}
    assert len(checks) == len(suite)  # names are unique identifiers
    assert checks["domain[g]"].kwargs["value_set"] == list(range(12))
    assert checks["x_len"].kwargs["value_set"] == [10]
    assert (checks["train_rho"].kwargs["min_value"], checks["train_rho"].kwargs["max_value"]) == (
        0.85,
        0.95,
    )


# ---- x is streamed, never held whole ---------------------------------------------------------------

BATCH_ROWS = 5  # X_BATCH_BYTES below makes batches of this many rows of 3 uint8/float32 features


def pixel_table(cols: dict[str, np.ndarray]) -> pa.Table:
    """`cols` with x as uint8 pixels, the way stages/datasets/images.py stores images."""
    pixels = (np.abs(cols["x"]) * 60).astype(np.uint8)
    return contract_table(cols, numpy_to_fixed_list(pixels, pa.uint8()))


PIXEL_META = {**BASE_META, "x_dtype": "uint8"}


def write_pixels_streamed(dataset: str, table: pa.Table, row_group_size: int) -> Path:
    """Write like images.py: row groups of `row_group_size` rows, byte-stream-split pixels."""
    schema = prepared_schema(DIM, "uint8")
    with write_parquet_stream(
        prepared_path(dataset), schema, row_group_size, column_encoding=PIXEL_ENCODING
    ) as (stream, meta):
        for start in range(0, table.num_rows, 11):  # arrives in blocks, as decoded images do
            stream.write(table.slice(start, 11))
        meta.update(PIXEL_META, dataset=dataset)
    return prepared_path(dataset)


def report_of(dataset: str) -> dict:
    """The expectations and metadata of the last run's report, passing or failing, without the
    file-identity expectations (`metadata[...]`, which name the dataset)."""
    path = validated_path(dataset)
    failed = path.with_suffix(".failed.json")
    report = json.loads((failed if failed.exists() else path).read_text())
    expectations = [e for e in report["expectations"] if not e["name"].startswith("metadata[")]
    return {"expectations": expectations, "metadata": report["metadata"]}


@pytest.mark.parametrize("broken", [False, True], ids=["valid", "duplicate-id-across-row-groups"])
def test_multi_row_group_uint8_file_validates_like_one_row_group(validated_cwd, monkeypatch, broken):
    monkeypatch.setattr(stage, "X_BATCH_BYTES", BATCH_ROWS * DIM)
    cols = make_columns()
    if broken:
        cols["id"][70] = cols["id"][2]  # far apart: different row groups and batches
    table = pixel_table(cols)
    one = write_parquet(
        table,
        prepared_path("pix1"),
        prepared_schema(DIM, "uint8"),
        {**PIXEL_META, "dataset": "pix1"},
    )
    many = write_pixels_streamed("pixn", table, row_group_size=7)
    n_groups = -(-table.num_rows // 7)
    assert pq.ParquetFile(one).num_row_groups == 1
    assert pq.ParquetFile(many).num_row_groups == n_groups
    code = 2 if broken else 0
    assert stage.main(["pix1"]) == code
    assert stage.main(["pixn"]) == code
    one_report, many_report = report_of("pix1"), report_of("pixn")
    assert many_report == one_report
    by_name = {e["name"]: e for e in many_report["expectations"]}
    assert by_name["x_len"]["success"] and by_name["x_len"]["element_count"] == table.num_rows
    assert by_name["id_unique"]["success"] is not broken
    if broken:
        assert by_name["id_unique"]["unexpected_rows"] == [2, 70]


def test_x_is_streamed_in_bounded_batches_never_read_whole(validated_cwd, monkeypatch):
    monkeypatch.setattr(stage, "X_BATCH_BYTES", BATCH_ROWS * DIM)
    table = pixel_table(make_columns())
    write_pixels_streamed("pixspy", table, row_group_size=16)
    whole_reads, batches, frames = [], [], {}

    def spy_read(path, schema=None, columns=None):
        whole_reads.append(columns)
        return read_parquet(path, schema, columns)

    def spy_batches(path, columns, max_bytes):
        for batch in iter_parquet_batches(path, columns, max_bytes):
            batches.append((batch.schema.names, batch.num_rows))
            yield batch

    def spy_suite(f, checks, dataset, docs_out):
        frames.update(f)
        return run_suite(f, checks, dataset, docs_out)

    run_suite = suite.run_suite
    monkeypatch.setattr(stage, "read_parquet", spy_read)
    monkeypatch.setattr(stage, "iter_parquet_batches", spy_batches)
    monkeypatch.setattr(stage, "run_suite", spy_suite)
    assert stage.main(["pixspy"]) == 0
    # the whole-file read leaves x out; x comes only in batches of at most BATCH_ROWS rows
    assert whole_reads == [["id", "split", "y", "a", "g"]]
    assert all(names == ["x"] for names, _ in batches)
    assert max(n for _, n in batches) == BATCH_ROWS
    assert sum(n for _, n in batches) == table.num_rows
    # the frame GX sees holds one flag per row for x, not the features
    x = frames["rows"]["x"]
    assert len(x) == table.num_rows and all(v is True for v in x)
    assert (frames["rows"]["x_len"] == DIM).all()


def test_corrupt_x_is_reported_row_wise_across_batches(validated_cwd, monkeypatch, capsys):
    """Variable-length, null and non-finite rows of x far past the first batch name their rows."""
    monkeypatch.setattr(stage, "X_BATCH_BYTES", BATCH_ROWS * DIM)
    cols = make_columns()
    n = len(cols["id"])
    rows: list = [list(map(float, r)) for r in cols["x"]]
    rows[12] = None
    rows[23] = rows[23][:2]
    rows[31][1] = float("inf")
    table = contract_table(cols, pa.array(rows, pa.list_(pa.float32())))
    meta = {**PIXEL_META, "x_dtype": "float32", "dataset": "corrupt"}
    write_parquet(table, prepared_path("corrupt"), table.schema, meta)
    assert stage.main(["corrupt"]) == 2
    err = capsys.readouterr().err
    by_name = {e["name"]: e for e in report_of("corrupt")["expectations"] if not e["success"]}
    assert sorted(by_name) == ["not_null[x]", "x_finite", "x_len"], err
    assert by_name["not_null[x]"]["unexpected_rows"] == [12]
    assert by_name["x_len"]["unexpected_rows"] == [23]
    assert by_name["x_len"]["unexpected_examples"] == [2]
    assert by_name["x_finite"]["unexpected_rows"] == [31]
    assert by_name["x_len"]["element_count"] == n
    assert "x_len" in err and "rows [23]" in err


@pytest.mark.parametrize(
    ("domain", "breakage", "failing_names"),
    [
        ({"range": [-5.0, 5.0]}, None, []),
        ({"range": [-5.0, 5.0]}, (4, 0, 9.0), ["x_range"]),
        ({"binary_from": 1}, None, []),
        ({"binary_from": 1}, (6, 2, 0.5), ["x_binary"]),
        ({"range": [0.0, 1.0], "binary_from": 0}, (3, 1, 2.0), ["x_range", "x_binary"]),
    ],
)
def test_declared_x_domain_is_checked_row_by_row(validated_cwd, domain, breakage, failing_names):
    # a real data set declares what its features may hold (pixels in [0, 1], 0/1 attributes):
    # the suite checks every row against it; undeclared, the checks are absent
    cols = make_columns()
    x = cols["x"]
    if "binary_from" in domain:
        x[:, domain["binary_from"]:] = (x[:, domain["binary_from"]:] > 0).astype(np.float32)
    if domain.get("range") == [0.0, 1.0]:
        x[:] = (x > 0).astype(np.float32)
    if breakage is not None:
        row, col, value = breakage
        x[row, col] = value
    write_prepared("dom", cols, x_domain=domain)
    code = stage.main(["dom"])
    assert code == (2 if failing_names else 0)
    if failing_names:
        assert failing("dom") == failing_names
    else:
        names = [e["name"] for e in json.loads(validated_path("dom").read_text())["expectations"]]
        assert ("x_range" in names) == ("range" in domain) and ("x_binary" in names) == ("binary_from" in domain)
    write_prepared("plain", make_columns())
    assert stage.main(["plain"]) == 0
    names = [e["name"] for e in json.loads(validated_path("plain").read_text())["expectations"]]
    assert "x_range" not in names and "x_binary" not in names


def test_a_malformed_x_domain_names_the_file(validated_cwd, capsys):
    write_prepared("baddom", make_columns(), x_domain={"range": [1.0, 0.0]})
    assert stage.main(["baddom"]) == 2
    err = capsys.readouterr().err
    assert "x_domain is malformed" in err and "baddom.parquet" in err
