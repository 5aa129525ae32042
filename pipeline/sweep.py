"""Prefect flow that sweeps a grid of Hydra overrides, one DVC experiment per point, in parallel.

    python -m pipeline.sweep --name rho-lr \\
        --grid dataset.<name>.rho_train=0.5,0.7,0.9,0.99 \\
        --grid method.<name>.lr=0.001,0.01 --grid 'run.seeds=[0],[1]' \\
        [--override experiment=tiny ...] [--workers 2] [--dask-address tcp://host:8786]

Each `--grid key=v1,v2,...` entry is one axis (commas inside [...] or quotes do not split);
the points are their product, each with the fixed `--override`s first. A point runs as
`dvc exp run --temp -n <name>-<hash> -S ...`: its own DVC experiment in its own temporary
workspace, recorded in the repo's experiment refs (`dvc exp show`), so points never share a
workspace and run in parallel through a Prefect task runner: a process pool locally
(`workers` processes), or the Dask cluster at `dask_address` (prefect-dask).

A point's name is a hash of its overrides, so re-running the same sweep (or a larger grid
that contains it) reuses every point that already finished — its experiment is read back
instead of run again — and a point that crashed half-way re-runs with DVC's run cache
restoring the stages it had finished: the sweep resumes after a crash.

Every point's leaderboard (read from its experiment's `data/reports/leaderboard.parquet`)
goes into `data/reports/sweeps/<name>.parquet` and a table artifact `shiftlab-sweep-<name>`.
A failed point is reported there with DVC's error and does not stop the others; the flow
run ends Failed when any point failed, after writing both.

On a Dask cluster on several machines every worker needs this repository at the same path
(a shared filesystem) with `pipeline` importable (run workers with PYTHONPATH=<repo>).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import itertools
import json
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Process-pool children and Dask workers unpickle tasks by reference: `pipeline` must be importable.
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


# pipeline.flows first: it turns Prefect's telemetry off (PREFECT_SERVER_ANALYTICS_ENABLED) before
# Prefect is imported, whose settings are read once, at import (imported first, the sweep's
# temporary server tried to send telemetry).
from pipeline.flows import Refused, compose_error, dvc_bin, tool_env  # noqa: E402, I001
from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_table_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from pipeline.publish import artifact_key  # noqa: E402

SWEEPS_DIR = Path("data") / "reports" / "sweeps"
METRIC_COLUMNS = ("n", "acc", "worst_group_acc", "avg_acc_weighted", "balanced_acc", "ece", "nll", "brier")
TABLE_COLUMNS = ("point", "status", "dataset", "model", "seed", "split", "acc", "worst_group_acc", "ece", "error")


class PointFailed(RuntimeError):
    """`dvc exp run` of one sweep point exited non-zero."""


class SweepFailed(RuntimeError):
    """At least one point of a sweep failed (the others finished and were gathered)."""


# ---- the grid ---------------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
    """Split `v1,v2,...` at top-level commas (not inside [], {}, () or quotes)."""
    values: list[str] = []
    depth, quote, current = 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    values.append("".join(current).strip())
    return values


def parse_grid(grid: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`["key=v1,v2", ...]` as [(key, [v1, v2]), ...]; ValueError naming a malformed entry."""
    axes: list[tuple[str, list[str]]] = []
    for entry in grid:
        key, sep, rest = entry.partition("=")
        values = split_values(rest)
        if not sep or not key.strip() or any(v == "" for v in values):
            raise ValueError(f"grid entry '{entry}': expected key=v1,v2,... with non-empty values")
        if key.strip() in {k for k, _ in axes}:
            raise ValueError(f"grid entry '{entry}': key '{key.strip()}' appears twice")
        axes.append((key.strip(), values))
    if not axes:
        raise ValueError("the grid is empty: give at least one key=v1,v2,... entry")
    return axes


def expand_grid(grid: Sequence[str]) -> list[list[str]]:
    """Every point of the grid as a list of `key=value` overrides (product, in the given order)."""
    axes = parse_grid(grid)
    return [[f"{k}={v}" for (k, _), v in zip(axes, combo, strict=True)] for combo in itertools.product(*(vs for _, vs in axes))]


def sanitize(name: str) -> str:
    """A name usable in a git ref and a file name."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    if not clean:
        raise ValueError(f"sweep name '{name}' has no usable characters")
    return clean


def point_name(sweep: str, overrides: Sequence[str]) -> str:
    """Stable experiment name of a point: the sweep's name and a hash of all its overrides."""
    digest = hashlib.sha1(json.dumps(list(overrides)).encode()).hexdigest()[:10]
    return f"{sanitize(sweep)}-{digest}"


