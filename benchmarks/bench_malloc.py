"""What glibc's malloc settings of the flow (pipeline.flows.MALLOC_ENV) save on one stage command.

    python -m benchmarks.bench_malloc --root WORKSPACE --out PATH [--runs 2] STAGE ARGS...
    e.g. --root /tmp/ev/run --out data/models/gaussian_shortcut_paper_seed0/autoregressive/seed=0 \\
         train gaussian_shortcut_paper_seed0 autoregressive 0

Runs `python -m stages.STAGE ARGS...` in WORKSPACE (a DVC workspace holding the stage's inputs and
params.yaml: it rewrites that stage's outputs there) `--runs` times with the flow's environment
and as many without MALLOC_ENV, alternating which goes first; prints the medians of wall time,
user and system CPU and peak RSS of each, and checks that every run wrote the same bytes to
`--out` (a file or a folder).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.flows import MALLOC_ENV, tool_env


def digest(path: Path) -> str:
    """sha256 over the files under `path` (names and bytes), or of the file itself."""
    h = hashlib.sha256()
    for f in sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()):
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def run_once(cmd: list[str], root: Path, env: dict[str, str]) -> dict[str, float]:
    # stderr to a file, not a pipe: a stage's progress lines would fill a pipe nobody reads while
    # wait4 waits for the process.
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            log.seek(0)
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read()[-3000:]}")
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "rss_gb": usage.ru_maxrss / 1024**2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the stage's output to compare (relative to --root)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("stage", nargs=argparse.REMAINDER, help="the stage module's name and arguments")
    args = parser.parse_args(argv)
    if not args.stage:
        parser.error("name the stage: e.g. train gaussian_shortcut autoregressive 0")
    cmd = [sys.executable, "-m", f"stages.{args.stage[0]}", *args.stage[1:]]
    kept = tool_env()
    plain = {k: v for k, v in kept.items() if k not in MALLOC_ENV}
    results: dict[str, list[dict[str, float]]] = {"kept": [], "plain": []}
    digests = set()
    for i in range(args.runs):
        for name in (("kept", "plain") if i % 2 == 0 else ("plain", "kept")):
            results[name].append(run_once(cmd, args.root, kept if name == "kept" else plain))
            digests.add(digest(args.root / args.out))
    print(f"`{' '.join(cmd[1:])}`, {args.runs} runs each, medians:\n")
    print("| malloc | wall s | user s | sys s | peak RSS GB |\n|---|---|---|---|---|")
    for name, label in (("plain", "glibc defaults"), ("kept", "MALLOC_ENV (the flow's)")):
        med = {k: statistics.median(r[k] for r in results[name]) for k in results[name][0]}
        print(f"| {label} | {med['wall']:.1f} | {med['user']:.1f} | {med['sys']:.1f} | {med['rss_gb']:.2f} |")
    print(f"\nsame output bytes in every run: {'yes' if len(digests) == 1 else 'NO'}")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
