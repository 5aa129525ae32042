"""End to end on the tiny experiment, in a temp copy of the repo: `make repro`'s flow runs the
whole DAG once, then the real `dvc repro` / `dvc status` / `dvc exp run` work on what it left.

One session-scoped copy; the tests after it mutate it in order (they share one xdist group so
they run in this order in one worker). Plain serial `dvc repro` runs a whole DAG in
tests/test_builtin_datasets.py (shortcut_text) and parts of DAGs there and in test_hf_text.py,
test_backbones.py and test_unet_diffusion.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.workspace import copy_project
from stages.core import artifacts
from stages.core.io import read_json, read_parquet
from tests.support import flow_env, project_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dvc")]

DATASETS = ["gaussian_shortcut", "colored_digits"]
# The models the tiny experiment evaluates (a representative subset of the default run):
# its methods and the students of its teachers.
TINY_RUN = yaml.safe_load((ROOT / "conf" / "experiment" / "tiny.yaml").read_text())["run"]
MODELS = TINY_RUN["methods"] + [f"{t}_student" for t in TINY_RUN["teachers"]]




def sh(*cmd: str, cwd: Path, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env or project_env(), text=True, capture_output=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def lock_hashes(repo: Path) -> dict[str, str]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o.get("md5") for st in lock["stages"].values() for o in st.get("outs", [])}


@pytest.fixture(scope="session")
def repo(tmp_path_factory, prefect_home) -> Path:
    """A fresh git+DVC copy of the project with the tiny experiment composed into params.yaml,
    its whole DAG run once as `make repro` runs it: `python -m pipeline.flows` (Prefect's
    temporary server, each stage recorded by DVC as `dvc repro` records it, stage commands forked
    from a warm helper). The tests below then drive the real `dvc repro`, `dvc status` and `dvc exp
    run` on it: the first `dvc repro` finds nothing to do. Built once per test process (session
    scope: another module's tests running in between on the same worker must not make pytest tear
    it down and build it again)."""
    dest = tmp_path_factory.mktemp("repo")
    copy_project(ROOT, dest)
    sh("git", "init", "-q", cwd=dest)
    sh(sys.executable, "-m", "stages.core.config", "compose", "experiment=tiny", cwd=dest)
    sh("git", "add", "-A", cwd=dest)
    sh("git", "commit", "-qm", "init", cwd=dest)
    # Every stage notes the project modules it imported (stages/core/cli.py), for the deps test below.
    imports = dest / "scratch" / "imports"
    imports.mkdir(parents=True)
    proc = sh(sys.executable, "-m", "pipeline.flows", cwd=dest, env={**flow_env(prefect_home), "SHIFTLAB_IMPORTS": str(imports)})
    dest.joinpath("first_repro.log").write_text(proc.stdout + proc.stderr)
    return dest


def test_make_repro_runs_every_stage_and_writes_the_contract(repo):
    ran = ran_stages((repo / "first_repro.log").read_text())
    for ds in DATASETS:
        for stage in ("prepare", "validate", "pretrain"):
            assert f"{stage}@{ds}" in ran
        for m in ("erm", "lda", "groupdro"):
            assert f"train@{ds}-{m}-0" in ran
        assert f"distill@{ds}-lda-0" in ran
        for m in MODELS:
            assert f"evaluate@{ds}-{m}-0" in ran
    assert "report" in ran

    for ds in DATASETS:
        prepared = artifacts.read_prepared(repo / artifacts.prepared_path(ds))
        assert set(prepared.split) == set(artifacts.SPLITS)
        assert (prepared.g == prepared.y * prepared.n_attrs + prepared.a).all()
        assert read_json(repo / artifacts.validated_path(ds))["success"] is True
        assert (repo / artifacts.data_docs_dir(ds) / "index.html").is_file()
        emb = pq.read_table(repo / artifacts.pretrained_dir(ds) / "embeddings.parquet")
        assert emb.num_rows == len(prepared.id)
        for m in MODELS:
            mdir = repo / artifacts.model_dir(ds, m, 0)
            assert {"model.safetensors", "config.json", "history.parquet"} <= {p.name for p in mdir.iterdir()}
            preds = read_parquet(repo / artifacts.predictions_path(ds, m, 0), artifacts.predictions_schema(prepared.n_classes))
            assert preds.column("id").to_pylist() == prepared.id.tolist()
            metrics = read_json(repo / artifacts.metrics_path(ds, m, 0))
            for split in artifacts.SPLITS:
                s = metrics["splits"][split]
                for key in ("acc", "worst_group_acc", "avg_acc_weighted", "balanced_acc", "ece", "nll", "brier", "groups"):
                    assert key in s, (ds, m, split, key)
    board = pq.read_table(repo / "data/reports/leaderboard.parquet")
    assert board.num_rows == len(DATASETS) * len(MODELS) * len(artifacts.SPLITS)
    report = (repo / "data/reports/report.md").read_text()
    for ds in DATASETS:
        assert ds in report


def test_dvc_metrics_and_plots_show(repo):
    shown = sh("dvc", "metrics", "show", "--json", cwd=repo).stdout
    assert "test_ood_acc" in shown
    sh("dvc", "plots", "show", "-o", "dvc_plots", cwd=repo)
    assert (repo / "dvc_plots" / "index.html").stat().st_size > 0


def test_every_metric_recomputes_from_its_predictions_and_inspect_explains_every_file(repo):
    """Walk the run's artifacts: each metrics JSON is what stages.evaluation.metrics gives on its predictions file."""
    import numpy as np

    from pipeline import inspect
    from stages.core.io import fixed_list_to_numpy, fixed_precision
    from stages.evaluation.metrics import group_proportions, split_metrics
    from stages.evaluation.shift import reweighted_curve, shift_axis

    files = sorted((repo / "data" / "metrics").rglob("seed=*.json"))
    assert files
    for path in files:
        m = read_json(path)
        preds = read_parquet(repo / artifacts.predictions_path(m["dataset"], m["model"], m["seed"]))
        split = np.asarray(preds.column("split").to_pylist())
        z = fixed_list_to_numpy(preds.column("logits"))
        y, a, g = (preds.column(c).to_numpy() for c in ("y", "a", "g"))
        n_groups = m["n_classes"] * m["n_attrs"]
        props = group_proportions(g[split == "train"], n_groups)
        boot = m["bootstrap"]
        for i, s in enumerate(artifacts.SPLITS):
            k = split == s
            again = split_metrics(z[k], y[k], g[k], n_groups, props, m["ece_bins"], boot["resamples"], [boot["seed"], i])
            again.pop("reliability")
            stored = dict(m["splits"][s])
            stored.pop("loglik", None)
            assert fixed_precision(again) == stored, (path, s)
        pool = np.isin(split, ("test_id", "test_ood"))
        axis = shift_axis(y[split == "train"], a[split == "train"], m["n_classes"], m["shift"]["steps"])
        _, shift = reweighted_curve(z[pool].argmax(1) == y[pool], y[pool], a[pool], axis, m["n_attrs"],
                                    boot["resamples"], [boot["seed"], len(artifacts.SPLITS)])
        assert {k: m["shift"][k] for k in shift} == fixed_precision(shift), path
    assert (repo / "data/reports/report.html").stat().st_size > 10_000
    for path in sorted((repo / "data").rglob("*")):
        if path.is_file() and path.suffix in (".parquet", ".json", ".safetensors") and not any(p.endswith("_docs") for p in path.parts):
            info = inspect.inspect(path)
            assert info["lineage"] is not None or path.name.startswith("."), path