# ---- one point ------------------------------------------------------------------------------


def finished_experiments(root: str) -> dict[str, str]:
    """{name: commit} of the DVC experiments on the workspace's current baseline commit."""
    from dvc.repo import Repo

    # Wait for the repo's lock as the points' `dvc --wait-for-lock exp run` do: a parallel point holds it
    # while DVC stashes and composes its params (DVC's default gives up after 3 s, which a loaded
    # machine exceeds).
    with Repo(root, _wait_for_lock=True) as repo:
        return {name: rev for exps in repo.experiments.ls().values() for name, rev in exps if name}


def experiment_leaderboard(root: str, rev: str) -> list[dict[str, Any]]:
    """The leaderboard rows an experiment recorded (its data/reports/leaderboard.parquet)."""
    from dvc.api import DVCFileSystem

    from stages.core.artifacts import LEADERBOARD_SCHEMA, REPORTS
    from stages.core.io import read_parquet

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "leaderboard.parquet"
        DVCFileSystem(root, rev=rev).get_file((REPORTS / "leaderboard.parquet").as_posix(), str(local))
        return read_parquet(local, LEADERBOARD_SCHEMA).to_pylist()


@task(cache_policy=NO_CACHE, task_run_name="{name}")
def run_point(name: str, overrides: list[str], root: str) -> dict[str, Any]:
    """Run (or reuse) one point as the DVC experiment `name`; its status, commit and leaderboard."""
    import subprocess

    logger = get_run_logger()
    done = finished_experiments(root)
    if name in done:
        status = "reused"
        logger.info("%s: experiment already finished (%s), reusing it", name, done[name][:7])
    else:
        # Parallel points each hold the repo's lock while DVC stashes and composes their params
        # (seconds: our config check runs inside the composition): wait for it, do not fail.
        cmd = [dvc_bin(), "--wait-for-lock", "exp", "run", "--temp", "-n", name]
        for ov in overrides:
            cmd += ["-S", ov]
        logger.info("%s: %s", name, " ".join(overrides))
        proc = subprocess.run(cmd, cwd=root, text=True, capture_output=True, env=tool_env())
        output = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            logger.error("%s failed:\n%s", name, output)
            errors = [ln.strip() for ln in output.splitlines() if "error" in ln.lower()]
            detail = "\n".join(dict.fromkeys(errors)) or output[-1500:]
            raise PointFailed(f"{name}: dvc exp run exited {proc.returncode}: {detail}")
        status = "ran"
        done = finished_experiments(root)
        if name not in done:
            raise PointFailed(f"{name}: dvc exp run succeeded but recorded no experiment of that name")
    rows = experiment_leaderboard(root, done[name])
    logger.info("%s: %s, %d leaderboard rows", name, status, len(rows))
    return {"point": name, "status": status, "rev": done[name], "rows": rows}


# ---- gathering ------------------------------------------------------------------------------


