"""Issue 6's "done when", end to end: a Waterbirds download placed in data/raw/, `dvc add`-ed, and
`dvc exp run -S experiment=waterbirds` give the same artifacts and report as a built-in dataset.

The download is the tiny fixture of tests/test_real_datasets.py (the release's exact layout:
metadata.csv + species folders of JPEGs); the run is the real DVC experiment in a throw-away
copy of the project, with the experiment shrunk to two models on 8×8 pixels so it takes seconds;
erm is the recipe's own: a timm ResNet-50 from a weights file in data/weights/, SGD, streamed.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import timm
import torch
from safetensors.torch import save_file

from pipeline.workspace import copy_project
from stages.core import artifacts
from stages.core.artifacts import SPLITS
from stages.core.io import read_json, read_parquet
from tests.support import project_env
from tests.test_real_datasets import make_waterbirds

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["run.methods=[erm,lda]", "run.teachers=[]", "run.models=[erm,lda]", "dataset.waterbirds.resolution=8",
         "method.erm.epochs=2", "pretrain.epochs=1", "validate.min_group_count=1"]  # the fixture has 1-2 rows per group


def sh(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_dvc_exp_run_on_a_waterbirds_download(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_project(ROOT, repo)
    make_waterbirds(repo / "data" / "raw" / "waterbirds")
    # The recipe's ResNet-50 starts from the ImageNet weights the user supplies: a file of the same
    # network here (random, not ImageNet's), as docs/datasets.md says to make and place it.
    weights = repo / "data" / "weights" / "resnet50_imagenet.safetensors"
    weights.parent.mkdir(parents=True)
    torch.manual_seed(0)
    save_file(timm.create_model("resnet50", pretrained=False).state_dict(), str(weights))
    sh(["git", "init", "-q"], repo)
    # What docs/datasets.md tells a user to do after unpacking the download and making the weights.
    sh(["dvc", "add", "data/raw/waterbirds"], repo)
    sh(["dvc", "add", "data/weights"], repo)
    assert (repo / "data/raw/waterbirds.dvc").is_file()
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "waterbirds download"], repo)

    sh(["dvc", "exp", "run", "-n", "wb", "-S", "experiment=waterbirds", *(a for s in SMALL for a in ("-S", s))], repo)

    stages = sh(["dvc", "stage", "list", "--name-only"], repo).split()
    assert "prepare@waterbirds" in stages and "report" in stages
    assert not any("gaussian_shortcut" in s or "colored_digits" in s for s in stages)
    assert "up to date" in sh(["dvc", "status"], repo).lower()  # every stage ran and is recorded

    prepared = artifacts.read_prepared(repo / artifacts.prepared_path("waterbirds"))
    assert prepared.meta["x_dtype"] == "uint8" and prepared.meta["shape"] == [3, 8, 8]
    assert set(prepared.split) == set(SPLITS)
    assert np.array_equal(prepared.g, prepared.y * 2 + prepared.a)
    assert (repo / artifacts.validated_path("waterbirds")).is_file()

    board = read_parquet(repo / artifacts.REPORTS / "leaderboard.parquet", artifacts.LEADERBOARD_SCHEMA).to_pylist()
    assert {(r["dataset"], r["model"]) for r in board} == {("waterbirds", "erm"), ("waterbirds", "lda")}
    assert {r["split"] for r in board} >= {"test_id", "test_ood"}
    config = read_json(repo / artifacts.model_dir("waterbirds", "erm", 0) / "config.json")
    assert config["architecture"]["name"] == "resnet50" and config["config"]["optimizer"] == "sgd"
    assert config["weights"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert config["runtime"]["stream"] is True and config["runtime"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    for model in ("erm", "lda"):
        predictions = read_parquet(repo / artifacts.predictions_path("waterbirds", model, 0))
        assert predictions.num_rows == len(prepared.id)
    report = (repo / artifacts.REPORTS / "report.md").read_text()
    assert "waterbirds" in report
    assert "wb" in sh(["dvc", "exp", "list", "--name-only"], repo).split()