# The stage kinds tests/test_same_bytes.py does not already re-run in fresh processes (it runs
# prepare, train erm/lda/diffusion/dfr, evaluate and the report twice, under two machines'
# settings, and requires the same bytes): forcing those again here would cost their start-ups
# for no more coverage.
FORCED = ["validate@gaussian_shortcut", "pretrain@gaussian_shortcut", "distill@gaussian_shortcut-lda-0", "phase"]


def test_repro_is_a_no_op_then_forced_repro_is_byte_identical(repo):
    again = sh("dvc", "repro", cwd=repo)
    assert not ran_stages(again.stdout), again.stdout
    before = lock_hashes(repo)
    forced = sh("dvc", "repro", "--force", "--single-item", *FORCED, cwd=repo)
    assert ran_stages(forced.stdout) == set(FORCED), forced.stdout
    after = lock_hashes(repo)
    changed = {p for p in before if before[p] != after.get(p)}
    assert not changed, f"outputs differ between two forced runs: {sorted(changed)}"


def stale_stages(repo: Path) -> set[str]:
    return set(json.loads(sh("dvc", "status", "--json", cwd=repo).stdout))


def test_editing_code_makes_stale_exactly_the_stages_that_run_it(repo):
    """dvc.yaml's code deps are each stage's imports: a method's module only its own stages."""
    assert not stale_stages(repo)
    module = repo / "stages/models/diffusion.py"
    original = module.read_text()
    module.write_text(original + "\n# edited\n")
    try:
        stale = stale_stages(repo)
    finally:
        module.write_text(original)
    # the report asks every model's module whether it is generative, so it depends on all of stages/models
    expected = {f"{stage}@{ds}-diffusion-0" for stage in ("train", "evaluate") for ds in DATASETS} | {"report"}
    assert stale == expected, stale

    # stages/core, which every stage imports most of, is one folder dependency (stages/dag.py SHARED):
    # editing any of its modules makes stale exactly the stages that depend on the folder: all of them
    shared = repo / "stages/core/runtime.py"
    original = shared.read_text()
    shared.write_text(original + "\n# edited\n")
    try:
        stale = stale_stages(repo)
    finally:
        shared.write_text(original)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert {"train@gaussian_shortcut-erm-0", "evaluate@colored_digits-lda_student-0", "pretrain@gaussian_shortcut"} <= stale
    assert stale == {name for name, st in lock.items() if "stages/core" in {d["path"] for d in st["deps"]}} == set(lock)
    assert not stale_stages(repo)


