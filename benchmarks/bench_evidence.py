"""The evidence recipe (`experiment=evidence`) end to end: its wall time and the tables of docs/results.md.

    python -m benchmarks.bench_evidence                        # the whole recipe (5 seeds), through the parallel flow
    python -m benchmarks.bench_evidence --seeds 0 1            # fewer replicates (a smaller, quicker run)
    python -m benchmarks.bench_evidence --estimate             # one seed through the flow: the whole recipe's wall time
    python -m benchmarks.bench_evidence --stage-times          # one seed, stage by stage: where the time goes
    python -m benchmarks.bench_evidence --render summary.json  # the table from a finished run's summary
    python -m benchmarks.bench_evidence --workdir DIR          # in DIR (kept): run again to resume a stopped run

Run: the project is copied into a temp folder (a git repo, as `dvc exp run` needs) and run as
`make repro` runs it, through the parallel Prefect flow: `python -m pipeline.flows --override
experiment=evidence` (stages at once: the cores available, or `--max-parallel`). Prints the
wall time, then the tables of data/reports/summary.json `_evidence` (docs/metrics.md, "Evidence
over replicates"): the matched pairs first (each generative model against the matched reference),
then the group-aware ones, each with its gaps in OOD worst-group accuracy and in the ID→OOD drop,
their 95% t intervals, the verdict after Holm's correction, the replicates and its flags.
`--keep DIR` copies summary.json and report.md there.

Estimate (`--estimate`): the same run at `--seeds` (default one seed), timed, with the CPU
seconds of everything it started (stages, the flow's DVC bookkeeping, its Prefect server),
then the report alone in the finished copy. Every stage but the report is per seed and runs
two at a time, the report runs alone at the end and grows with the seeds, so the whole
recipe (`--recipe-seeds`, 5) on `--cores` cores takes about

    (CPU − report CPU) / seeds run × recipe seeds / cores  +  report CPU / seeds run × recipe seeds

(an underestimate by the flow's idle tail, an overestimate by the fixed costs it scales).

Stage by stage (`--stage-times`): every stage command at `--seeds` run alone, one after the
other, in a temp copy; prints each one's wall and CPU seconds and the CPU per stage kind. The
flow forks stages from a warm helper, so there a stage costs about 3 s less (the interpreter
and torch start-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.workspace import copy_project

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "experiment=evidence"
REGIMES = {"": "defaults", "_paper": "paper_regime"}  # the recipe's section suffix -> the regime


def env() -> dict[str, str]:
    e = dict(os.environ, SHIFTLAB_QUIET="1", DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1",
             PREFECT_SERVER_ANALYTICS_ENABLED="false", GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b",
             GIT_COMMITTER_NAME="b", GIT_COMMITTER_EMAIL="b@b")
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e['PATH']}"
    return e


def sh(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), text=True, capture_output=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def overrides(seeds: list[int] | None) -> list[str]:
    return [RECIPE] + ([f"run.seeds=[{','.join(map(str, seeds))}]"] if seeds is not None else [])


def fresh_copy(dest: Path) -> None:
    copy_project(ROOT, dest)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bench_evidence"]):
        sh(cmd, dest)


# ---- the run --------------------------------------------------------------------------------


def run_flow(seeds: list[int] | None, max_parallel: int | None, keep: Path | None,
             workdir: Path | None = None) -> tuple[dict[str, Any], float]:
    """summary.json of the recipe run through the parallel flow in a copy (a temp one, or
    `workdir`, kept), and its wall seconds. The flow's output goes to stderr as it runs."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            repo = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-evidence-")))
        else:
            repo = workdir.resolve()
        if not (repo / ".git").is_dir():
            fresh_copy(repo)
        cmd = [sys.executable, "-m", "pipeline.flows", *[a for o in overrides(seeds) for a in ("--override", o)]]
        if max_parallel:
            cmd += ["--max-parallel", str(max_parallel)]
        t0 = time.perf_counter()
        code = subprocess.run(cmd, cwd=repo, env=env(), stdout=sys.stderr).returncode
        wall = time.perf_counter() - t0
        if code:
            sys.exit(f"{' '.join(cmd)} failed ({code}) after {wall:.0f} s in {repo}" +
                     ("" if workdir is None else ": run the same command again to go on from where it stopped"))
        reports = repo / "data" / "reports"
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("summary.json", "report.md"):
                shutil.copy2(reports / name, keep / name)
        return json.loads((reports / "summary.json").read_text()), wall


