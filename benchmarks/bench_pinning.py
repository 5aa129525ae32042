"""What pinning the CPU code paths costs (stages/core/numerics.py): stage wall time with the
libraries' native choice (SHIFTLAB_NATIVE_CPU=1) and pinned (the default: see numerics.py).

    python -m benchmarks.bench_pinning [--runs 3] [--dataset colored_digits]

In a temp workspace with the default params (the dataset prepared once), each round runs the
same stage commands — train erm, lda, diffusion, autoregressive, evaluate diffusion — as fresh
processes, once native and once pinned (order alternating), and reports the median wall time
of each stage and of their sum, and the pinned/native ratio (issue 25's bound: 1.15).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("erm", "lda", "diffusion", "autoregressive")


def run(cmd: list[str], cwd: Path, native: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k != "SHIFTLAB_NATIVE_CPU"}
    env.update(PYTHONPATH=str(ROOT), SHIFTLAB_QUIET="1", **({"SHIFTLAB_NATIVE_CPU": "1"} if native else {}))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", *cmd], cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dataset", default="colored_digits")
    args = parser.parse_args(argv)
    ds = args.dataset
    steps = [["stages.train", ds, m, "0"] for m in METHODS] + [["stages.evaluate", ds, "diffusion", "0"]]
    times: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copy(ROOT / "params.yaml", work / "params.yaml")
        run(["stages.prepare", ds], work, native=False)
        for r in range(args.runs):
            for native in ((False, True) if r % 2 == 0 else (True, False)):
                for step in steps:
                    times.setdefault((" ".join(step[:3]), native), []).append(run(step, work, native))
    total = {n: sum(statistics.median(times[(" ".join(s[:3]), n)]) for s in steps) for n in (True, False)}
    for step in steps:
        name = " ".join(step[:3])
        nat, pin = statistics.median(times[(name, True)]), statistics.median(times[(name, False)])
        print(f"{name:45s} native {nat:6.2f} s   pinned {pin:6.2f} s   {pin / nat:.2f}x")
    print(f"pinning: {total[False] / total[True]:.2f}x the stage wall time of the native code paths "
          f"({total[False]:.1f} s vs {total[True]:.1f} s, medians of {args.runs}, {ds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
