"""The phase diagram's cost and what it shows: `experiment=toy_phase_diagram`'s phase stage, timed.

    python -m benchmarks.bench_phase [--runs 1] [--save scratch/phase.json] [--render scratch/phase.json]

Composes params.yaml with experiment=toy_phase_diagram in a temp folder and runs the stage DVC
runs for it (`python -m stages.phase`; the experiment changes only the `phase` section, so
`dvc exp run -S experiment=toy_phase_diagram` reruns the phase stage and the report), on this
machine's cores as they are (the stage itself runs on one). Prints the median wall time, then
markdown: how the regime's calls (the population LDA − logistic regression worst-group gap,
stages/evaluation/regime.py) fared against the measured winners, split at d/n = 1, and each
panel's cells (LDA − logistic regression with its 95 % interval over the seeds; the population
gap; the call). --render prints the same from a saved phase.json without running.
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
from typing import Any

from stages.core.config import compose
from stages.core.io import read_json
from stages.evaluation.phase_cells import D_OVER_N_SPLIT, phase_wins, prediction_agreement

ROOT = Path(__file__).resolve().parents[1]


def run_once(tmp: Path, env: dict[str, str]) -> float:
    """Wall seconds of one `python -m stages.phase` in `tmp` (params.yaml already there)."""
    shutil.rmtree(tmp / "data", ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages.phase"], cwd=tmp, env=env, check=True, stdout=sys.stderr)
    return time.perf_counter() - t0


def _cell(c: dict[str, Any]) -> str:
    mark = {"generative": "**LDA**", "discriminative": "**LR**", "tie": "tie"}[c["winner"]]
    gap = c["population_wga"] - c["population_lr_wga"] if c.get("population_lr_wga") is not None else None
    interval = f" [{c['diff_low']:+.3f}, {c['diff_high']:+.3f}]" if c.get("diff_low") is not None else ""
    pop = "" if gap is None else f"; pop. {gap:+.3f} ({c.get('predicted') or 'no call'})"
    return f"{c['diff']:+.3f}{interval} {mark}{pop}"


def render(cells: list[dict[str, Any]]) -> str:
    """The agreement table and one table per panel (markdown)."""
    wins = phase_wins(cells)
    seeds = sorted({c["seeds"] for c in cells})
    lines = [
        f"{len(cells)} cells × {'/'.join(map(str, seeds))} seeds: LDA wins {wins.generative}, logistic regression "
        f"{wins.discriminative}, ties {wins.tie}.",
        "",
        "| cells | called | won by the predicted side | ties | won by the other side | not called | of which ties | LDA wins | LR wins |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, part in ((f"d/n < {D_OVER_N_SPLIT:g}", [c for c in cells if c["d_over_n"] < D_OVER_N_SPLIT]),
                       (f"d/n ≥ {D_OVER_N_SPLIT:g}", [c for c in cells if c["d_over_n"] >= D_OVER_N_SPLIT])):
        a = prediction_agreement(part)
        lines.append(f"| {name} ({len(part)}) | {a.called} | {a.right} | {a.tie} | {a.wrong} | {a.uncalled} | "
                     f"{a.uncalled_tie} | {a.uncalled_generative} | {a.uncalled_discriminative} |")
    for panel in sorted({c["panel"] for c in cells}):
        mine = [c for c in cells if c["panel"] == panel]
        xs, ys = sorted({c["x"] for c in mine}), sorted({c["y"] for c in mine})
        by = {(c["x"], c["y"]): c for c in mine}
        xk, yk = mine[0]["x_knob"], mine[0]["y_knob"]
        cues = {x: by[(x, ys[0])].get("separation", {}).get("cue") for x in xs}
        lines += ["", f"Panel {panel}: {xk} (cue separation) × {yk}; LDA − logistic regression worst-group OOD accuracy "
                  "[95 % interval], the winner, the population gap and the regime's call", "",
                  f"| {yk} \\ {xk} | " + " | ".join(f"{x:g} (cue {cues[x]:g})" for x in xs) + " |",
                  "|---|" + "---|" * len(xs)]
        lines += [f"| {y:g} | " + " | ".join(_cell(by[(x, y)]) for x in xs) + " |" for y in ys]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--save", type=Path, default=None, help="copy the last run's phase.json here")
    parser.add_argument("--render", type=Path, default=None, help="only print the tables of this phase.json")
    args = parser.parse_args(argv)
    if args.render:
        print(render(read_json(args.render)))
        return 0
    env = dict(os.environ, SHIFTLAB_QUIET="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cwd = Path.cwd()
        os.chdir(ROOT)  # compose reads conf/ from the project
        try:
            compose(output=tmp / "params.yaml", overrides=["experiment=toy_phase_diagram"])
        finally:
            os.chdir(cwd)
        walls = [run_once(tmp, env) for _ in range(args.runs)]
        cells = read_json(tmp / "data" / "phase" / "phase.json")
        if args.save:
            args.save.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp / "data" / "phase" / "phase.json", args.save)
    print(f"phase stage (experiment=toy_phase_diagram): median {statistics.median(walls):.0f} s over {len(walls)} run(s) "
          f"({', '.join(f'{w:.0f}' for w in walls)} s), os.cpu_count() {os.cpu_count()}", file=sys.stderr)
    print(render(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