def sweep_schema(keys: Sequence[str]) -> Any:
    """Schema of data/reports/sweeps/<name>.parquet: point columns, one per grid key, metrics."""
    import pyarrow as pa

    from stages.core.artifacts import LEADERBOARD_SCHEMA

    fields = [
        pa.field("sweep", pa.string(), nullable=False),
        pa.field("point", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("overrides", pa.string(), nullable=False),
        *(pa.field(k, pa.string(), nullable=False) for k in keys),
        pa.field("exp_rev", pa.string()),
        pa.field("error", pa.string()),
    ]
    fields += [pa.field(f.name, f.type, nullable=True) for f in LEADERBOARD_SCHEMA]
    return pa.schema(fields)


def gather(sweep_name: str, axes: Sequence[tuple[str, list[str]]], points: Sequence[list[str]], names: Sequence[str], results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (point, leaderboard row); a failed point is one row with its error and no metrics."""
    from stages.core.artifacts import LEADERBOARD_SCHEMA

    n_axes = len(axes)
    rows: list[dict[str, Any]] = []
    for overrides, name, res in zip(points, names, results, strict=True):
        point_values = overrides[len(overrides) - n_axes:]
        base = {
            "sweep": sweep_name,
            "point": name,
            "status": res["status"],
            "overrides": " ".join(point_values),
            **{k: ov.split("=", 1)[1] for (k, _), ov in zip(axes, point_values, strict=True)},
            "exp_rev": res.get("rev"),
            "error": res.get("error"),
        }
        empty = {f.name: None for f in LEADERBOARD_SCHEMA}
        for r in res.get("rows") or [empty]:
            rows.append({**base, **r})
    return rows


def write_sweep(root: Path, sweep: str, axes: Sequence[tuple[str, list[str]]], base_overrides: Sequence[str], rows: list[dict[str, Any]]) -> Path:
    """Write the gathered rows through stages.core.io (atomic, fixed schema) and return the path."""
    import pyarrow as pa

    from stages.core.io import write_parquet

    schema = sweep_schema([k for k, _ in axes])
    table = pa.Table.from_pylist(rows, schema=schema)
    path = root / SWEEPS_DIR / f"{sanitize(sweep)}.parquet"
    meta = {"sweep": sweep, "grid": {k: v for k, v in axes}, "overrides": list(base_overrides)}
    return write_parquet(table, path, schema, meta)


def task_runner(workers: int, dask_address: str | None) -> Any:
    """A Dask task runner on the cluster at `dask_address`, else a local process pool."""
    if dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=dask_address)
    from prefect.task_runners import ProcessPoolTaskRunner

    if workers < 1:  # a deployment run's parameter (the command line refuses it in its parser)
        raise Refused(f"workers must be at least 1, got {workers}")
    return ProcessPoolTaskRunner(max_workers=workers)


@flow(name="shiftlab-sweep", log_prints=True)
def sweep(
    grid: list[str],
    name: str = "sweep",
    overrides: list[str] | None = None,
    workers: int = 2,
    dask_address: str | None = None,
    root: str = ".",
) -> dict[str, str]:
    """Run every point of `grid` as its own DVC experiment, in parallel; each point's status.

    grid: axes as Hydra sweep entries, `key=v1,v2,...` (the points are their product).
    name: the sweep's name (experiment names, data/reports/sweeps/<name>.parquet, artifact key).
    overrides: fixed Hydra overrides applied to every point before its grid values.
    workers: processes of the local pool (ignored with dask_address).
    dask_address: scheduler address of a Dask cluster (e.g. tcp://10.0.0.5:8786) to run points on.
    root: the repository (a git + DVC workspace with at least one commit).
    """
    logger = get_run_logger()
    root_path = Path(root).resolve()
    axes = parse_grid(grid)
    base = list(overrides or [])
    points = [base + p for p in expand_grid(grid)]
    names = [point_name(name, p) for p in points]
    runner = task_runner(workers, dask_address)
    logger.info("sweep %s: %d points on %s", name, len(points), f"Dask at {dask_address}" if dask_address else f"{workers} local processes")
    results: list[dict[str, Any]] = []
    with runner:
        futures = [runner.submit(run_point, {"name": n, "overrides": p, "root": str(root_path)}) for n, p in zip(names, points, strict=True)]
        for n, fut in zip(names, futures, strict=True):
            fut.wait()
            state = fut.state
            if state.is_completed():
                results.append(fut.result())
            else:
                err = fut.result(raise_on_failure=False)
                message = str(err) if isinstance(err, BaseException) else str(state.message)
                logger.error("point %s failed: %s", n, message)
                results.append({"point": n, "status": "failed", "error": message[-2000:]})
    rows = gather(name, axes, points, names, results)
    path = write_sweep(root_path, name, axes, base, rows)
    table = [{k: r.get(k) for k in (*(k for k, _ in axes), *TABLE_COLUMNS)} for r in rows]
    create_table_artifact(key=artifact_key("sweep", name), table=table, description=f"sweep {name}: every point's leaderboard ({path.relative_to(root_path).as_posix()})")
    statuses = {r["point"]: r["status"] for r in results}
    failed = [n for n, s in statuses.items() if s == "failed"]
    logger.info("sweep %s: %s; wrote %s", name, ", ".join(f"{s} {sum(v == s for v in statuses.values())}" for s in ("ran", "reused", "failed")), path)
    if failed:
        raise SweepFailed(f"{len(failed)}/{len(points)} point(s) failed: " + "; ".join(str(r["error"]).splitlines()[0] for r in results if r["status"] == "failed"))
    return statuses


def value_sets(axes: Sequence[tuple[str, list[str]]]) -> list[tuple[str | None, list[str]]]:
    """The override sets that check every grid value once: every axis at its first value (the
    grid entry to blame is found in the error), then each other value with the other axes at
    their first. (entry to blame or None, overrides)."""
    firsts = [f"{k}={vs[0]}" for k, vs in axes]
    sets: list[tuple[str | None, list[str]]] = [(None, firsts)]
    for i, (key, values) in enumerate(axes):
        for v in values[1:]:
            sets.append((f"{key}={','.join(values)}", [*firsts[:i], f"{key}={v}", *firsts[i + 1:]]))
    return sets


def preflight(grid: Sequence[str], name: str, overrides: Sequence[str], root: str = ".") -> int:
    """What the command line refuses before any point starts (ValueError, one line): a
    malformed grid or name, a folder that is not a DVC project, fixed overrides that do not
    compose into a valid config, and a grid key or value that does not (an unknown key, `[]`
    where a list may not be empty, a value of the wrong type or out of range): each would fail
    inside every point it is in. Every value is composed once, in one `stages.core.config compose
    --set ...` process (the points' own composition), with the fixed overrides first. Returns
    the point count. The flow itself (a Prefect deployment runs it without this) still reports
    a point that fails with the others."""
    axes = parse_grid(grid)
    points = expand_grid(grid)
    sanitize(name)
    if not (Path(root) / ".dvc").is_dir() or not (Path(root) / "conf").is_dir():
        raise ValueError(f"{Path(root).resolve()}: not a shiftlab DVC project (no .dvc/ or conf/ here); run the sweep from the repository's root")
    sets = [(None, [])] + value_sets(axes) if overrides else value_sets(axes)  # the fixed ones alone first: blamed alone
    try:
        error = compose_error(root, overrides, [extra for _, extra in sets])
    except ValueError as e:
        raise ValueError(f"the grid could not be checked: {e}") from None
    if error is None:
        return len(points)
    n, what = error
    blame, extra = sets[n - 1]
    if not extra:
        raise ValueError(f"--override {' '.join(overrides)}: {what}; no point was started")
    if blame is None:  # the first values: the axis whose key the error names
        keys = [(k, vs) for k, vs in axes if _grid_key(k) in what] or axes
        blame = "; ".join(f"{k}={','.join(vs)}" for k, vs in keys)
    raise ValueError(f"--grid {blame}: {what}; no point was started")


def check_scheduler(address: str, timeout: float = 5.0) -> None:
    """ValueError (one line) unless `address` is a Dask scheduler address (`tcp://host:port`,
    `host:port`, `tls://...`) that something answers on: the sweep would otherwise start its
    Prefect server and fail inside the flow run (a malformed address), or only after Dask's 30 s
    connect timeout (nothing listening). Only that a TCP connection opens is checked."""
    import socket

    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location) if scheme in ("tcp", "tls") else (None, None)
    except ValueError as e:
        raise ValueError(f"--dask-address {address}: not a Dask scheduler address ({e}); e.g. tcp://10.0.0.5:8786; no point was started") from None
    if host is None:  # inproc://, ucx://...: nothing to dial from here
        return
    try:
        socket.create_connection((host or "127.0.0.1", port), timeout=timeout).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"--dask-address {address}: no Dask scheduler answers there ({reason}); start one "
                         f"(`dask scheduler`) or leave --dask-address out to run the points in local processes; no point was started") from None


def _grid_key(key: str) -> str:
    """The config key a grid key overrides: `+a.b` and `~a.b` -> `a.b`, `group@a.b` -> `a.b`."""
    return key.lstrip("+~").split("@")[-1]


def main(argv: Sequence[str] | None = None) -> int:
    from stages.core.console import ArgumentParser, count_of  # a usage error is one line

    parser = ArgumentParser(name="sweep", prog="python -m pipeline.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2", help="one axis (repeatable)")
    parser.add_argument("--name", default="sweep")
    parser.add_argument("--override", action="append", metavar="KEY=VALUE", help="fixed override for every point (repeatable)")
    parser.add_argument("--workers", type=count_of("processes"), default=2, help="local processes running points at once (default 2)")
    parser.add_argument("--dask-address", default=None, help="a Dask scheduler to run the points on instead (tcp://host:8786)")
    args = parser.parse_args(argv)
    try:
        preflight(args.grid, args.name, args.override or [])
        if args.dask_address:
            check_scheduler(args.dask_address)
    except ValueError as e:  # ConfigError is one
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    # Run the flow from the importable module (not __main__) so worker processes can unpickle its tasks.
    flow_fn = importlib.import_module("pipeline.sweep").sweep
    state = flow_fn(grid=args.grid, name=args.name, overrides=args.override, workers=args.workers, dask_address=args.dask_address, return_state=True)
    if not state.is_completed():
        print(f"sweep: {state.name}: {state.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
