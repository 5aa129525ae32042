"""Issue 17, item 5: every refusal a user can cause from a command line is one line, exit 2.

Each case runs the real command (`python -m stages.<stage> ...`, `stages.core.config`,
`pipeline.inspect`, `pipeline.sweep`) as a subprocess in its own copy of a small workspace
(params.yaml, conf/, a prepared file), and asserts: exit code 2, stderr exactly one non-empty
line starting `<command>: error: ` and naming the offending thing, nothing on stdout, no
traceback, and every file that existed before keeps its bytes. The cases run concurrently
(each is a fresh interpreter; most refuse before importing torch). docs/reliability.md lists
the same rows, section "One line from the command line" (a test keeps them in step).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import project_env

REPO = Path(__file__).resolve().parents[1]
DS = "gaussian_shortcut"
SMALL = [f"dataset.{DS}.n_train=400", f"dataset.{DS}.n_val=100", f"dataset.{DS}.n_test_id=100", f"dataset.{DS}.n_test_ood=100"]
# Training that would take hours: a refusal before the command's 300 s timeout (a hang guard, not a
# timing) proves it never started.
LONG = ["method.erm.epochs=100000"]
SEED_RANGE = "[0, 4294967295]"
# One worker runs the module: the cases' fixture (every case, each a fresh interpreter) is built once,
# not once on each xdist worker that happens to draw one of its tests.
pytestmark = pytest.mark.xdist_group("one_line_errors")


def file_at(rel: str) -> Callable[[Path], None]:
    """A mutation: a plain file where the stage needs a folder (or its output folder's parent)."""
    def apply(root: Path) -> None:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("not a folder\n")
    return apply


def empty_params(root: Path) -> None:
    """The project's dvc.yaml beside an empty params.yaml (a workspace the flow can be pointed at)."""
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    (root / "params.yaml").write_text("")


def conflicted_lock(root: Path) -> None:
    """The project's dvc.yaml and a dvc.lock left with git's merge-conflict markers."""
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    (root / "dvc.lock").write_text("schema: '2.0'\nstages:\n<<<<<<< HEAD\n  a: {}\n=======\n  b: {}\n>>>>>>> other\n")


def dangling_data(root: Path, with_dvc_yaml: bool = False) -> None:
    """`data` a symlink to a folder that does not exist (an unmounted disk)."""
    shutil.rmtree(root / "data")
    (root / "data").symlink_to("/nonexistent/shiftlab-data")
    if with_dvc_yaml:
        shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")


def params_text(edit: Callable[[str], str]) -> Callable[[Path], None]:
    """A mutation of params.yaml's text."""
    def apply(root: Path) -> None:
        (root / "params.yaml").write_text(edit((root / "params.yaml").read_text()))
    return apply


def folder_at(rel: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        (root / rel).mkdir(parents=True)
    return apply


@dataclass(frozen=True)
class Case:
    id: str
    module: str  # python -m <module>
    args: tuple[str, ...]
    names: tuple[str, ...]  # each must appear in the error line
    mutate: Callable[[Path], None] | None = None
    name: str = ""  # the program's name in its error line, when it is not the module's last part

    @property
    def prog(self) -> str:
        return self.name or self.module.rsplit(".", 1)[-1]


CASES = [
    # seeds: the positional one and every seed key of params.yaml
    Case("seed-too-large", "stages.train", (DS, "erm", "99999999999999999999"), ("seed 99999999999999999999", SEED_RANGE)),
    Case("seed-negative", "stages.evaluate", (DS, "erm", "-1"), ("seed -1", SEED_RANGE)),
    Case("seed-not-an-integer-evaluate", "stages.evaluate", (DS, "erm", "zero"), ("seed", "'zero'")),
    Case("seed-out-of-range-in-params", "stages.core.config", ("check", "run.seeds=[0,-1]"), ("run.seeds", "seed -1", SEED_RANGE)),
    Case("seed-out-of-range-composed", "stages.core.config", ("compose", "run.seeds=[4294967296]"),
         ("run.seeds", "seed 4294967296", SEED_RANGE, "params.yaml is not written")),
    Case("dataset-seed-negative", "stages.prepare", (DS, f"dataset.{DS}.seed=-1"), (f"dataset.{DS}.seed", "seed -1", SEED_RANGE)),
    # outputs that cannot be written: refused before any work
    Case("output-parent-is-a-file", "stages.train", (DS, "erm", "0", *LONG), ("data/models", "a file is where the output folder"),
         file_at("data/models")),
    Case("output-folder-is-a-file", "stages.train", (DS, "erm", "0", *LONG), ("data/models/gaussian_shortcut/erm/seed=0", "a file is where"),
         file_at("data/models/gaussian_shortcut/erm/seed=0")),
    Case("output-file-is-a-folder", "stages.prepare", (DS, *SMALL), (f"data/prepared/{DS}.parquet", "a folder is where"),
         lambda root: (root / "data/prepared" / f"{DS}.parquet").unlink() or folder_at(f"data/prepared/{DS}.parquet")(root)),
    Case("validate-output-parent-is-a-file", "stages.validate", (DS,), ("data/validated", "a file is where"), file_at("data/validated")),
    Case("compose-output-is-a-folder", "stages.core.config", ("compose", "--params", "conf"), ("conf", "a folder is where")),
    # allocations that cannot succeed
    # (petabytes: beyond any address space, so no overcommit setting lets them succeed)
    Case("allocation-too-large-train", "stages.train", (DS, "erm", "0", "method.erm.hidden=[100000000000000]"),
         ("out of memory", "could not allocate 3.6 PiB", "hidden widths")),
    Case("allocation-too-large-prepare", "stages.prepare", (DS, f"dataset.{DS}.n_train=1000000000000000"),
         ("out of memory", "could not allocate", "PiB", "n_*")),
    # usage errors: one line, not argparse's usage block
    Case("missing-argument", "stages.train", (DS, "erm"), ("the following arguments are required: seed", "usage: python -m stages.train")),
    Case("unknown-option", "stages.evaluate", (DS, "erm", "0", "--bogus"), ("unrecognized arguments: --bogus",)),
    Case("override-without-equals", "stages.train", (DS, "erm", "0", "method.erm.lr"), ("'method.erm.lr'", "expected key=value")),
    Case("override-of-unknown-key", "stages.prepare", (DS, f"dataset.{DS}.nope=1"), (f"dataset.{DS}.nope", "unknown key")),
    Case("unknown-dataset", "stages.prepare", ("nope",), ("dataset.nope", "known")),
    Case("dataset-name-with-a-path", "stages.train", ("../prepared/gaussian_shortcut", "erm", "0"),
         ("dataset '../prepared/gaussian_shortcut'", "is not a name")),
    Case("params-is-a-folder", "stages.train", (DS, "erm", "0", "--params", "conf"), ("conf", "is a folder")),
    Case("config-unknown-command", "stages.core.config", ("nope",), ("invalid choice: 'nope'", "check", "compose")),
    Case("inspect-rows-not-a-number", "pipeline.inspect", ("data", "--rows", "x"), ("--rows", "'x'")),
    Case("inspect-rows-negative", "pipeline.inspect", ("data", "--rows", "-1"), ("--rows", "rows >= 0", "'-1'")),
    Case("dag-unknown-option", "stages.dag", ("--bogus",), ("unrecognized arguments: --bogus",)),
    Case("lock-root-not-a-workspace", "pipeline.lock", ("--root", "nowhere", "--", "true"), ("--root nowhere", "not a DVC workspace")),
    Case("sweep-grid-without-values", "pipeline.sweep", ("--grid", "method.erm.lr"), ("grid entry 'method.erm.lr'", "key=v1,v2")),
    Case("params-yaml-duplicate-key", "stages.core.config", ("check",), ("params.yaml: not valid YAML (found duplicate key run at line",),
         params_text(lambda t: t + "run:\n  seeds: [0]\n")),
    Case("params-yaml-tab", "stages.core.config", ("check",), ("params.yaml: not valid YAML (a TAB at line 2, column 1: YAML indents with spaces)",),
         params_text(lambda t: "x:\n\ty: 1\n" + t)),
    Case("flow-with-an-empty-params-yaml", "pipeline.flows", (), ("params.yaml: is empty", "no stage ran"), empty_params, "pipeline"),
    Case("flow-with-conflict-markers-in-dvc-lock", "pipeline.flows", (), ("dvc.lock: git merge-conflict markers (line 3: <<<<<<<)",),
         conflicted_lock, "pipeline"),
    Case("flow-with-data-a-dangling-symlink", "pipeline.flows", (), ("/data: a symlink to /nonexistent/shiftlab-data, which does not exist",),
         lambda root: dangling_data(root, with_dvc_yaml=True), "pipeline"),
    Case("prepare-with-data-a-dangling-symlink", "stages.prepare", (DS,), ("data: a symlink to /nonexistent/shiftlab-data",), dangling_data),
]


def file_hashes(root: Path) -> dict[str, str]:
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and "conf" not in p.relative_to(root).parts[:1]]
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """params.yaml, conf/ and a small prepared file (written by the prepare stage, in-process)."""
    from omegaconf import OmegaConf

    from stages import prepare
    root = tmp_path_factory.mktemp("one-line")
    params = OmegaConf.load(REPO / "params.yaml")
    for override in SMALL:
        key, value = override.split("=")
        OmegaConf.update(params, key, int(value), merge=False)
    OmegaConf.save(params, root / "params.yaml")
    shutil.copytree(REPO / "conf", root / "conf")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert prepare.main([DS]) == 0
    finally:
        os.chdir(cwd)
    return root


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float
    changed: list[str]
    work: Path


def run_case(case: Case, base: Path, work: Path) -> Outcome:
    shutil.copytree(base, work)
    if case.mutate is not None:
        case.mutate(work)
    before = file_hashes(work)
    env = {**project_env(), "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", case.module, *case.args], cwd=work, env=env, text=True,
                          capture_output=True, timeout=300)
    seconds = time.monotonic() - t0
    after = file_hashes(work)
    changed = sorted(k for k in before if after.get(k) != before[k]) + sorted(set(after) - set(before))
    return Outcome(proc.returncode, proc.stdout, proc.stderr, seconds, changed, work)


