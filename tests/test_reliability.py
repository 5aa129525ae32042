"""Concurrency (a workspace lock, tested with real processes), temp-file hygiene and security guards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from stages.core.io import sweep_stale_temps, write_parquet

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1"}


# ---- concurrency ----------------------------------------------------------------------------


@pytest.fixture
def dvc_project(tmp_path: Path) -> Path:
    """A real git+DVC project whose one stage runs until the file `release` appears."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=tmp_path, check=True, env=_env())
    (tmp_path / "dvc.yaml").write_text(textwrap.dedent("""
        stages:
          slow:
            cmd: python slow.py
            deps: [slow.py]
            outs: [out.txt]
    """))
    (tmp_path / "slow.py").write_text(textwrap.dedent("""
        import pathlib, time
        pathlib.Path("started").touch()
        while not pathlib.Path("release").exists():
            time.sleep(0.05)
        pathlib.Path("out.txt").write_text("done")
    """))
    return tmp_path


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"first run exited early: {proc.communicate()}"
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.05)


def _locked(project: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.lock", *args, "--root", str(project), "--", str(BIN / "dvc"), "repro"]


@pytest.mark.slow
@pytest.mark.xdist_group("reliability-dvc")
def test_second_run_fails_fast_naming_the_first_or_waits_for_it(dvc_project):
    first = subprocess.Popen(_locked(dvc_project), cwd=dvc_project, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(dvc_project / "started", first)
        # A second locked run fails fast, naming the first one's pid and command.
        t0 = time.monotonic()
        second = subprocess.run(_locked(dvc_project), cwd=dvc_project, env=_env(), text=True, capture_output=True, timeout=60)
        assert second.returncode == 75
        assert time.monotonic() - t0 < 20
        [line] = second.stderr.strip().splitlines()
        assert f"pid {first.pid} (`{BIN / 'dvc'} repro`" in line and "WAIT=1" in line
        # A bare `dvc repro` (no shiftlab lock) is stopped by DVC's own lock.
        bare = subprocess.run([str(BIN / "dvc"), "repro"], cwd=dvc_project, env=_env(), text=True, capture_output=True, timeout=60)
        assert bare.returncode != 0 and "lock" in (bare.stdout + bare.stderr).lower()
        # The flow refuses too (the lock is taken before anything of Prefect runs).
        from pipeline.flows import pipeline
        from pipeline.lock import WorkspaceBusy

        with pytest.raises(WorkspaceBusy, match=f"pid {first.pid} "):
            pipeline.fn(root=str(dvc_project))
        # With --wait the second run queues and completes once the first is done.
        waiting = subprocess.Popen(_locked(dvc_project, "--wait"), cwd=dvc_project, env=_env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.0)
        assert waiting.poll() is None, "a waiting run must not start while the first holds the lock"
        (dvc_project / "release").touch()
        assert first.wait(timeout=120) == 0
        out, err = waiting.communicate(timeout=120)
        assert waiting.returncode == 0, err
        assert f"waiting for pid {first.pid} " in err
    finally:
        (dvc_project / "release").touch()
        first.kill() if first.poll() is None else None
    assert (dvc_project / "out.txt").read_text() == "done"
    status = subprocess.run([str(BIN / "dvc"), "status"], cwd=dvc_project, env=_env(), text=True, capture_output=True)
    assert "up to date" in status.stdout.lower(), status.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("reliability-dvc")
def test_the_flow_refuses_a_workspace_where_a_bare_dvc_command_runs_stages(dvc_project, tmp_path):
    """`make repro` beside a running `dvc exp run` (or a bare `dvc repro`, neither of which takes the
    shiftlab lock) was 208 lines and 4 tracebacks: the flow now reads DVC's own read/write locks
    before Prefect starts and refuses in one line naming the command, exit 75."""
    first = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=dvc_project, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(dvc_project / "started", first)
        flow = subprocess.run([sys.executable, "-m", "pipeline.flows", "--root", str(dvc_project)], cwd=dvc_project,
                              env={**_env(), "PREFECT_HOME": str(tmp_path / "prefect")}, text=True, capture_output=True,
                              timeout=300)
        assert flow.returncode == 75, flow.stderr[-3000:]
        [line] = flow.stderr.strip().splitlines()
        assert line.startswith(f"pipeline: error: a DVC command is running stages in {dvc_project}: pid {first.pid} (`"), line
        assert line.endswith("let it finish and run again") and "Traceback" not in flow.stdout + flow.stderr
        assert "temporary server" not in flow.stdout + flow.stderr  # refused before Prefect's server started
    finally:
        (dvc_project / "release").touch()
        first.wait(timeout=120)
    assert (dvc_project / "out.txt").read_text() == "done"


def test_lock_is_released_when_its_holder_is_killed(tmp_path):
    (tmp_path / ".dvc").mkdir()
    holder = subprocess.Popen([sys.executable, "-m", "pipeline.lock", "--root", str(tmp_path), "--",
                               sys.executable, "-c", "import time; open('held', 'w'); time.sleep(60)"],
                              cwd=tmp_path, env=_env())
    try:
        _wait_for(tmp_path / "held", holder)
        busy = subprocess.run([sys.executable, "-m", "pipeline.lock", "--root", str(tmp_path), "--", "true"],
                              env=_env(), text=True, capture_output=True, timeout=60)
        assert busy.returncode == 75 and f"pid {holder.pid} " in busy.stderr
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs; the kernel drops the flock
        holder.wait()
    after = subprocess.run([sys.executable, "-m", "pipeline.lock", "--root", str(tmp_path), "--", "true"],
                           env=_env(), text=True, capture_output=True, timeout=60)
    assert after.returncode == 0, after.stderr


def test_lock_of_a_command_that_cannot_start_is_one_line_with_the_shells_exit_codes(tmp_path):
    """Before: a FileNotFoundError traceback (17 lines), exit 1; and `--root` of a folder that did
    not exist made it, with a .dvc/ inside (docs/reliability.md, row lock-root-not-a-workspace)."""
    (tmp_path / ".dvc").mkdir()
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho hi\n")  # not executable
    for command, code, reason in ((["no-such-command-shiftlab"], 127, "No such file or directory"),
                                  (["./script.sh"], 126, "Permission denied")):
        proc = subprocess.run([sys.executable, "-m", "pipeline.lock", "--root", str(tmp_path), "--", *command],
                              env=_env(), text=True, capture_output=True, timeout=60)
        assert proc.returncode == code, proc.stderr
        assert proc.stderr == f"lock: error: {command[0]}: {reason}\n"
    # the lock was released each time: a command that starts runs
    ok = subprocess.run([sys.executable, "-m", "pipeline.lock", "--root", str(tmp_path), "--", "true"],
                        env=_env(), text=True, capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


# ---- temp files of interrupted writes -------------------------------------------------------


def test_temps_of_dead_writers_are_swept_and_those_of_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    target = tmp_path / "t.parquet"
    stale_file = tmp_path / f".t.parquet.{dead}.abc123.tmp"
    stale_dir = tmp_path / f".t.parquet.{dead}.xyz_9.tmp"
    old_dir = tmp_path / f".t.parquet.old-{dead}"
    live = tmp_path / f".t.parquet.{os.getpid()}.live00.tmp"
    other = tmp_path / f".u.parquet.{dead}.abc123.tmp"  # another target's temp
    stale_file.write_text("partial")
    stale_dir.mkdir()
    old_dir.mkdir()
    live.write_text("in flight")
    other.write_text("partial")
    table = pa.table({"v": pa.array([1, 2], pa.int64())})
    write_parquet(table, target, table.schema)
    assert not stale_file.exists() and not stale_dir.exists() and not old_dir.exists()
    assert live.exists() and other.exists()
    assert sweep_stale_temps(tmp_path / "u.parquet") == [other]


def test_atomic_outputs_get_ordinary_file_permissions(tmp_path):
    """A temp file from mkstemp is 0600; the renamed output must be what a plain write gives."""
    from stages.core.io import write_json

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    table = pa.table({"v": pa.array([1], pa.int64())})
    for out in (write_parquet(table, tmp_path / "t.parquet", table.schema), write_json({"a": 1}, tmp_path / "t.json")):
        assert Path(out).stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    old = os.umask(0o077)
    try:
        private = write_json({"a": 1}, tmp_path / "private.json")
    finally:
        os.umask(old)
    assert Path(private).stat().st_mode & 0o777 == 0o600  # the user's umask still rules


def test_git_ignores_every_stage_output_but_not_the_raw_downloads():
    """Outputs are DVC's, not git's; data/raw/<name>.dvc files must stay visible to git AND to DVC.

    DVC's git backend (dulwich) must not see `data/` itself as ignored — with `/data/*` in
    .gitignore it did, never collected data/raw/*.dvc, and `dvc exp run` deleted the downloads.
    """
    import yaml
    from dvc.scm import SCM

    outs = []
    for stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].values():
        body = stage.get("do", stage)
        outs += [re.sub(r"\$\{[^}]*\}", "x", o if isinstance(o, str) else next(iter(o))) for o in body.get("outs", [])]
    assert outs and all(o.startswith("data/") for o in outs)
    # fetch@<source> writes data/raw/<source>: every source a dataset config names
    sources = [yaml.safe_load(f.read_text()).get("source", {}).get("name") for f in sorted((REPO / "conf/dataset").glob("*.yaml"))]
    assert "data/raw/x" in outs and len([s for s in sources if s]) >= 4
    outs = [o for o in outs if o != "data/raw/x"] + [f"data/raw/{s}" for s in sources if s]
    check = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-n", "-v"], cwd=REPO, input="\n".join(
        [*outs, "data/raw/waterbirds.dvc", "data/raw/.gitignore"]), capture_output=True, text=True).stdout.splitlines()
    # "<source>:<line>:<pattern>\t<path>"; "::\t<path>" when no pattern matches; a "!" pattern re-includes.
    verdict = {path: bool(how.split(":", 2)[2]) and not how.split(":", 2)[2].startswith("!")
               for how, path in (line.split("\t", 1) for line in check)}
    assert all(verdict[o] for o in outs), [o for o in outs if not verdict[o]]
    assert not verdict["data/raw/waterbirds.dvc"] and not verdict["data/raw/.gitignore"]
    scm = SCM(str(REPO))
    assert not scm.is_ignored(str(REPO / "data") + "/") and not scm.is_ignored(str(REPO / "data" / "raw") + "/")


