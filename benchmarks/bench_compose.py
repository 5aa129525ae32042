"""Wall time of composing params.yaml from conf/ — what every `dvc exp run` does before it runs
anything (DVC's Hydra composition, the whole-config check, the DAG's code plan) — with every
registered method and dataset kind in conf/.

    python -m benchmarks.bench_compose [--runs 7] [override ...]   e.g. experiment=waterbirds

Each run is a fresh `python -m stages.core.config compose --params <temp file> [override ...]`
process (the cost a user waits for); prints the median and the spread, and the kinds it
validated. A recipe whose backbone is a timm network (experiment=waterbirds) validates the name
against timm's list (stages/models/timm_catalog.py): the runs are timed with that list cached
(as after the first check on a machine) and, alternating, with an empty cache directory (each
such run imports timm and torch to list the names).
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as `dvc exp run -S` takes them")
    args = parser.parse_args(argv)
    from stages.core import registry

    kinds = f"{len(registry.methods())} method kinds, {len(registry.datasets())} dataset kinds"
    times: dict[str, list[float]] = {"cached": [], "empty cache": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "params.yaml"
        cmd = [sys.executable, "-m", "stages.core.config", "compose", "--params", str(out), *args.overrides]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)  # fills the user's cache, if empty
        for i in range(args.runs):
            for label, env in (("cached", os.environ), ("empty cache", {**os.environ, "XDG_CACHE_HOME": f"{tmp}/cache{i}"})):
                t0 = time.perf_counter()
                subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
                times[label].append(time.perf_counter() - t0)
    what = " ".join(args.overrides) or "the defaults"
    for label, ts in times.items():
        print(f"compose {what} ({kinds}), timm names {label}: median {statistics.median(ts):.2f} s over {args.runs} runs "
              f"(min {min(ts):.2f}, max {max(ts):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