@pytest.fixture(scope="module")
def outcomes(base, tmp_path_factory) -> dict[str, Outcome]:
    """Every case, run concurrently (each a fresh interpreter in its own workspace copy)."""
    root = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c.id: pool.submit(run_case, c, base, root / c.id) for c in CASES}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_refusal_is_one_line_naming_the_offending_thing(case, outcomes):
    o = outcomes[case.id]
    assert o.code == 2, (o.code, o.err[-3000:])
    assert "Traceback" not in o.out + o.err, o.err[-3000:]
    lines = o.err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].strip(), o.err[-3000:]
    line = lines[0]
    assert line.startswith(f"{case.prog}: error: "), line
    for name in case.names:
        assert name in line, f"{name!r} not in {line!r}"
    assert o.out == "", o.out[-2000:]
    assert o.changed == [], f"files changed or appeared: {o.changed}"
    documented = documented_message(case.id)
    assert documented, f"docs/reliability.md has no row {case.id!r}"
    printed = " ".join(line.replace("`", "").split())
    for piece in (p.strip() for p in documented.split("…")):
        assert " ".join(piece.split()) in printed, f"docs/reliability.md row {case.id!r} is stale: {piece!r} not in {printed!r}"


def test_writability_cases_left_no_output_and_no_checkpoint(outcomes):
    # The training cases asked for 100000 epochs: nothing of a run may exist afterwards.
    for cid in ("output-parent-is-a-file", "output-folder-is-a-file"):
        work = outcomes[cid].work
        assert not list(work.glob("data/models/*/*/seed=0/*")), cid
        assert not (work / "scratch/checkpoints").is_dir() or not any((work / "scratch/checkpoints").iterdir()), cid
        assert (work / "data/prepared" / f"{DS}.parquet").is_file(), cid


