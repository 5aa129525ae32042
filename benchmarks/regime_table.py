"""docs/results.md's regime table: each built-in dataset at its defaults and at `paper_regime`.

    python -m benchmarks.regime_table [--seeds 0] [--recipes defaults paper_regime]

For each recipe it copies the project into a temp folder, composes params.yaml with the
recipe plus the same datasets / methods for both (the three built-in datasets; lda, qda,
diffusion, autoregressive, erm, groupdro; no distillation), runs the real `dvc repro` and
reads the report's summary.json and each prepared file's `separation` dict: per dataset the cue
separation with its interval and shuffled-attribute floor, the core's, the population LDA −
logistic regression worst-group gap and the regime it calls (stages/evaluation/regime.py,
`regime_call`), and each model's OOD worst-group accuracy with its 95% bootstrap interval
(stratified by group; see docs/metrics.md). Prints one markdown table (and the wall time of
each run) to paste into docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_repro import copy_repo, timed_repro
from pipeline.flows import tool_env
from stages.core.io import read_metadata
from stages.evaluation.regime import parse_separation, regime_call

DATASETS = ["gaussian_shortcut", "colored_digits", "mnist1d_shortcut"]
METHODS = ["lda", "qda", "diffusion", "autoregressive", "erm", "groupdro"]


def run_recipe(recipe: str, seeds: list[int], env: dict[str, str]) -> tuple[dict, float]:
    """summary.json of a fresh `dvc repro` at `recipe` (defaults = no experiment), and its wall time."""
    overrides = [
        f"run.datasets=[{','.join(DATASETS)}]",
        f"run.methods=[{','.join(METHODS)}]",
        "run.teachers=[]",
        f"run.seeds=[{','.join(map(str, seeds))}]",
    ]
    if recipe != "defaults":
        overrides.insert(0, f"experiment={recipe}")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        subprocess.run([sys.executable, "-m", "stages.core.config", "compose", *overrides], cwd=repo, env=env, check=True)
        subprocess.run([sys.executable, "-m", "stages.dag"], cwd=repo, env=env, check=True)
        wall = timed_repro(repo, env, recipe)
        summary = json.loads((repo / "data" / "reports" / "summary.json").read_text())
        summary["_separation"] = {  # the whole dict: the summary's _regime keeps only cue and core
            d: read_metadata(repo / "data" / "prepared" / f"{d}.parquet").get("separation") for d in DATASETS
        }
        return summary, wall


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def separation_cells(sep: dict[str, float | None] | None) -> list[str]:
    """cue [interval] (floor), core [interval], population gap [interval] from a separation dict."""
    if sep is None:
        return ["?", "?", "?"]

    def ranged(key: str) -> str:
        low, high = sep.get(f"{key}_low"), sep.get(f"{key}_high")
        return _num(sep.get(key)) + ("" if low is None or low == high else f" [{_num(low)}, {_num(high)}]")

    floor = sep.get("cue_floor")
    return [ranged("cue") + ("" if not floor else f" (floor {_num(floor)})"), ranged("core"),
            "?" if sep.get("gap") is None else ranged("gap")]


def predicted(sep: dict[str, float | None] | None) -> str:
    """The regime the separation dict calls (`stages.evaluation.regime.regime_call`), in a few words."""
    use, why = regime_call(sep)
    return f"no call: {why}" if use is None else f"population LDA uses the cue {use} (a description, not a prediction)"


def observed(regime: dict[str, float]) -> str:
    """The report's observation: mean ID→OOD accuracy drop of the generative models against
    the discriminative reference family (`evaluate.er_reference`)."""
    gen, ref = regime.get("drop_generative"), regime.get("drop_reference")
    if gen is None or ref is None:
        return "n/a"
    return f"{gen:.2f} vs {ref:.2f}: generative uses it {'more' if gen > ref else 'less' if gen < ref else 'as much'}"


def table(results: dict[str, dict]) -> str:
    header = ["dataset", "recipe", "cue sep. [95 %] (shuffled floor)", "core sep. [95 %]", "population LDA − LR worst-group",
              "regime call", "observed: ID→OOD drop, generative vs reference", *METHODS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for dataset in DATASETS:
        for recipe, summary in results.items():
            ds = summary[dataset]
            regime = ds.get("_regime", {})
            sep = parse_separation(summary.get("_separation", {}).get(dataset))
            cells = []
            for m in METHODS:
                s = ds.get(m)
                if s is None:
                    cells.append("—")
                    continue
                ci = s.get("test_ood_worst_group_acc_ci")
                cells.append(f"{s['test_ood_worst_group_acc']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
            lines.append(
                f"| {dataset} | {recipe} | {' | '.join(separation_cells(sep))} | {predicted(sep)} | {observed(regime)} | "
                + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--recipes", nargs="+", default=["defaults", "paper_regime"])
    parser.add_argument("--save", type=Path, default=Path("scratch/regime_table"),
                        help="folder for each recipe's summary.json (kept, so the table can be re-rendered)")
    parser.add_argument("--render", action="store_true", help="only render the table from --save")
    args = parser.parse_args(argv)
    if args.render:
        print(table({r: json.loads((args.save / f"{r}.json").read_text()) for r in args.recipes}))
        return 0
    env = {**tool_env(), "SHIFTLAB_QUIET": "1"}  # the venv's python and dvc first on PATH, as the flow runs stages
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    results = {}
    for recipe in args.recipes:
        results[recipe], wall = run_recipe(recipe, args.seeds, env)
        args.save.mkdir(parents=True, exist_ok=True)
        (args.save / f"{recipe}.json").write_text(json.dumps(results[recipe], indent=2, sort_keys=True))
        print(f"{recipe}: dvc repro {wall:.0f} s", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
