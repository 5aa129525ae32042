"""Is the evidence recipe's training budget enough? Each generative model trained twice as long.

    python -m benchmarks.bench_budget                                    # every dataset of the recipe, seed 0
    python -m benchmarks.bench_budget --datasets gaussian_shortcut_paper --summary summary.json

Issue 43: a generative model compared before it has learned makes the verdict about its budget,
not about it. For each dataset of `experiment=evidence` (default: all of them) and one seed, the
recipe's generative models (`--methods`, default diffusion and autoregressive) are trained and
evaluated as the recipe trains them, and again with `epochs` and `min_epochs` doubled, each
through the real `dvc repro` in a temp copy of the project. Prints, per dataset and model, the
test_ood worst-group accuracy both ways, the change, and the matched pair's 95 % half-width it is
judged against: from an evidence run's summary.json (`--summary`: the pair `<model> − <matched>`
of the dataset's base), else `--half-width`. "enough" where |change| is below the half-width;
else the recipe's budget for that model should be raised (conf/experiment/evidence.yaml).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_repro import copy_repo, timed_repro
from pipeline.flows import tool_env

RECIPE = "experiment=evidence"


def composed(repo: Path, overrides: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Compose params.yaml in `repo` with the recipe and `overrides`, plan the DAG; the params."""
    import yaml

    subprocess.run([sys.executable, "-m", "stages.core.config", "compose", RECIPE, *overrides], cwd=repo, env=env, check=True)
    subprocess.run([sys.executable, "-m", "stages.dag"], cwd=repo, env=env, check=True)
    return yaml.safe_load((repo / "params.yaml").read_text())


def worst_groups(datasets: list[str], methods: list[str], seed: int, scale: int, env: dict[str, str]) -> tuple[dict, float]:
    """{(dataset, method): test_ood worst-group} of the recipe with every method's epochs and
    min_epochs times `scale`, and the run's wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        base = [f"run.datasets=[{','.join(datasets)}]", f"run.methods=[{','.join(methods)}]", f"run.seeds=[{seed}]",
                "run.teachers=[]"]
        params = composed(repo, base, env)
        longer = []
        for m in methods:
            cfg = params["method"][m]
            longer += [f"method.{m}.epochs={cfg['epochs'] * scale}", f"method.{m}.min_epochs={cfg.get('min_epochs', 0) * scale}"]
        params = composed(repo, base + (longer if scale != 1 else []), env)
        wall = timed_repro(repo, env, f"the recipe at {scale}x epochs")
        out = {}
        for d in datasets:
            instance = f"{d}_seed{seed}" if params["run"].get("redraw_data") else d
            for m in methods:
                metrics = json.loads((repo / "data" / "metrics" / instance / m / f"seed={seed}.json").read_text())
                out[(d, m)] = float(metrics["splits"]["test_ood"]["worst_group_acc"])
        return out, wall


def half_widths(summary: dict[str, Any] | None) -> dict[tuple[str, str], float]:
    """(base dataset, model) -> the matched pair's 95 % half-width in an evidence summary."""
    out = {}
    for base, e in (summary or {}).get("_evidence", {}).items():
        for p in e.get("pairs", []):
            if p.get("comparison") == "matched" and p.get("low") is not None:
                out[(base, p["generative"])] = (p["high"] - p["low"]) / 2
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=None, help="default: every dataset of the recipe")
    parser.add_argument("--methods", nargs="+", default=["diffusion", "autoregressive"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", type=Path, help="an evidence run's summary.json: the pairs' half-widths")
    parser.add_argument("--half-width", type=float, default=0.05, help="without --summary (default 0.05)")
    args = parser.parse_args(argv)
    env = {**tool_env(), "SHIFTLAB_QUIET": "1"}  # the venv's python and dvc first on PATH, as the flow runs stages
    datasets = args.datasets
    if datasets is None:
        with tempfile.TemporaryDirectory(prefix="bench-budget-plan-") as tmp:
            copy_repo(Path(tmp))
            datasets = composed(Path(tmp), [], env)["run"]["datasets"]
    widths = half_widths(json.loads(args.summary.read_text()) if args.summary else None)
    as_is, wall1 = worst_groups(datasets, args.methods, args.seed, 1, env)
    longer, wall2 = worst_groups(datasets, args.methods, args.seed, 2, env)
    print(f"seed {args.seed}; the recipe's budget: {wall1:.0f} s, twice as long: {wall2:.0f} s\n")
    print("| dataset | model | OOD worst-group (recipe) | (2x epochs and min_epochs) | change | half-width | verdict |")
    print("|---|---|---:|---:|---:|---:|---|")
    for d in datasets:
        for m in args.methods:
            width = widths.get((d, m), args.half_width)
            change = longer[(d, m)] - as_is[(d, m)]
            verdict = "enough" if abs(change) < width else "raise the budget"
            print(f"| {d} | {m} | {as_is[(d, m)]:.3f} | {longer[(d, m)]:.3f} | {change:+.3f} | {width:.3f} | {verdict} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