def test_a_read_only_output_folder_stops_train_before_any_work(base, tmp_path, monkeypatch, capsys):
    """A read-only folder (EROFS / EACCES; root ignores chmod, so the OS error is simulated)."""
    import tempfile

    from stages import train
    from stages.core import io
    shutil.copytree(base, tmp_path / "w")
    monkeypatch.chdir(tmp_path / "w")
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # noqa: A002 (tempfile's own name)
        if dir is not None and "models" in str(dir):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(io.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr("stages.models.training.TrainJob", lambda *a, **k: pytest.fail("training started"))
    Path("data/models").mkdir()
    assert train.main([DS, "erm", "0", *LONG]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("train: error: data/models: output folder is not writable (Read-only file system); this stage writes "
                    "data/models/gaussian_shortcut/erm/seed=0 there: fix its permissions or free space and run again (nothing was done)")


def test_disk_full_during_a_stage_is_one_line(base, tmp_path, monkeypatch, capsys):
    from stages import validate
    shutil.copytree(base, tmp_path / "w")
    monkeypatch.chdir(tmp_path / "w")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "data/validated/gaussian_shortcut.json")

    monkeypatch.setattr(validate, "validate", full)
    assert validate.main([DS]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("validate: error: data/validated/gaussian_shortcut.json: No space left on device")


def test_seeds_at_the_ends_of_the_range_are_accepted():
    from stages.core.cli import parse_seed
    from stages.core.schema import SEED_MAX, ConfigError, seed_problem

    assert parse_seed("0") == 0 and parse_seed(str(SEED_MAX)) == SEED_MAX == 2**32 - 1
    for bad in (str(SEED_MAX + 1), "-1", "1_0", "0x10", "1e3", ""):
        with pytest.raises(ConfigError, match="seed"):
            parse_seed(bad)
    assert seed_problem(True) and seed_problem(1.0) and seed_problem(-1) and seed_problem(0) is None


def documented_message(case_id: str) -> str:
    """The "what the user gets" cell of `case_id`'s row in docs/reliability.md's one-line section."""
    m = re.search(rf"^\| `{re.escape(case_id)}` \|(.*)\|\s*$", one_line_section(), flags=re.M)
    if m is None:
        return ""
    cell = re.split(r"(?<!\\)\|", m.group(1))[-1].strip()
    return cell.replace("\\|", "|").replace("`", "")


def one_line_section() -> str:
    text = (REPO / "docs" / "reliability.md").read_text()
    return text.split("\n## One line from the command line", 1)[1].split("\n## ", 1)[0]


def test_docs_list_every_case():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", one_line_section(), flags=re.M)
    assert rows == [c.id for c in CASES]
    assert f"{len(CASES)} rows" in one_line_section()
