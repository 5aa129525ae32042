"""The DAG in parallel: serial `dvc repro --force` against the `pipeline` flow at 1 and 2 stages at once.

    python -m benchmarks.bench_parallel [--runs 3] [--override KEY=VALUE ...] [--noop-stages 24]
                                        [--skip-dag] [--skip-fixed]

In a temp copy of the repo (params composed from conf/ with the `--override`s; default: the
default DAG), with a Prefect server (the one at PREFECT_API_URL when it answers, else one
started here and stopped after):

1. `--runs` rounds of `dvc repro --force`, `python -m pipeline.flows --force --max-parallel 1`
   and `... --max-parallel 2`, the order rotating each round; medians. After every run the
   output hashes in dvc.lock must equal those of the first serial run and, after a flow run,
   `dvc status` must be clean (the benchmark stops otherwise). Target: the flow at 2 <= 0.55 x
   serial.
2. From the stage times the flow at 1 logged (`<stage> ran in X s`): the total work, the
   critical path, and the wall time predicted at 4, 8 and 16 cores (lower bound
   max(critical path, work / k); Graham's list-scheduling bound work / k + critical path).
3. The fixed cost per stage (`--noop-stages` stages whose command does nothing but start like a
   stage: `python -m noop <i>` importing what the stages import, then writing one file), in a
   bare DVC project: serial `dvc repro --force` and the flow at 1, per stage; and the same
   with the command `true`, which leaves DVC's (or the flow's) own bookkeeping alone.

Prints a markdown table (the README's figures come from it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from benchmarks.bench_flow import copy_repo, each, env, healthy, start_server

ROOT = Path(__file__).resolve().parents[1]
FLOW = [sys.executable, "-m", "pipeline.flows"]
NOOP = """
import sys
import numpy, pandas, pyarrow.parquet, polars, omegaconf, torch  # what a stage imports before its work
open(f"out/{sys.argv[1]}.txt", "w").write(sys.argv[1])
"""


def timed(cmd: Sequence[str], cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(list(cmd), cwd=cwd, env=env(), text=True, capture_output=True)
    took = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return took, proc.stdout + proc.stderr


def out_hashes(repo: Path) -> dict[str, list[tuple[str, str]]]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {s: sorted((o["path"], o.get("md5", "")) for o in e.get("outs", [])) for s, e in lock.items()}


def clean(repo: Path) -> bool:
    _, out = timed(["dvc", "status"], repo)
    return "up to date" in out


def bench_dag(repo: Path, runs: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    kinds = {"serial": ["dvc", "repro", "--force"], "flow-1": [*FLOW, "--force", "--max-parallel", "1"],
             "flow-2": [*FLOW, "--force", "--max-parallel", "2"]}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    stage_s: dict[str, float] = {}
    timed(["dvc", "repro"], repo)  # warm: imports, DVC's state db, every output once
    reference = out_hashes(repo)
    names = list(kinds)
    for i in range(runs):
        for what in names[i % 3:] + names[: i % 3]:
            took, out = timed(kinds[what], repo)
            times[what].append(took)
            if out_hashes(repo) != reference:
                sys.exit(f"{what}: dvc.lock output hashes differ from the serial run's")
            if what != "serial" and not clean(repo):
                sys.exit(f"{what}: dvc status is not clean after the flow")
            if what == "flow-1":
                for stage, s in re.findall(r"(\S+) ran in ([0-9.]+) s", out):
                    stage_s.setdefault(stage, float(s))
            print(f"round {i + 1}: {what} {took:.1f} s", file=sys.stderr)
    return times, stage_s


def critical_path(stage_s: dict[str, float], upstream: dict[str, set[str]], order: Sequence[str]) -> float:
    finish: dict[str, float] = {}
    for s in order:
        finish[s] = stage_s.get(s, 0.0) + max((finish[u] for u in upstream.get(s, ())), default=0.0)
    return max(finish.values(), default=0.0)


def noop_project(root: Path, n: int, command: str) -> Path:
    root.mkdir(parents=True)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        timed(cmd, root)
    (root / "out").mkdir()
    (root / "noop.py").write_text(textwrap.dedent(NOOP))
    cmd = "python -m noop ${item}" if command == "noop" else "true && echo ${item} > out/${item}.txt"
    (root / "dvc.yaml").write_text(
        f"stages:\n  s:\n    foreach: {list(range(n))}\n    do:\n      cmd: {cmd}\n      outs:\n        - out/${{item}}.txt\n")
    return root


def bench_fixed(base: Path, n: int, runs: int) -> dict[str, float]:
    per: dict[str, float] = {}
    for command in ("noop", "true"):
        root = noop_project(base / command, n, command)
        timed(["dvc", "repro"], root)
        flow = [*FLOW, "--root", str(root)]  # run from the project (its `pipeline` package)
        for what, cmd, cwd in (("dvc repro", ["dvc", "repro", "--force"], root), ("flow", [*flow, "--force", "--max-parallel", "1"], ROOT)):
            took = [timed(cmd, cwd)[0] for _ in range(runs)]
            # the flow's own start (Prefect client, DVC's graph) is paid once a run: a run with nothing to do
            start = statistics.median(timed(flow, ROOT)[0] for _ in range(runs)) if what == "flow" else 0.0
            per[f"{what}, `{'python -m noop' if command == 'noop' else 'true'}`"] = (statistics.median(took) - start) / n
            print(f"fixed cost: {what} {command}: {each(took)} - start {start:.1f} s over {n} stages", file=sys.stderr)
    return per


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], help="Hydra override (default: none, the default DAG)")
    parser.add_argument("--noop-stages", type=int, default=24)
    parser.add_argument("--skip-dag", action="store_true")
    parser.add_argument("--skip-fixed", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shiftlab-bench-parallel-") as tmp:
        server = None
        url = os.environ.get("PREFECT_API_URL", "")
        if not (url and healthy(url)):
            server, url = start_server(Path(tmp) / "prefect-home")
        os.environ["PREFECT_API_URL"] = url
        try:
            rows = [("cores", str(len(os.sched_getaffinity(0))))]
            if not args.skip_dag:
                repo = Path(tmp) / "repo"
                repo.mkdir()
                copy_repo(repo, args.override)
                times, stage_s = bench_dag(repo, args.runs)
                med = {k: statistics.median(v) for k, v in times.items()}
                from pipeline.flows import stage_graph

                order, upstream = stage_graph(repo)
                work, cp = sum(stage_s.values()), critical_path(stage_s, upstream, order)
                rows += [
                    (f"`dvc repro --force`, {len(order)} stages, median of {args.runs} ({each(times['serial'])})", f"{med['serial']:.1f} s"),
                    (f"flow, 1 stage at a time ({each(times['flow-1'])})", f"{med['flow-1']:.1f} s ({med['flow-1'] / med['serial']:.2f} x)"),
                    (f"flow, 2 stages at once ({each(times['flow-2'])}; target <= 0.55 x)", f"**{med['flow-2']:.1f} s ({med['flow-2'] / med['serial']:.2f} x)**"),
                    ("output hashes in dvc.lock, every run", "identical to the serial run's; `dvc status` clean after each flow"),
                    ("total stage work (sum of the stage times the flow at 1 logged)", f"{work:.1f} s"),
                    ("critical path (longest chain of stage times)", f"{cp:.1f} s"),
                ]
                for k in (4, 8, 16):
                    rows.append((f"predicted wall at {k} cores (max(cp, work/k) .. work/k + cp)", f"{max(cp, work / k):.1f} .. {work / k + cp:.1f} s"))
            if not args.skip_fixed:
                for what, s in bench_fixed(Path(tmp) / "fixed", args.noop_stages, args.runs).items():
                    rows.append((f"fixed cost per stage: {what} (median of {args.runs}, {args.noop_stages} stages)", f"{s:.2f} s"))
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)
    print("| what | figure |\n|---|---|")
    for what, fig in rows:
        print(f"| {what} | {fig} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
