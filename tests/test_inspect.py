"""`python -m pipeline.inspect`: every artifact type, lineage from dvc.lock, corrupt and hostile input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from pipeline import inspect
from stages.core.artifacts import predictions_schema, prepared_schema
from stages.core.io import numpy_to_fixed_list, write_json, write_parquet


def _md5(p: Path) -> str:
    return hashlib.md5(p.read_bytes()).hexdigest()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny DVC-shaped project: a prepared file, a predictions file, metrics, weights, and a dvc.lock."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    n = 40
    rng = np.random.default_rng(0)
    split = ["train", "val", "test_id", "test_ood"] * (n // 4)
    y = rng.integers(0, 2, n)
    a = rng.integers(0, 2, n)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    base = {"id": np.arange(n), "split": split, "y": y, "a": a, "g": y * 2 + a}
    write_parquet(pa.table({**base, "x": numpy_to_fixed_list(x)}), "data/prepared/toy.parquet", prepared_schema(3),
                  {"dataset": "toy", "n_classes": 2, "n_attrs": 2, "shape": [3]})
    logits = np.eye(2, dtype=np.float32)[y]
    logits[:10] = logits[:10, ::-1]  # ten wrong predictions, rows 0..9
    table = pa.table({**base, "logits": numpy_to_fixed_list(logits), "pred": logits.argmax(1)})
    write_parquet(table, "data/predictions/toy/erm/seed=0.parquet", predictions_schema(2), {"dataset": "toy", "model": "erm", "seed": 0})
    write_json({"dataset": "toy", "test_ood_acc": 0.75, "splits": {}}, "data/metrics/toy/erm/seed=0.json")
    import torch

    from stages.core.io import save_weights

    save_weights({"w": torch.zeros(2, 3)}, "data/models/toy/erm/seed=0/model.safetensors", {"kind": "mlp", "in_dim": 3})
    lock = {
        "schema": "2.0",
        "stages": {
            "prepare@toy": {
                "cmd": "python -m stages.prepare toy",
                "deps": [{"path": "stages/prepare.py", "md5": "abc"}],
                "params": {"params.yaml": {"dataset.toy": {"seed": 0, "n_train": 10}}},
                "outs": [{"path": "data/prepared/toy.parquet", "md5": _md5(tmp_path / "data/prepared/toy.parquet")}],
            },
            "evaluate@toy-erm-0": {
                "cmd": "python -m stages.evaluate toy erm 0",
                "deps": [{"path": "data/prepared/toy.parquet", "md5": "def"}],
                "params": {"params.yaml": {"evaluate": {"ece_bins": 15}}},
                "outs": [
                    {"path": "data/predictions/toy/erm/seed=0.parquet", "md5": "0" * 32},  # stale on purpose
                    {"path": "data/metrics/toy/erm/seed=0.json", "md5": _md5(tmp_path / "data/metrics/toy/erm/seed=0.json")},
                ],
            },
            "train@toy-erm-0": {"cmd": "python -m stages.train toy erm 0", "outs": [{"path": "data/models/toy/erm/seed=0", "md5": "x.dir"}]},
        },
    }
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    return tmp_path


def test_prepared_parquet_schema_stats_and_lineage(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect.main(["data/prepared/toy.parquet"]) == 0
    out = capsys.readouterr().out
    for text in ("40 rows", "x: fixed_size_list<element: float>[3] not null", "dataset: toy", "first 5 rows:",
                 "split (string): nulls 0, distinct 4", "written by stage 'prepare@toy'", "matches dvc.lock",
                 "param dataset.toy.n_train: 10", "dep stages/prepare.py  md5 abc"):
        assert text in out, text
    info = inspect.inspect("data/prepared/toy.parquet")
    assert info["columns"]["y"]["min"] == 0 and info["columns"]["x"]["list_length"] == 3
    assert "group_accuracy" not in info


def test_predictions_get_a_per_group_accuracy_table_and_json(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect.main(["data/predictions/toy/erm/seed=0.parquet", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    table = info["group_accuracy"]
    total = {r["split"]: r for r in table if r["group"] == "all"}
    assert sum(r["n"] for r in total.values()) == 40
    assert sum(round(r["acc"] * r["n"]) for r in total.values()) == 30  # the 10 flipped rows are wrong
    assert info["lineage"]["stage"] == "evaluate@toy-erm-0" and info["lineage"]["matches_lock"] is False
    assert inspect.main(["data/predictions/toy/erm/seed=0.parquet"]) == 0
    out = capsys.readouterr().out
    assert "per-group accuracy" in out and "DIFFERS from dvc.lock" in out


def test_json_safetensors_and_directory(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect.main(["data/metrics/toy/erm/seed=0.json"]) == 0
    out = capsys.readouterr().out
    assert '"test_ood_acc": 0.75' in out and "evaluate@toy-erm-0" in out
    assert inspect.main(["data/models/toy/erm/seed=0/model.safetensors"]) == 0
    out = capsys.readouterr().out
    assert "w: F32 [2, 3]" in out and "train@toy-erm-0" in out and '"kind": "mlp"' in out
    assert inspect.main(["data"]) == 0
    out = capsys.readouterr().out
    assert "4 files" in out
    assert any(ln.split()[0] == "prepared/toy.parquet" and ln.split()[-1] == "prepare@toy" for ln in out.splitlines() if ln.strip())


def test_corrupt_and_non_artifact_files_exit_2_with_one_line(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = (project / "data/prepared/toy.parquet").read_bytes()
    bad = project / "data/broken.parquet"
    bad.write_bytes(good[: len(good) // 2])
    other = project / "notes.txt"
    other.write_text("hello")
    for path in (bad, other, project / "missing.parquet", project / "data/bad.json"):
        if path.name == "bad.json":
            path.write_text("{nope")
        assert inspect.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("inspect: error: ") and err.count("\n") == 1, err
        assert str(path) in err


def test_hostile_metadata_gives_bounded_output(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = {f"key{i}": "v" * 1_000_000 for i in range(3)} | {f"k{i}": i for i in range(200)}
    table = pa.table({"id": np.arange(3), "s": ["x" * 100_000] * 3, "l": pa.array([list(range(5000))] * 3)})
    write_parquet(table, "data/hostile.parquet", table.schema, meta)
    assert inspect.main(["data/hostile.parquet"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 40_000, len(out)
    assert "more keys" in out and "chars)" in out
    assert inspect.main(["data/hostile.parquet", "--json"]) == 0
    assert len(capsys.readouterr().out) < 80_000


def test_dvc_lock_is_parsed_once_while_it_is_unchanged_and_again_after_a_rewrite(project: Path) -> None:
    """`inspect data` asks for the lock once per file: it is parsed once (a 600-stage lock takes
    the pure-Python YAML loader ~30 s), and a lock DVC replaced is read anew."""
    from pipeline.workspace import read_lock

    first = read_lock(project)
    assert first is read_lock(project) and "stages" in first
    lock = project / "dvc.lock"
    text = yaml.safe_load(lock.read_text())
    text["stages"]["extra"] = {"cmd": "true"}
    tmp = project / "dvc.lock.new"
    tmp.write_text(yaml.safe_dump(text))
    tmp.replace(lock)  # as DVC writes it: a new file in its place
    again = read_lock(project)
    assert again is not first and "extra" in again["stages"]
    assert read_lock(project / "nowhere") is None


def test_a_reader_that_stops_early_gets_no_traceback(project: Path) -> None:
    """`python -m pipeline.inspect data | head -2`: the reader closes the pipe after two lines;
    inspect ends quietly with 0 (it was a BrokenPipeError traceback)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    for i in range(3000):  # a listing well past a pipe's buffer, so the writer meets the closed pipe
        (project / "data" / "many" / f"file-with-a-long-name-{i:05d}.json").parent.mkdir(exist_ok=True)
        (project / "data" / "many" / f"file-with-a-long-name-{i:05d}.json").write_text("{}")
    done = subprocess.run(f"'{sys.executable}' -m pipeline.inspect data | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("data") and done.stderr == "", (done.returncode, done.stderr)
