"""Running the expectations through Great Expectations 1.x (an ephemeral context, one checkpoint
over the frames of stages/validation/expectations.py) and writing its Data Docs with
deterministic bytes: no load time, no remote logo, UUIDs numbered in order.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stages.validation.data_docs import localize
from stages.validation.expectations import MAX_EXAMPLES, Check

# A fixed run identity keeps GX from stamping the current time into the Data Docs paths.
RUN_TIME = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def run_suite(
    frames: Mapping[str, Any], checks: Sequence[Check], dataset: str, docs_out: Path | None
) -> list[dict[str, Any]]:
    """Run `checks` on `frames` with GX; return one plain record per check, in `checks` order.

    With `docs_out` and every expectation passing, GX's Data Docs site is copied there (a
    fresh folder the caller swaps in); a failing run builds no docs.
    """
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.base import ProgressBarsConfig

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shiftlab-gx-") as tmp:
        context = gx.get_context(mode="file", project_root_dir=tmp)
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        source = context.data_sources.add_pandas("shiftlab")
        run_id = RunIdentifier(run_name=f"validate-{dataset}", run_time=RUN_TIME)
        for frame_name, frame in frames.items():
            batch = source.add_dataframe_asset(frame_name).add_batch_definition_whole_dataframe(
                "whole"
            )
            suite = context.suites.add(gx.ExpectationSuite(name=f"{dataset}.{frame_name}"))
            for check in checks:
                if check.frame == frame_name:
                    cls = getattr(gx.expectations, check.expectation)
                    suite.add_expectation(
                        cls(
                            **check.kwargs, meta={"name": check.name}, description=check.description
                        )
                    )
            definition = context.validation_definitions.add(
                gx.ValidationDefinition(name=f"{dataset}.{frame_name}", data=batch, suite=suite)
            )
            checkpoint = context.checkpoints.add(
                gx.Checkpoint(
                    name=f"{dataset}.{frame_name}",
                    validation_definitions=[definition],
                    result_format="COMPLETE",
                )
            )
            outcome = checkpoint.run(batch_parameters={"dataframe": frame}, run_id=run_id)
            for suite_result in outcome.run_results.values():
                for r in suite_result.results:
                    name = r.expectation_config.meta["name"]
                    results[name] = record(r)
        if docs_out is not None and all(r["success"] for r in results.values()):
            site = Path(context.build_data_docs()["local_site"].removeprefix("file://")).parent
            shutil.copytree(site, docs_out)
            scrub_docs(docs_out)
    return [{"name": c.name, "frame": c.frame, "why": c.why, **results[c.name]} for c in checks]


REMOTE_LOGO = re.compile(r'"https://great-expectations-web-assets\.[^"]*/logo-long\.png[^"]*"')


LOAD_TIME = re.compile(r'(>ge_load_time</span>.{0,400}?word-break:break-all;" >)[^<]*', re.DOTALL)


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def scrub_docs(site: Path) -> None:
    """Make a Data Docs site byte-reproducible and offline.

    GX 1.24 stamps three varying things into its pages: a remote logo URL carrying the
    current time and a random data-context id (a request to S3 whenever a page is opened),
    the batch's `ge_load_time`, and a fresh uuid4 in each collapsible block's HTML id.
    The logo becomes the copy under static/images, the load time a fixed marker, and each
    uuid a counter in order of appearance within its page. The scripts and styles the pages
    load from CDNs are copied into static/vendor and loaded from there (stages/validation/data_docs.py).
    """
    logo = site / "static" / "images" / "logo-long.png"
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        text = REMOTE_LOGO.sub(f'"{os.path.relpath(logo, page.parent)}"', text)
        text = LOAD_TIME.sub(r"\g<1>(not recorded)", text)
        page.write_text(number_uuids(text), encoding="utf-8")
    localize(site)


def number_uuids(text: str) -> str:
    """Each distinct uuid in `text` as `block<k>`, k counting in order of first appearance."""
    ids: dict[str, str] = {}
    return UUID.sub(lambda m: ids.setdefault(m.group(0), f"block{len(ids)}"), text)


def record(r: Any) -> dict[str, Any]:
    """A GX expectation result as a plain, deterministic dict (no ids, times or versions)."""
    kwargs = {k: v for k, v in r.expectation_config.kwargs.items() if k != "batch_id"}
    res = r.result or {}
    rec: dict[str, Any] = {
        "type": r.expectation_config.type,
        "column": kwargs.get("column"),
        "kwargs": plain(kwargs),
        "success": bool(r.success),
        "observed": plain(res.get("observed_value")),
    }
    if "unexpected_count" in res:
        rec["element_count"] = plain(res.get("element_count"))
        rec["unexpected_count"] = plain(res["unexpected_count"])
        rec["unexpected_examples"] = plain(
            list(res.get("partial_unexpected_list") or [])[:MAX_EXAMPLES]
        )
        rec["unexpected_rows"] = plain(list(res.get("unexpected_index_list") or [])[:MAX_EXAMPLES])
    errors = exception_messages(r.exception_info or {})
    if errors:
        rec["success"] = False
        rec["error"] = "; ".join(errors)
    return rec


def exception_messages(info: Mapping[str, Any]) -> list[str]:
    """Messages of the exceptions GX caught, whether `info` is flat or keyed by metric."""
    if "raised_exception" in info:
        return [str(info.get("exception_message"))] if info["raised_exception"] else []
    nested = (exception_messages(v) for v in info.values() if isinstance(v, Mapping))
    return sorted({m for msgs in nested for m in msgs})


def plain(v: Any) -> Any:
    """numpy/pandas values as JSON-safe Python values (non-finite floats as strings)."""
    if isinstance(v, Mapping):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple | set | np.ndarray):
        return [plain(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)
