"""Byte-identical derived outputs across machines (issue 16).

evaluate and report run on a tiny 3-class dataset with stand-in models (fixed logits), once
as usual and once under another order of every float reduction (another CPU's kernels sum in
another order), then in fresh processes without numpy's SIMD kernels for this CPU and with
another BLAS thread count. The metrics, plot data, leaderboard, summary and report they write
must be the same bytes every time, while the floats handed to the writers do differ in their
last bits: the fixed precision of `write_json(..., derived=True)` is what makes them equal.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stages import evaluate, report
from stages.core import provenance
from stages.core.artifacts import (
    SPLITS,
    metrics_path,
    predictions_path,
    predictions_schema,
    prepared_path,
)
from stages.core.io import (
    fixed_list_to_numpy,
    fixed_precision,
    read_json,
    read_parquet,
    save_weights,
    write_json,
)
from stages.evaluation import comparison, metrics, shift
from tests.support import project_env
from tests.test_evaluate_report import _write_prepared, toy_logits, toy_prepared

REPO = Path(__file__).resolve().parents[1]
KINDS = {"erm": "erm", "lda": "lda"}  # model name: kind
SEEDS = (0, 1)
N_CLASSES = 3
OPTIONS = ["evaluate.bootstrap_resamples=40", "evaluate.shift_steps=6", "evaluate.ece_bins=8"]
REPORT_ARGS = [
    "run.datasets=[toy]",
    "run.methods=[erm,lda]",
    "run.teachers=[]",
    "run.models=[erm,lda]",
    "run.seeds=[0,1]",
    "evaluate.er_reference=[erm,lda]",
    *OPTIONS,
]
WRITTEN = ("data/predictions", "data/metrics", "data/plots", "data/reports")


def run_pipeline(root: Path, mp: pytest.MonkeyPatch) -> dict[str, str]:
    """evaluate every (model, seed) and then report, in `root`; returns, per JSON file evaluate
    and report wrote, the object handed to `write_json`, and per model the report's summary
    before it is rounded (`comparison.at_written_precision`), as JSON with every float in full."""
    root.mkdir(parents=True, exist_ok=True)
    mp.chdir(root)
    Path("params.yaml").write_text((REPO / "params.yaml").read_text())
    prepared = toy_prepared(n_per_split=60, n_classes=N_CLASSES, seed=0)
    _write_prepared(prepared, prepared_path("toy"))
    logits: dict[str, np.ndarray] = {}
    for i, (model, kind) in enumerate(KINDS.items()):
        for seed in SEEDS:
            mdir = Path(f"data/models/toy/{model}/seed={seed}")
            made = provenance.record(dataset="toy", model=model, kind=kind, seed=seed, stage=f"train@toy-{model}-{seed}",
                                     config={}, inputs=[prepared_path("toy")])
            save_weights({}, mdir / "model.safetensors", {"kind": "stand_in"}, provenance=made)
            write_json({"config": {"kind": kind}, "provenance": made}, mdir / "config.json")
            logits[mdir.as_posix()] = toy_logits(prepared, seed=10 * i + seed)

    class StandIn:
        n_classes = N_CLASSES

        def __init__(self, z: np.ndarray) -> None:
            self.z = z

        def logits(self, x: np.ndarray, batch_size: int = 1) -> np.ndarray:
            return self.z

    raw: dict[str, str] = {}
    for module in (evaluate, report):
        def spy(obj: Any, path: Any, derived: bool = False, real: Any = module.write_json) -> Path:
            raw[Path(path).as_posix()] = json.dumps(obj, sort_keys=True)
            return real(obj, path, derived=derived)

        mp.setattr(module, "write_json", spy)
    at_precision = comparison.at_written_precision  # the report rounds its numbers before it draws them

    def spy_summary(s: comparison.ModelSummary) -> comparison.ModelSummary:
        raw[f"report summary of {s.model}"] = json.dumps(dataclasses.asdict(s), sort_keys=True)
        return at_precision(s)

    mp.setattr(comparison, "at_written_precision", spy_summary)
    from stages.core import registry

    for kind in KINDS.values():  # the methods' schemas (evaluate validates each model's section), before stages.models is stood in for
        registry.method(kind)
    with pytest.MonkeyPatch.context() as models:  # stand-ins while evaluate loads models, no torch
        fake = types.ModuleType("stages.models")
        fake.WEIGHTS = "model.safetensors"  # type: ignore[attr-defined]
        fake.load_model = lambda path, expect=None: StandIn(logits[Path(path).as_posix()])  # type: ignore[attr-defined]
        models.setitem(sys.modules, "stages.models", fake)
        models.setattr("stages.core.runtime.setup_torch", lambda seed: None)
        for model in KINDS:
            for seed in SEEDS:
                assert evaluate.main(["toy", model, str(seed), *OPTIONS]) == 0
    assert report.main(["--params", "params.yaml", *REPORT_ARGS]) == 0
    return raw


def written(root: Path) -> dict[str, bytes]:
    """Every file the pipeline wrote under data/predictions, metrics, plots and reports."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for top in WRITTEN
        for p in sorted((root / top).rglob("*"))
        if p.is_file()
    }


