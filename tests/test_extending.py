"""docs/extending.md, followed to the letter: its files in a throw-away copy, its commands, the report."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.workspace import copy_project
from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
pytestmark = [pytest.mark.slow]


def doc_files() -> dict[str, str]:
    """Every block of the doc headed by "File `<path>`:"."""
    text = DOC.read_text()
    return dict(re.findall(r"^File `([^`]+)`:\n\n```\w*\n(.*?)^```", text, flags=re.M | re.S))


def doc_commands() -> list[str]:
    """The lines of the doc's bash block."""
    block = re.search(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
    assert block is not None
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def sh(cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    args = shlex.split(cmd)
    if args[0] == "make":  # the copy shares this test run's venv instead of building its own
        args.append(f"VENV={Path(sys.executable).parent.parent}")
    proc = subprocess.run(args, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_doc_names_one_module_and_one_yaml_each():
    files = doc_files()
    assert set(files) == {"stages/models/logreg.py", "conf/method/logreg.yaml", "stages/datasets/two_moons.py",
                          "conf/dataset/two_moons.yaml", "tests/test_logreg_two_moons.py"}
    assert doc_commands()[0] == "make params"


def test_following_the_doc_adds_a_method_and_a_dataset_end_to_end(tmp_path):
    copy_project(ROOT, tmp_path)
    for rel, text in doc_files().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(["git", "commit", "-qm", "doc"], cwd=tmp_path, check=True, env=project_env())
    for cmd in doc_commands():
        sh(cmd, tmp_path)

    # one file names each new kind (as the doc's `git grep --untracked` says)
    for kind, own in (("logreg", "stages/models/logreg.py"), ("two_moons", "stages/datasets/two_moons.py")):
        names = subprocess.run(["git", "grep", "--untracked", "-lw", kind, "--", "stages", "pipeline"], cwd=tmp_path,
                               capture_output=True, text=True).stdout.split()
        assert names == [own]
    # the doc's registrations are light: validating the whole config imports no torch or scikit-learn
    code = ("import sys; from stages.core import config, registry; registry.methods(); registry.datasets(); "
            "config.check_composed(config.load_params()); print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'sklearn'}))")
    light = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=project_env(), text=True, capture_output=True, check=True)
    assert light.stdout.strip() == "[]", light.stdout
    report = (tmp_path / "data/reports/report.md").read_text()
    assert "two_moons" in report and "logreg" in report
    board = pq.read_table(tmp_path / "data/reports/leaderboard.parquet").to_pylist()
    ood = {r["model"]: r for r in board if r["split"] == "test_ood" and r["dataset"] == "two_moons"}
    assert {"logreg", "lda", "lda_student"} <= set(ood)
    # the moons are learnable: logistic regression is well above chance in distribution
    iid = {r["model"]: r for r in board if r["split"] == "test_id" and r["dataset"] == "two_moons"}
    assert iid["logreg"]["acc"] > 0.8, iid["logreg"]
    # the model's type is read from the registry: logreg registered as discriminative
    assert "logreg" in report.split("two_moons", 1)[1]
