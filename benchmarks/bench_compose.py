"""Wall time of composing params.yaml from conf/ — what every `dvc exp run` does before it runs
anything (DVC's Hydra composition, the whole-config check, the DAG's code plan) — with every
registered method and dataset kind in conf/.

    python -m benchmarks.bench_compose [--runs 7]

Each run is a fresh `python -m stages.core.config compose --params <temp file>` process (the
cost a user waits for); prints the median and the spread, and the kinds it validated.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    from stages.core import registry

    kinds = f"{len(registry.methods())} method kinds, {len(registry.datasets())} dataset kinds"
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "params.yaml"
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "stages.core.config", "compose", "--params", str(out)],
                           cwd=ROOT, check=True, capture_output=True)
            times.append(time.perf_counter() - t0)
    print(f"compose ({kinds}): median {statistics.median(times):.2f} s over {args.runs} runs "
          f"(min {min(times):.2f}, max {max(times):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