def test_every_module_a_stage_imports_is_one_of_its_dvc_deps(repo):
    """The static closure (stages/dag.py) covers what each stage of the run really imported
    (recorded by the stages themselves during the fixture's `dvc repro`: SHIFTLAB_IMPORTS)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    logs = {p.stem: p for p in (repo / "scratch" / "imports").glob("*.txt")}
    assert set(logs) == set(lock), sorted(set(logs) ^ set(lock))  # every stage of the run, and only those
    for name, st in lock.items():
        deps = {d["path"] for d in st["deps"]}
        imported = set(logs[name].read_text().split())
        uncovered = {f for f in imported - deps if not any(f.startswith(d + "/") for d in deps)}
        assert imported and not uncovered, (name, sorted(uncovered))


def test_exp_run_with_a_method_override_reruns_only_that_method(repo):
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-qm", "ran", cwd=repo)
    proc = sh("dvc", "exp", "run", "-S", "experiment=tiny", "-S", "method.erm.lr=0.01", cwd=repo)
    ran = ran_stages(proc.stdout)
    expected = {f"train@{ds}-erm-0" for ds in DATASETS} | {f"evaluate@{ds}-erm-0" for ds in DATASETS} | {"report"}
    assert ran == expected, proc.stdout
    assert yaml.safe_load((repo / "params.yaml").read_text())["method"]["erm"]["lr"] == 0.01


def test_failed_validation_stops_downstream_and_keeps_outputs(repo):
    encoder = repo / artifacts.pretrained_dir("gaussian_shortcut") / "encoder.safetensors"
    before = encoder.read_bytes()
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["validate"]["min_group_count"] = 100_000
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = sh("dvc", "repro", "validate@gaussian_shortcut", "pretrain@gaussian_shortcut", cwd=repo, check=False)
    assert proc.returncode != 0
    assert "min_group_count" in proc.stdout + proc.stderr
    assert "pretrain@gaussian_shortcut" not in ran_stages(proc.stdout)
    assert encoder.read_bytes() == before
    # DVC removed validate's outputs before running it; checkout restores the last good ones.
    sh("dvc", "checkout", cwd=repo)
    assert json.loads((repo / artifacts.validated_path("gaussian_shortcut")).read_text())["success"] is True
