"""prefect.yaml: every deployment's entrypoint imports, its parameters fit the flow, it is servable."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in SPEC["deployments"]}


def load_flow(entrypoint: str) -> Any:
    from prefect.flows import Flow, load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    assert isinstance(flow, Flow), entrypoint
    return flow


def test_both_flows_are_deployed():
    flows = {load_flow(d["entrypoint"]).name for d in DEPLOYMENTS.values()}
    assert flows == {"shiftlab-pipeline", "shiftlab-sweep"}


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_entrypoint_imports_and_parameters_match_the_flow(name):
    spec = DEPLOYMENTS[name]
    # Module-style entrypoints: the flow's tasks must be importable in worker processes.
    assert ".py" not in spec["entrypoint"], "use module:flow so process/Dask workers can import the tasks"
    flow = load_flow(spec["entrypoint"])
    signature = inspect.signature(flow.fn)
    params = spec.get("parameters") or {}
    unknown = set(params) - set(signature.parameters)
    assert not unknown, f"{name}: parameters {sorted(unknown)} are not parameters of {flow.name}"
    required = {p for p, v in signature.parameters.items() if v.default is inspect.Parameter.empty}
    assert required <= set(params), f"{name}: required parameters {sorted(required - set(params))} have no value"
    # Prefect's own validation against the flow's type hints (what a triggered run goes through).
    validated = flow.validate_parameters(params)
    assert {k: validated[k] for k in params} == params
    assert spec["work_pool"]["name"] == "shiftlab"
    assert spec["concurrency_limit"]["limit"] == 1  # runs of a deployment share one workspace


def test_schedules_and_pull_step():
    from prefect.client.schemas.schedules import CronSchedule

    [nightly] = DEPLOYMENTS["nightly"]["schedules"]
    CronSchedule(cron=nightly["cron"], timezone=nightly["timezone"])  # raises on a bad cron/timezone
    assert not DEPLOYMENTS["grid"]["schedules"], "the sweep is triggered by hand"
    [pull] = SPEC["pull"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $SHIFTLAB_ROOT }}"
    serve = (ROOT / "pipeline" / "serve.sh").read_text()
    assert "SHIFTLAB_ROOT=" in serve and "deploy --all" in serve


def test_default_sweep_grid_is_valid():
    from pipeline.sweep import expand_grid, point_name

    params = DEPLOYMENTS["grid"]["parameters"]
    points = expand_grid(params["grid"])
    assert len(points) == 8
    assert len({point_name(params["name"], params["overrides"] + p) for p in points}) == 8