def _gap(g: dict[str, Any] | None) -> str:
    if not g or g.get("estimate") is None:
        return "n/a"
    low, high = g.get("low"), g.get("high")
    interval = f" [{low:+.3f}, {high:+.3f}]" if low is not None and high is not None else " (no interval)"
    return f"{g['estimate']:+.3f}{interval}"


def base_and_regime(name: str) -> tuple[str, str]:
    """(built-in dataset, regime) of one of the recipe's datasets (`<name>` or `<name>_paper`)."""
    for suffix, regime in sorted(REGIMES.items(), key=lambda kv: -len(kv[0])):
        if suffix and name.endswith(suffix):
            return name.removesuffix(suffix), regime
    return name, REGIMES[""]


def table(summary: dict[str, Any]) -> str:
    """docs/results.md's tables from summary.json's `_evidence`: the matched pairs (each generative
    model against the matched reference) of every base dataset and regime, then the group-aware
    ones; each row the pair's worst-group and drop gaps with their 95% t intervals, the verdict
    after Holm's correction, the replicates and the pair's flags."""
    evidence = summary.get("_evidence")
    if not isinstance(evidence, dict) or not evidence:
        raise SystemExit("summary.json has no `_evidence`: the report predates the evidence section")
    if any("pairs" not in e for e in evidence.values()):
        raise SystemExit("summary.json's `_evidence` has no `pairs`: the report predates the matched comparison; re-run `dvc repro report`")
    header = ["dataset", "regime", "pair", "OOD worst-group gap [95% CI]", "ID→OOD drop gap [95% CI]", "verdict (Holm)",
              "seeds", "flags"]
    order = sorted(evidence, key=lambda n: (base_and_regime(n)[0], list(REGIMES.values()).index(base_and_regime(n)[1])))
    out = []
    for kind in ("matched", "group-aware"):
        lines = [f"**{kind}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name in order:
            base, regime = base_and_regime(name)
            for p in evidence[name]["pairs"]:
                if p.get("comparison") != kind:
                    continue
                verdict = str(p.get("verdict", "n/a"))
                if p.get("p_holm") is not None:
                    verdict += f" (p = {p['p_holm']:.2g})"
                if p.get("seeds_needed"):  # the power estimate, where the report gives one
                    verdict += f"; ~{p['seeds_needed']} seeds would tell"
                flags = "; ".join(p.get("flags") or []) or "none"
                lines.append(f"| {base} | {regime} | {p['generative']} − {p['reference']} | {_gap(p)} | "
                             f"{_gap(p.get('drop'))} | {verdict} | {p.get('replicates', '?')} | {flags} |")
        out.append("\n".join(lines))
    failed = [f"{n}: {', '.join(e['failed_to_learn'])}" for n, e in evidence.items() if e.get("failed_to_learn")]
    if failed:
        out.append("Failed to learn (their pairs blocked): " + "; ".join(failed))
    return "\n\n".join(out)


# ---- the estimate ---------------------------------------------------------------------------


def stage_commands(params: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Every stage of the composed run as (DVC stage name, `python -m` arguments), in an order
    that respects the DAG (a method that reads another's model after it)."""
    dag = params["dag"]
    cmds = [(f"{s}@{d}", [f"stages.{s}", d]) for s in ("prepare", "validate", "pretrain") for d in dag["prepare"]]
    train = sorted(dag["train"].items(), key=lambda kv: kv[1]["upstream"].startswith("data/models/"))
    cmds += [(f"train@{k}", ["stages.train", v["dataset"], v["method"], str(v["seed"])]) for k, v in train]
    cmds += [(f"distill@{k}", ["stages.distill", v["dataset"], v["teacher"], str(v["seed"])]) for k, v in dag["distill"].items()]
    cmds += [(f"evaluate@{k}", ["stages.evaluate", v["dataset"], v["model"], str(v["seed"])]) for k, v in dag["evaluate"].items()]
    return [*cmds, ("phase", ["stages.phase"]), ("report", ["stages.report"])]


def stage_times(seeds: list[int]) -> dict[str, dict[str, float]]:
    """{stage: {wall, cpu}} of the recipe at `seeds`, each stage run alone in a temp copy."""
    import yaml

    times: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-evidence-stages-") as tmp:
        repo = Path(tmp)
        copy_project(ROOT, repo)
        sh([sys.executable, "-m", "stages.core.config", "compose", *overrides(seeds)], repo)
        for name, args in stage_commands(yaml.safe_load((repo / "params.yaml").read_text())):
            before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            sh([sys.executable, "-m", *args], repo)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            times[name] = {"wall": time.perf_counter() - t0, "cpu": cpu}
            print(f"{times[name]['wall']:8.1f} s wall {cpu:8.1f} s cpu  {name}", file=sys.stderr, flush=True)
    return times


def kind_of(stage: str) -> str:
    """`train:diffusion`, `evaluate:lda`, `prepare`, ... for a stage name."""
    head, _, item = stage.partition("@")
    if head in ("train", "evaluate", "distill"):
        return f"{head}:{item.rsplit('-', 2)[-2]}"
    return head


def breakdown(times: dict[str, dict[str, float]], seeds_run: int) -> str:
    """A markdown table: CPU seconds per stage kind and seed, dearest first."""
    per_kind: dict[str, float] = {}
    for stage, t in times.items():
        per_kind[kind_of(stage)] = per_kind.get(kind_of(stage), 0.0) + t["cpu"]
    lines = ["| stage kind | CPU s per seed (all datasets) |", "|---|---|"]
    lines += [f"| {k} | {v / seeds_run:.0f} |" for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines + [f"| all {len(times)} stages | {sum(per_kind.values()) / seeds_run:.0f} |"])


def estimate(seeds: list[int], max_parallel: int | None, cores: int, recipe_seeds: int) -> str:
    """Run the recipe at `seeds` through the flow and project the whole recipe's wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-evidence-estimate-") as tmp:
        repo = Path(tmp)
        fresh_copy(repo)
        cmd = [sys.executable, "-m", "pipeline.flows", *[a for o in overrides(seeds) for a in ("--override", o)]]
        if max_parallel:
            cmd += ["--max-parallel", str(max_parallel)]
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        sh(cmd, repo)
        wall = time.perf_counter() - t0
        mid = resource.getrusage(resource.RUSAGE_CHILDREN)
        sh([sys.executable, "-m", "stages.report"], repo)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (mid.ru_utime - before.ru_utime) + (mid.ru_stime - before.ru_stime)
    report = (after.ru_utime - mid.ru_utime) + (after.ru_stime - mid.ru_stime)
    scale = recipe_seeds / len(seeds)
    projected = (cpu - report) * scale / cores + report * scale
    return (f"seeds {seeds} through the flow: {wall:.0f} s wall, {cpu:.0f} CPU s (the report {report:.0f});\n"
            f"{recipe_seeds} seeds on {cores} cores: ({cpu - report:.0f} × {scale:g} / {cores}) + {report:.0f} × {scale:g} "
            f"≈ {projected:.0f} s ({projected / 60:.0f} min)")


def main(argv: list[str] | None = None) -> int:
    global RECIPE  # --recipe: which experiment the run, the estimate and the stage times compose
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", help="run.seeds (default: the recipe's 5; --stage-times: 0)")
    parser.add_argument("--max-parallel", type=int, help="stages at once (default: the flow's, the cores available)")
    parser.add_argument("--keep", type=Path, help="copy the run's summary.json and report.md into this folder")
    parser.add_argument("--workdir", type=Path, help="run in this folder (a copy of the project made there "
                        "once, kept): a failed or stopped run goes on from where it was with the same command")
    parser.add_argument("--render", type=Path, help="only print the table of this summary.json")
    parser.add_argument("--estimate", action="store_true", help="run --seeds (default 0) and project the whole recipe")
    parser.add_argument("--stage-times", action="store_true", help="run --seeds (default 0) stage by stage: CPU per kind")
    parser.add_argument("--cores", type=int, default=2, help="--estimate: cores of the machine the estimate is for")
    parser.add_argument("--recipe-seeds", type=int, default=5, help="--estimate: seeds of the run to estimate")
    parser.add_argument("--save", type=Path, help="--stage-times: write the per-stage times (JSON) here")
    parser.add_argument("--recipe", default=RECIPE, help=f"the experiment override to run (default {RECIPE}; "
                        "benchmarks/bench_real_evidence.py passes experiment=real_evidence)")
    args = parser.parse_args(argv)
    RECIPE = args.recipe
    if args.render:
        print(table(json.loads(args.render.read_text())))
        return 0
    if args.estimate:
        print(estimate(args.seeds or [0], args.max_parallel, args.cores, args.recipe_seeds))
        return 0
    if args.stage_times:
        seeds = args.seeds or [0]
        times = stage_times(seeds)
        if args.save:
            args.save.write_text(json.dumps(times, indent=1, sort_keys=True))
        print(breakdown(times, len(seeds)))
        return 0
    summary, wall = run_flow(args.seeds, args.max_parallel, args.keep, args.workdir)
    seeds = "the recipe's seeds" if args.seeds is None else f"seeds {args.seeds}"
    print(f"{RECIPE} ({seeds}) through the parallel flow: {wall:.0f} s ({wall / 60:.1f} min)\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
