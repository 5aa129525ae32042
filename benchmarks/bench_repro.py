"""Wall time and peak memory of the default `dvc repro`, in a temp copy of the repo.

    python -m benchmarks.bench_repro [--runs 3] [--experiment tiny]

Each run is a forced `dvc repro` of the whole DAG (default params unless --experiment).
Prints the median wall time, the per-stage-kind breakdown of the last run, and the peak
resident memory of any single stage process (ru_maxrss of the children).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.workspace import copy_project

ROOT = Path(__file__).resolve().parents[1]


def copy_repo(dest: Path) -> None:
    copy_project(ROOT, dest)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)


def timed_repro(repo: Path, env: dict[str, str], what: str) -> float:
    """`dvc repro` in `repo` (the venv's dvc), its wall time; on failure its output's tail and exit."""
    import subprocess
    import sys
    import time

    from pipeline.flows import dvc_bin

    t0 = time.perf_counter()
    proc = subprocess.run([dvc_bin(), "repro"], cwd=repo, env=env, text=True, capture_output=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{what}: dvc repro failed")
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--experiment", default=None)
    args = parser.parse_args(argv)
    env = dict(os.environ, SHIFTLAB_QUIET="1", DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        if args.experiment:
            subprocess.run([sys.executable, "-m", "stages.core.config", "compose", f"experiment={args.experiment}"],
                           cwd=repo, env=env, check=True)
        times = []
        log = ""
        for i in range(args.runs):
            t0 = time.perf_counter()
            proc = subprocess.run(["dvc", "repro", "--force"], cwd=repo, env=env, text=True, capture_output=True)
            times.append(time.perf_counter() - t0)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            log = proc.stdout
            print(f"run {i + 1}: {times[-1]:.1f} s", file=sys.stderr)
        stages = re.findall(r"Running stage '([^']+)'", log)
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print("| what | value |\n|---|---|")
    print(f"| `dvc repro --force` ({args.experiment or 'default params'}), median of {args.runs} | {statistics.median(times):.1f} s |")
    print(f"| runs | {', '.join(f'{t:.1f}' for t in times)} s |")
    print(f"| stages per run | {len(stages)} |")
    print(f"| peak RSS of one stage process | {peak_mb:.0f} MB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