def reverse_every_reduction(mp: pytest.MonkeyPatch) -> None:
    """The same arithmetic with every float reduction behind the derived numbers in the
    opposite order: per-bin sums (np.bincount: reliability, group accuracies), sums over the
    classes (softmax, log-softmax: nll, brier, confidence), over the groups (shift curves), and
    the least-squares fit of effective robustness (np.polyfit)."""
    bincount, polyfit, curves = np.bincount, np.polyfit, shift._curves

    def bincount_reversed(x: Any, weights: Any = None, minlength: int = 0) -> np.ndarray:
        return bincount(np.asarray(x)[::-1], None if weights is None else np.asarray(weights)[::-1], minlength)

    mp.setattr(np, "bincount", bincount_reversed)
    mp.setattr(np, "polyfit", lambda x, y, deg: polyfit(np.asarray(x)[::-1], np.asarray(y)[::-1], deg))
    mp.setattr(shift, "_curves", lambda n, acc, mass, cell: curves(n[:, ::-1], acc[:, ::-1], mass[:, ::-1], cell[::-1]))
    for module, name in ((metrics, "log_softmax"), (metrics, "softmax"), (comparison, "softmax")):
        f = getattr(metrics, name)
        mp.setattr(module, name, lambda z, f=f: f(np.asarray(z)[:, ::-1])[:, ::-1])


@pytest.fixture(scope="module")
def as_usual(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("as_usual")
    with pytest.MonkeyPatch.context() as mp:
        raw = run_pipeline(root, mp)
    return root, raw


def test_derived_outputs_do_not_depend_on_the_summation_order(
    as_usual: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    usual_root, usual_raw = as_usual
    with pytest.MonkeyPatch.context() as mp:
        reverse_every_reduction(mp)
        other_raw = run_pipeline(tmp_path, mp)
    usual, other = written(usual_root), written(tmp_path)
    assert sorted(usual) == sorted(other)
    assert {"data/reports/summary.json", "data/reports/leaderboard.parquet", "data/reports/report.html",
            "data/plots/toy/erm/seed=0/shift_curve.json", "data/metrics/toy/lda/seed=1.json"} <= set(usual)
    assert [f for f in usual if usual[f] != other[f]] == []
    # Before rounding, the two orders disagree in evaluate's plot data and metrics and in the
    # numbers the report draws and writes (shift curves, intervals, effective robustness).
    differ = sorted(p for p in usual_raw if usual_raw[p] != other_raw[p])
    assert any(p.startswith("data/plots/") for p in differ), differ
    assert any(p.startswith("data/metrics/") for p in differ), differ
    assert {"report summary of erm", "report summary of lda"} <= set(differ), differ


def test_metrics_file_is_split_metrics_at_fixed_precision(as_usual: tuple[Path, dict[str, str]]) -> None:
    """docs/metrics.md: recomputed from the predictions file, `fixed_precision` of split_metrics
    is exactly what evaluate wrote."""
    root, _ = as_usual
    stored = read_json(root / metrics_path("toy", "lda", 1))
    t = read_parquet(root / predictions_path("toy", "lda", 1), predictions_schema(N_CLASSES))
    split = np.asarray(t.column("split").to_pylist())
    z, y, g = fixed_list_to_numpy(t.column("logits")), t.column("y").to_numpy(), t.column("g").to_numpy()
    n_groups = N_CLASSES * stored["n_attrs"]
    props = np.bincount(g[split == "train"], minlength=n_groups) / (split == "train").sum()
    boot = stored["bootstrap"]
    for i, s in enumerate(SPLITS):
        m = split == s
        again = metrics.split_metrics(z[m], y[m], g[m], n_groups, props, stored["ece_bins"],
                                      bootstrap_resamples=boot["resamples"], bootstrap_seed=[boot["seed"], i])
        again.pop("reliability")
        assert fixed_precision(again) == stored["splits"][s], s
        assert again != stored["splits"][s], s  # the file is rounded: full precision differs


def in_fresh_process(root: Path) -> None:
    """Entry point of the subprocess runs below."""
    with pytest.MonkeyPatch.context() as mp:
        raw = run_pipeline(root, mp)
    (root / "raw.json").write_text(json.dumps(raw))


def test_derived_outputs_are_the_same_without_this_cpus_simd_kernels(
    as_usual: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A fresh process that pretends to run on an older CPU: numpy's dispatched SIMD kernels
    (exp, log, reductions) that this CPU has are disabled, OpenBLAS uses its generic x86-64
    kernels and one thread. Same bytes as the usual run."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    disabled = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    env = {**project_env(), "NPY_DISABLE_CPU_FEATURES": " ".join(disabled), "OPENBLAS_NUM_THREADS": "1"}
    if platform.machine() == "x86_64":
        env["OPENBLAS_CORETYPE"] = "Prescott"
    code = "import sys; from pathlib import Path; from tests.test_cross_machine import in_fresh_process; in_fresh_process(Path(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    usual_root, usual_raw = as_usual
    usual, other = written(usual_root), written(tmp_path)
    assert sorted(usual) == sorted(other)
    assert [f for f in usual if usual[f] != other[f]] == []
    if disabled:  # this CPU has kernels to disable: their last bits differ from the generic ones
        other_raw = json.loads((tmp_path / "raw.json").read_text())
        assert any(usual_raw[p] != other_raw[p] for p in usual_raw), disabled