def test_dvc_ignores_temp_files_of_interrupted_writes():
    patterns = (REPO / ".dvcignore").read_text().splitlines()
    assert ".*.tmp" in patterns and ".*.old-*" in patterns and "/scratch/" in patterns


# ---- security -------------------------------------------------------------------------------

SOURCE_DIRS = ("stages", "pipeline", "benchmarks")
FORBIDDEN = {
    r"\btorch\.load\s*\(": "torch.load unpickles",
    r"\bpickle\.loads?\s*\(": "pickle.load(s) runs code from the file",
    r"\b(c?pickle|dill|cloudpickle|joblib|shelve|marshal)\b\s*(import|\.)": "a pickle-family loader",
    r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|shelve|marshal)\b": "a pickle-family import",
    r"allow_pickle\s*=\s*True": "numpy loading pickles",
    r"shell\s*=\s*True": "a shell string built by the program",
    r"\bos\.(system|popen)\s*\(": "a shell command line",
    r"0\.0\.0\.0": "a server bound to every interface",
}


def _sources() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    files += [REPO / "Makefile"] + sorted((REPO / "conf").rglob("*.yaml"))
    files += [p for p in (REPO / "prefect.yaml", REPO / "dvc.yaml") if p.is_file()]
    return files


def test_no_unpickling_no_shell_strings_no_wildcard_binds_in_the_source():
    found = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {why}: {line.strip()}")
    assert found == []
    assert len(_sources()) > 20  # the scan saw the project


def test_forbidden_patterns_do_catch_what_they_forbid():
    samples = ["state = torch.load(path)", "pickle.loads(blob)", "import pickle", "np.load(f, allow_pickle=True)",
               "subprocess.run(cmd, shell=True)", "os.system('dvc repro')", "host='0.0.0.0'"]
    for sample in samples:
        assert any(re.search(p, sample) for p in FORBIDDEN), sample


def test_flow_refuses_a_stage_name_dvc_does_not_know():
    from pipeline.flows import check_stage

    known = ["prepare@gaussian_shortcut", "train@gaussian_shortcut-erm-0"]
    assert check_stage("train@gaussian_shortcut-erm-0", known) == "train@gaussian_shortcut-erm-0"
    for bad in ("--force", "train@x; rm -rf /", "prepare@gaussian_shortcut --all-pipelines"):
        with pytest.raises(ValueError, match="is not a stage of this DVC project"):
            check_stage(bad, known)


def test_servers_bind_to_localhost_by_default():
    from prefect.settings import get_current_settings

    assert str(get_current_settings().server.api.host) == "127.0.0.1"
