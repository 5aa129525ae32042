"""Overhead of the Prefect flows over plain DVC, against a running local Prefect server.

    python -m benchmarks.bench_flow [--runs 3] [--override experiment=tiny ...] [--points 8] [--sweep-runs 3]
                                    [--skip-sweep] [--skip-pipeline]

In a temp copy of the repo (params composed from conf/ with the `--override`s; default the
tiny experiment), with a Prefect server: the one at PREFECT_API_URL when that answers, else
one started here (`prefect server start`, SQLite in a temp PREFECT_HOME) and stopped after.

1. pipeline overhead: `--runs` times each `dvc repro --force` and the `pipeline` flow with
   force=True (`python -m pipeline.flows --force`, a fresh process like a worker's), alternating
   which goes first; medians and their difference. Target: overhead <= max(15 %, 10 s).
2. no-op: the flow with everything up to date (`python -m pipeline.flows`), median. Target < 15 s.
3. sweep: `--points` points (method.lda.shrinkage values on one dataset and model, the shared
   stages run once beforehand) with 1 worker and with 2 workers, `--sweep-runs` times each,
   alternating which goes first, each from an empty DVC run cache and under a fresh sweep name
   (so no point is reused); medians. Target: 2 workers < 65 % of 1 worker. On a 2-core machine
   this only holds when nothing else is using the cores (the points are CPU-bound).

Prints a markdown table (the README's figures come from it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pipeline.workspace import copy_project

ROOT = Path(__file__).resolve().parents[1]
SWEEP_BASE = ["experiment=tiny", "run.datasets=[gaussian_shortcut]", "run.methods=[lda]", "run.teachers=[]", "run.models=[lda]"]


def env() -> dict[str, str]:
    e = dict(os.environ, SHIFTLAB_QUIET="1", DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1",
             PREFECT_SERVER_ANALYTICS_ENABLED="false", GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b",
             GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@b")
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e['PATH']}"
    return e


def run(cmd: Sequence[str], cwd: Path, check: bool = True) -> float:
    """Wall seconds of `cmd`; exits with its output when it fails and `check`."""
    t0 = time.perf_counter()
    proc = subprocess.run(list(cmd), cwd=cwd, env=env(), text=True, capture_output=True)
    took = time.perf_counter() - t0
    if check and proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return took


def copy_repo(dest: Path, overrides: Sequence[str]) -> None:
    copy_project(ROOT, dest)
    run(["git", "init", "-q"], dest)
    run([sys.executable, "-m", "stages.core.config", "compose", *overrides], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "commit", "-qm", "bench"], dest)


def healthy(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/health", timeout=2).read() == b"true"
    except OSError:
        return False


def start_server(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    e = dict(env(), PREFECT_HOME=str(home))
    proc = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 180
    while not healthy(url):
        if proc.poll() is not None or time.time() > deadline:
            sys.exit("could not start a Prefect server")
        time.sleep(1)
    return proc, url


def each(times: Sequence[float]) -> str:
    return ", ".join(f"{x:.1f}" for x in times) + " s"


def bench_pipeline(repo: Path, runs: int) -> dict[str, list[float]]:
    flow = [sys.executable, "-m", "pipeline.flows"]
    times: dict[str, list[float]] = {"dvc": [], "flow": [], "noop": []}
    run(["dvc", "repro"], repo)  # warm: imports, DVC's state db
    for i in range(runs):
        # which goes first alternates, so neither always runs on a machine the other just warmed
        for what in ("dvc", "flow") if i % 2 == 0 else ("flow", "dvc"):
            times[what].append(run(["dvc", "repro", "--force"] if what == "dvc" else [*flow, "--force"], repo))
        times["noop"].append(run(flow, repo))
        print(f"run {i + 1}: dvc repro --force {times['dvc'][-1]:.1f} s, flow --force {times['flow'][-1]:.1f} s, "
              f"no-op flow {times['noop'][-1]:.1f} s", file=sys.stderr)
    return times


def bench_sweep(repo: Path, points: int, runs: int) -> dict[str, list[float]]:
    values = ",".join(f"{(i + 1) / (points + 1):.3f}" for i in range(points))
    run([sys.executable, "-m", "stages.core.config", "compose", *SWEEP_BASE], repo)
    run(["dvc", "repro", "pretrain@gaussian_shortcut"], repo)  # shared by every point
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "sweep baseline"], repo)
    out: dict[str, list[float]] = {"1": [], "2": []}
    for i in range(runs):
        for workers in (1, 2) if i % 2 == 0 else (2, 1):
            shutil.rmtree(repo / ".dvc" / "cache" / "runs", ignore_errors=True)
            cmd = [sys.executable, "-m", "pipeline.sweep", "--name", f"bench-{i}-{workers}", "--workers", str(workers),
                   "--grid", f"method.lda.shrinkage={values}", *(a for o in SWEEP_BASE for a in ("--override", o))]
            out[f"{workers}"].append(run(cmd, repo))
            print(f"run {i + 1}: sweep of {points} points on {workers} worker(s): {out[f'{workers}'][-1]:.1f} s", file=sys.stderr)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--override", action="append", help="Hydra override for the pipeline part (default: experiment=tiny)")
    parser.add_argument("--points", type=int, default=8)
    parser.add_argument("--sweep-runs", type=int, default=3)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args(argv)
    overrides = args.override or ["experiment=tiny"]
    server = None
    with tempfile.TemporaryDirectory() as tmp:
        url = os.environ.get("PREFECT_API_URL", "")
        if not (url and healthy(url)):
            server, url = start_server(Path(tmp) / "prefect-home")
        os.environ["PREFECT_API_URL"] = url
        try:
            repo = Path(tmp) / "repo"
            repo.mkdir()
            copy_repo(repo, overrides)
            n_stages = len(subprocess.run(["dvc", "stage", "list", "--name-only"], cwd=repo, env=env(), text=True,
                                          capture_output=True, check=True).stdout.split())
            rows = []
            if not args.skip_pipeline:
                t = bench_pipeline(repo, args.runs)
                dvc, fl, noop = (statistics.median(t[k]) for k in ("dvc", "flow", "noop"))
                limit = max(0.15 * dvc, 10.0)
                rows += [
                    f"| `dvc repro --force`, {n_stages} stages ({' '.join(overrides)}), median of {args.runs} ({each(t['dvc'])}) | {dvc:.1f} s |",
                    f"| `pipeline` flow, force=True, same stages, median of {args.runs} ({each(t['flow'])}) | {fl:.1f} s |",
                    f"| flow overhead (target ≤ max(15 %, 10 s) = {limit:.1f} s) | {fl - dvc:+.1f} s ({(fl - dvc) / dvc:+.0%}) {'✓' if fl - dvc <= limit else '✗'} |",
                    f"| no-op flow run, everything up to date, median of {args.runs} ({each(t['noop'])}; target < 15 s) | {noop:.1f} s {'✓' if noop < 15 else '✗'} |",
                ]
            if not args.skip_sweep:
                t = bench_sweep(repo, args.points, args.sweep_runs)
                one, two = statistics.median(t["1"]), statistics.median(t["2"])
                ratio = two / one
                rows += [
                    f"| sweep of {args.points} points, 1 worker (one after another), median of {args.sweep_runs} ({each(t['1'])}) | {one:.1f} s |",
                    f"| same sweep, 2 workers, median of {args.sweep_runs} ({each(t['2'])}; target < 65 % of 1 worker) | {two:.1f} s ({ratio:.0%}) {'✓' if ratio < 0.65 else '✗'} |",
                ]
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)
    print("| what | value |\n|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
