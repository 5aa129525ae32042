"""What the flow publishes to Prefect (docs/design.md, Orchestration): the leaderboard table, the report
as markdown, each dataset's validation result (and a failed validation's expectations), links to
the Parquet outputs and the Data Docs, under stable keys so the UI shows their history. It reads
the stages' files; it computes nothing."""

from __future__ import annotations

import re
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

LEADERBOARD_COLUMNS = ("dataset", "model", "seed", "split", "acc", "worst_group_acc", "ece")
KEY_PREFIX = "shiftlab"


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from `parts`."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join((KEY_PREFIX, *parts)).lower()).strip("-")


def publish_validation_failure(root: Path, dataset: str) -> None:
    """The failing expectations of `dataset` in the task log and as a markdown artifact."""
    from stages.core.artifacts import failure_summary, validated_path
    from stages.core.io import read_json

    failed = root / validated_path(dataset).with_suffix(".failed.json")
    if not failed.is_file():  # failed before the suite ran (e.g. a config error): DVC's log says why
        return
    report = read_json(failed)
    lines = failure_summary(report["expectations"])
    get_run_logger().error("validation of %s failed:\n%s", dataset, "\n".join(f"  - {x}" for x in lines))
    md = "\n".join(
        [
            f"# Validation FAILED: `{dataset}`",
            "",
            f"{report['n_failed']}/{report['n_expectations']} expectations failed on `{report['source']}`; "
            f"the stages after it did not run. Details: `{failed.relative_to(root).as_posix()}`.",
            "",
            *(f"- {x}" for x in lines),
        ]
    )
    create_markdown_artifact(key=artifact_key("validation", dataset), markdown=md, description=f"validate@{dataset}")


@task(name="publish-artifacts", cache_policy=NO_CACHE, task_run_name="publish-artifacts")
def publish(root: str, datasets: list[str]) -> list[str]:
    """Leaderboard table, report markdown, validation results and links, as artifacts with stable keys."""
    from stages.core.artifacts import (
        LEADERBOARD_SCHEMA,
        REPORTS,
        data_docs_dir,
        prepared_path,
        validated_path,
    )
    from stages.core.io import read_json, read_parquet

    base = Path(root).resolve()
    keys: list[str] = []

    def link(key: str, path: Path, text: str, description: str) -> None:
        if path.exists():
            create_link_artifact(key=key, link=path.as_uri(), link_text=text, description=description)
            keys.append(key)

    board = base / REPORTS / "leaderboard.parquet"
    if board.is_file():
        rows = read_parquet(board, LEADERBOARD_SCHEMA).select(list(LEADERBOARD_COLUMNS)).to_pylist()
        key = artifact_key("leaderboard")
        create_table_artifact(key=key, table=rows, description="metrics per dataset × model × seed × split (data/reports/leaderboard.parquet)")
        keys.append(key)
        link(artifact_key("leaderboard", "parquet"), board, "data/reports/leaderboard.parquet", "the full leaderboard as Parquet")
    report = base / REPORTS / "report.md"
    if report.is_file():
        key = artifact_key("report")
        create_markdown_artifact(key=key, markdown=report.read_text(), description="data/reports/report.md")
        keys.append(key)
    for ds in datasets:
        link(artifact_key("prepared", ds), base / prepared_path(ds), prepared_path(ds).as_posix(), f"prepared data of {ds}")
        link(artifact_key("data-docs", ds), base / data_docs_dir(ds) / "index.html", f"Data Docs: {ds}", f"Great Expectations Data Docs of {ds}")
        result = base / validated_path(ds)
        if result.is_file():
            v = read_json(result)
            key = artifact_key("validation", ds)
            create_markdown_artifact(
                key=key,
                markdown=f"# Validation passed: `{ds}`\n\n{v['n_expectations'] - v['n_failed']}/{v['n_expectations']} "
                f"expectations passed on `{v['source']}`. Data Docs: `{(data_docs_dir(ds) / 'index.html').as_posix()}`.",
                description=f"validate@{ds}",
            )
            keys.append(key)
    outputs = parquet_outputs(base)
    if outputs:
        key = artifact_key("outputs")
        table = "\n".join(f"| [{p}]({(base / p).as_uri()}) | `{md5}` |" for p, md5 in outputs)
        create_markdown_artifact(key=key, markdown=f"# Parquet outputs\n\n| file | md5 (dvc.lock) |\n|---|---|\n{table}\n", description="every Parquet output DVC records")
        keys.append(key)
    return keys


def parquet_outputs(root: Path) -> list[tuple[str, str]]:
    """(path, md5) of every Parquet output in dvc.lock, including files inside output folders."""
    from pipeline.workspace import read_lock

    found: dict[str, str] = {}
    for stage in (read_lock(root) or {}).get("stages", {}).values():
        for out in stage.get("outs", []):
            path = Path(out["path"])
            if path.suffix == ".parquet":
                found[path.as_posix()] = str(out.get("md5", ""))
            elif (root / path).is_dir():
                for f in sorted((root / path).rglob("*.parquet")):
                    found[f.relative_to(root).as_posix()] = f"in {path.as_posix()} ({out.get('md5', '')})"
    return sorted(found.items())
