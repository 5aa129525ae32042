"""A failed experiment leaves the workspace as it was (docs/reliability.md, "A failed experiment").

`dvc exp run` first checks out the workspace for the experiment's DAG, which deletes the outputs
of every stage the experiment does not have (DVC's "unused links": a recipe on another dataset
has none of the default run's stages). A recipe whose download is missing or malformed must
therefore be refused while DVC composes params.yaml, before that checkout: the real `dvc exp
run`, in a throw-away git + DVC copy of the project with real outputs checked out.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.workspace import copy_project
from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow]


def sh(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def workspace(root: Path) -> dict[str, bytes]:
    """Every file of the workspace DVC or the user could lose: data/, params.yaml, dvc.lock."""
    files = [p for p in (root / "data").rglob("*") if p.is_file()] + [root / "params.yaml", root / "dvc.lock"]
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed project whose gaussian_shortcut data is prepared and validated by `dvc repro`."""
    repo = tmp_path_factory.mktemp("exp") / "repo"
    repo.mkdir()
    copy_project(ROOT, repo)
    sh(["git", "init", "-q"], repo)
    sh(["dvc", "repro", "validate@gaussian_shortcut"], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "default run, in part"], repo)
    return repo


def test_an_experiment_on_a_dataset_not_downloaded_is_refused_before_anything_is_removed(repo):
    before = workspace(repo)
    assert "data/prepared/gaussian_shortcut.parquet" in before
    proc = sh(["dvc", "exp", "run", "-S", "experiment=civilcomments"], repo, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "data/raw/civilcomments: raw data folder for 'civilcomments' not found" in out, out
    assert "Traceback" not in out
    assert workspace(repo) == before  # every output, params.yaml and dvc.lock as they were


def test_a_download_missing_a_column_is_refused_naming_the_file_and_column(repo):
    raw = repo / "data" / "raw" / "civilcomments"
    raw.mkdir(parents=True)
    (raw / "all_data_with_identities.csv").write_text("comment_text,split,male\nhello,train,0\n")
    try:
        before = workspace(repo)
        proc = sh(["dvc", "exp", "run", "-S", "experiment=civilcomments"], repo, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert "all_data_with_identities.csv: missing column(s) ['toxicity'" in out, out
        assert workspace(repo) == before
    finally:
        (raw / "all_data_with_identities.csv").unlink()
        raw.rmdir()


def test_make_check_says_the_same_before_make_repro(repo, tmp_path):
    """`stages.core.config check` (what `make repro` runs first) looks for the same inputs."""
    params = tmp_path / "params.yaml"
    sh(["python", "-m", "stages.core.config", "compose", "--params", str(params), "experiment=civilcomments"], repo)
    proc = sh(["python", "-m", "stages.core.config", "check", "--params", str(params)], repo, check=False)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("config: error: data/raw/civilcomments: raw data folder for 'civilcomments' not found")


def test_an_experiment_on_a_device_this_machine_lacks_is_refused_before_anything_runs(repo):
    """`-S runtime.device=cuda:99`: refused while DVC composes params.yaml (stages.core.config
    check_inputs resolves the runtime), not in the first stage after DVC's checkout rewrote the
    workspace: every output, params.yaml and dvc.lock as they were."""
    before = workspace(repo)
    proc = sh(["dvc", "exp", "run", "-S", "runtime.device=cuda:99", "-S", "run.datasets=[gaussian_shortcut]"], repo, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "runtime.device=cuda:99: this machine has" in out and "params.yaml is not written and no stage runs" in out, out
    assert "Traceback" not in out
    assert workspace(repo) == before
