"""evaluate: predictions/metrics/plots from logits; report: leaderboard, markdown, summary."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages import evaluate, report
from stages.core import provenance
from stages.core.artifacts import (
    LEADERBOARD_SCHEMA,
    SPLITS,
    Prepared,
    metrics_path,
    plots_dir,
    predictions_path,
    predictions_schema,
    prepared_path,
    prepared_schema,
)
from stages.core.io import (
    ArtifactError,
    fixed_list_to_numpy,
    numpy_to_fixed_list,
    read_json,
    read_metadata,
    read_parquet,
    save_weights,
    write_json,
    write_parquet,
)
from stages.evaluation import comparison
from stages.evaluation.metrics import clopper_pearson
from stages.reporting import render

REPO = Path(__file__).resolve().parents[1]
METRIC_KEYS = {
    "n",
    "acc",
    "worst_group_acc",
    "worst_group_acc_exact",
    "avg_acc_weighted",
    "balanced_acc",
    "ece",
    "nll",
    "brier",
    "confusion",
    "groups",
}


def toy_prepared(
    n_per_split: int = 20, n_classes: int = 2, n_attrs: int = 2, seed: int = 0
) -> Prepared:
    rng = np.random.default_rng(seed)
    n = n_per_split * len(SPLITS)
    split = np.array([s for s in SPLITS for _ in range(n_per_split)], dtype=object)
    rng.shuffle(split)  # interleaved splits: the file's row order must be kept
    y = rng.integers(0, n_classes, n)
    a = rng.integers(0, n_attrs, n)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    meta = {"dataset": "toy", "n_classes": n_classes, "n_attrs": n_attrs, "shape": [4]}
    return Prepared(
        np.arange(n, dtype=np.int64)[::-1].copy() + 100, split, y, a, y * n_attrs + a, x, meta
    )


def toy_logits(prepared: Prepared, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (
        2.0 * np.eye(prepared.n_classes)[prepared.y]
        + rng.normal(size=(len(prepared.y), prepared.n_classes))
    ).astype(np.float32)


# ---- evaluate --------------------------------------------------------------------------------


def test_predictions_follow_the_contract(tmp_path: Path) -> None:
    prepared = toy_prepared()
    logits = toy_logits(prepared)
    table, _, _ = evaluate.evaluate_predictions(prepared, logits, ece_bins=10)
    path = write_parquet(
        table, tmp_path / "seed=0.parquet", predictions_schema(2), {"dataset": "toy"}
    )
    back = read_parquet(path, predictions_schema(2))
    assert back.schema.names == predictions_schema(2).names
    assert back.column("id").to_pylist() == prepared.id.tolist()  # prepared row order, all splits
    assert back.column("split").to_pylist() == prepared.split.tolist()
    for col in ("y", "a", "g"):
        assert back.column(col).to_pylist() == getattr(prepared, col).tolist()
    np.testing.assert_array_equal(fixed_list_to_numpy(back.column("logits")), logits)
    assert back.column("pred").to_pylist() == logits.argmax(axis=1).tolist()


def test_metrics_for_every_split() -> None:
    prepared = toy_prepared()
    _, metrics, plots = evaluate.evaluate_predictions(prepared, toy_logits(prepared), ece_bins=10)
    assert set(metrics["splits"]) == set(SPLITS)
    for split, m in metrics["splits"].items():
        assert set(m) == METRIC_KEYS, split
        assert m["n"] == int((prepared.split == split).sum())
        assert set(m["groups"]) == {"0", "1", "2", "3"}
    assert metrics["test_ood_acc"] == metrics["splits"]["test_ood"]["acc"]
    assert metrics["test_id_worst_group_acc"] == metrics["splits"]["test_id"]["worst_group_acc"]
    assert (metrics["dataset"], metrics["n_classes"], metrics["n_attrs"]) == ("toy", 2, 2)
    json.dumps(metrics, allow_nan=False)
    # Plot data: flat records, reliability only for the two test splits, non-empty bins only.
    assert {r["split"] for r in plots["reliability"]} == {"test_id", "test_ood"}
    assert all(
        set(r) == {"split", "bin_lower", "bin_upper", "n", "conf", "acc"} and r["n"] > 0
        for r in plots["reliability"]
    )
    assert (
        sum(r["n"] for r in plots["reliability"] if r["split"] == "test_ood")
        == metrics["splits"]["test_ood"]["n"]
    )
    assert {r["split"] for r in plots["groups"]} == set(SPLITS)
    assert all(r["group"] == r["y"] * 2 + r["a"] for r in plots["groups"])


def test_evaluate_rejects_bad_logits_and_missing_splits() -> None:
    prepared = toy_prepared()
    with pytest.raises(ArtifactError, match=r"shape \(80, 3\)"):
        evaluate.evaluate_predictions(
            prepared, np.zeros((80, 3)), 10, source="data/prepared/toy.parquet"
        )
    bad = toy_logits(prepared)
    bad[5, 1] = np.nan
    with pytest.raises(ArtifactError, match=f"first id {prepared.id[5]}"):
        evaluate.evaluate_predictions(prepared, bad, 10)
    no_ood = prepared.subset("train")
    with pytest.raises(ArtifactError, match="split 'val' has no rows"):
        evaluate.evaluate_predictions(no_ood, toy_logits(no_ood), 10)


def test_model_info_and_producing_stage(tmp_path: Path) -> None:
    assert evaluate.model_info(tmp_path) == {}
    trained = {
        "method": "erm",
        "config": {"kind": "erm", "init": "scratch", "lr": 0.1},
        "selection": "val_avg",
        "selected_epoch": 3,
    }
    write_json(trained, tmp_path / "config.json")
    assert evaluate.model_info(tmp_path) == {
        "kind": "erm",
        "init": "scratch",
        "selection": "val_avg",
        "selected_epoch": 3,
    }
    write_json(
        {"config": {"kind": "lda", "shrinkage": 0.1}, "selection": None, "selected_epoch": 0},
        tmp_path / "config.json",
    )
    assert evaluate.model_info(tmp_path) == {"kind": "lda", "selected_epoch": 0}
    student = {
        "method": "lda_student",
        "teacher": "lda",
        "teacher_kind": "lda",
        "config": {"temperature": 2.0},
        "selection": "val_avg",
    }
    write_json(student, tmp_path / "config.json")
    assert evaluate.model_info(tmp_path) == {
        "kind": "distill",
        "selection": "val_avg",
        "teacher": "lda",
        "teacher_kind": "lda",
    }
    assert evaluate.producing_stage("toy", "erm", 1) == "train@toy-erm-1"
    assert evaluate.producing_stage("toy", "lda_student", 0) == "distill@toy-lda-0"


def _write_prepared(prepared: Prepared, path: Path) -> None:
    table = pa.table(
        {
            "id": prepared.id,
            "split": prepared.split.tolist(),
            "y": prepared.y,
            "a": prepared.a,
            "g": prepared.g,
            "x": numpy_to_fixed_list(prepared.x),
        }
    )
    write_parquet(table, path, prepared_schema(4), prepared.meta)


def test_evaluate_run_with_a_stand_in_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() wiring, with a fake `stages.models` so this test does not depend on the real one."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "params.yaml", "params.yaml")
    prepared = toy_prepared()
    _write_prepared(prepared, prepared_path("toy"))
    mdir = Path("data/models/toy/erm/seed=0")
    trained = provenance.record(dataset="toy", model="erm", kind="erm", seed=0, stage="train@toy-erm-0", config={},
                                inputs=[prepared_path("toy")])
    save_weights({}, mdir / "model.safetensors", {"kind": "stand_in"}, provenance=trained)
    write_json({"config": {"kind": "erm", "lr": 0.1}, "selection": "val_avg", "provenance": trained}, mdir / "config.json")
    fixed = toy_logits(prepared)

    class StandIn:
        n_classes = 2

        def logits(self, x: np.ndarray, batch_size: int = 1) -> np.ndarray:
            assert batch_size == 7  # the override below reaches the model
            return fixed

    fake = types.ModuleType("stages.models")
    fake.load_model = lambda path, expect=None: StandIn()  # type: ignore[attr-defined]
    fake.WEIGHTS = "model.safetensors"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "stages.models", fake)
    monkeypatch.setattr("stages.core.runtime.setup_torch", lambda seed: None)  # no torch import needed

    assert evaluate.main(["toy", "erm", "0", "evaluate.batch_size=7", "evaluate.ece_bins=5"]) == 0
    metrics = read_json(metrics_path("toy", "erm", 0))
    assert (metrics["dataset"], metrics["model"], metrics["seed"], metrics["ece_bins"]) == (
        "toy",
        "erm",
        0,
        5,
    )
    assert metrics["model_config"] == {"kind": "erm", "selection": "val_avg"}
    made = metrics["provenance"]
    assert read_metadata(predictions_path("toy", "erm", 0)) == {
        "dataset": "toy",
        "model": "erm",
        "seed": 0,
        "n_classes": 2,
        "n_attrs": 2,
        "provenance": made,
    }
    assert (made["dataset"], made["model"], made["kind"], made["seed"], made["stage"]) == ("toy", "erm", "erm", 0, "evaluate@toy-erm-0")
    assert set(made["inputs"]) == {"data/prepared/toy.parquet", "data/models/toy/erm/seed=0/model.safetensors"}
    assert isinstance(read_json(plots_dir("toy", "erm", 0) / "reliability.json"), list)
    assert isinstance(read_json(plots_dir("toy", "erm", 0) / "groups.json"), list)
    first = (
        metrics_path("toy", "erm", 0).read_bytes(),
        predictions_path("toy", "erm", 0).read_bytes(),
    )
    assert evaluate.main(["toy", "erm", "0", "evaluate.batch_size=7", "evaluate.ece_bins=5"]) == 0
    assert (
        metrics_path("toy", "erm", 0).read_bytes(),
        predictions_path("toy", "erm", 0).read_bytes(),
    ) == first

    assert evaluate.main(["toy", "groupdro", "0"]) == 2  # no model folder


# ---- report ----------------------------------------------------------------------------------

# (test_id acc, test_ood acc, test_ood worst-group acc) per dataset, model, seed
ACCS = {
    ("gauss", "erm"): [(0.95, 0.60, 0.30), (0.93, 0.50, 0.20)],
    ("gauss", "lda"): [(0.90, 0.85, 0.80), (0.90, 0.85, 0.80)],
    ("digits", "erm"): [(0.99, 0.70, 0.50), (0.97, 0.72, 0.52)],
    ("digits", "lda"): [(0.88, 0.80, 0.70), (0.86, 0.84, 0.74)],
}
KINDS = {"erm": {"kind": "erm", "selection": "val_avg"}, "lda": {"kind": "lda"}}


def fake_provenance(dataset: str, model: str, seed: int) -> dict:
    """The provenance evaluate records for a run (the report checks it against the file's path)."""
    return provenance.record(dataset=dataset, model=model, kind=KINDS[model]["kind"], seed=seed,
                             stage=f"evaluate@{dataset}-{model}-{seed}", config={}, inputs=[])


def fake_metrics(dataset: str, model: str, seed: int) -> dict:
    id_acc, ood_acc, wga = ACCS[(dataset, model)][seed]

    def split(acc: float, worst: float) -> dict:
        return {
            "n": 100,
            "acc": acc,
            "worst_group_acc": worst,
            "avg_acc_weighted": acc,
            "balanced_acc": acc,
            "ece": 0.05,
            "nll": 0.3,
            "brier": 0.2,
            "groups": {"0": {"n": 100, "acc": acc}},
        }

    splits = {
        "train": split(1.0, 1.0),
        "val": split(id_acc, id_acc),
        "test_id": split(id_acc, id_acc),
        "test_ood": split(ood_acc, wga),
    }
    return {
        "dataset": dataset,
        "model": model,
        "seed": seed,
        "n_classes": 2,
        "n_attrs": 2,
        "ece_bins": 15,
        "model_config": KINDS[model],
        "provenance": fake_provenance(dataset, model, seed),
        "splits": splits,
        "test_id_acc": id_acc,
        "test_ood_acc": ood_acc,
        "test_id_worst_group_acc": id_acc,
        "test_ood_worst_group_acc": wga,
    }


RUNS = [(d, m, s) for d in ("gauss", "digits") for m in ("erm", "lda") for s in (0, 1)]


def test_build_report() -> None:
    built = render.build_report([fake_metrics(*r) for r in RUNS])
    table, markdown, summary, plots = built.leaderboard, built.markdown, built.summary, built.plots

    assert table.schema == LEADERBOARD_SCHEMA
    assert table.num_rows == len(RUNS) * len(SPLITS)
    keys = list(
        zip(
            *(table.column(c).to_pylist() for c in ("dataset", "model", "seed", "split")),
            strict=True,
        )
    )
    assert keys == sorted(keys, key=lambda k: (k[0], k[1], k[2], SPLITS.index(k[3])))
    assert keys[0] == ("digits", "erm", 0, "train")

    assert "## gauss" in markdown and "## digits" in markdown
    assert markdown.index("## gauss") < markdown.index("## digits")  # run order, not alphabetical
    rows = [
        line
        for line in markdown.splitlines()
        if line.startswith("| erm") or line.startswith("| lda")
    ]
    assert len(rows) == 4
    erm_gauss = rows[0].split(" | ")
    assert erm_gauss[1:3] == ["discriminative", "val_avg"]
    assert erm_gauss[3] == "0.940 ± 0.014"  # mean and sample sd of .95, .93
    assert rows[1].split(" | ")[1:3] == ["generative", "—"]
    assert rows[1].split(" | ")[4] == "0.850 ± 0.000"
    # No predictions, so no paired test: the highest model is not called best.
    assert (
        "**Takeaway:** highest OOD worst-group accuracy: lda (0.800; untested: no paired bootstrap without "
        "predictions); largest ID→OOD drop: erm" in markdown
    )
    assert "| lda | generative |" in markdown and "highest (untested: no paired bootstrap)" in markdown

    erm = dict(summary["gauss"]["erm"])
    # The exact interval comes from the groups' counts (here one group of 100 at the seeds' accuracies).
    assert erm.pop("test_ood_worst_group_acc_exact") == pytest.approx(
        np.mean([clopper_pearson(round(a[1] * 100), 100, 0.975) for a in ACCS[("gauss", "erm")]], axis=0).tolist()
    )
    assert erm == pytest.approx({"test_id_acc": 0.94, "test_ood_acc": 0.55, "test_ood_worst_group_acc": 0.25})
    assert len(plots["id_vs_ood"]) == len(RUNS)
    assert set(plots["id_vs_ood"][0]) == {"dataset", "model", "series", "seed", "id_acc", "ood_acc"}
    assert plots["worst_group"][0] == {
        "dataset": "gauss",
        "model": "erm",
        "worst_group_acc": pytest.approx(0.25),
    }

    # A single seed shows no ± and the leaderboard does not depend on input order.
    single = render.build_report([fake_metrics("gauss", "erm", 0)]).markdown
    assert (
        "| erm | discriminative | val_avg | 0.950 | 0.600 |" in single
        and "±" not in single.split("## gauss")[1]
    )
    shuffled = render.build_report([fake_metrics(*r) for r in reversed(RUNS)]).leaderboard
    assert shuffled.equals(table)


def test_report_effective_robustness_uses_a_named_reference_family_on_logit_axes() -> None:
    from stages.core.config import defaults
    from stages.evaluation.metrics import robustness_baseline

    runs = [fake_metrics("gauss", m, s) for m in ("erm", "lda") for s in (0, 1)]
    # Reference family erm + lda: 4 (model, seed) points, every model gets a number.
    built = render.build_report(runs, boot=defaults("evaluate", "default", er_reference=["erm", "lda"]))
    base = robustness_baseline([0.95, 0.93, 0.90, 0.90], [0.60, 0.50, 0.85, 0.85])
    per_seed = [base.effective_robustness(i, o) for i, o in ((0.95, 0.60), (0.93, 0.50))]
    erm_row = next(r for r in built.markdown.splitlines() if r.startswith("| erm"))
    col = render.HEADER.index("eff. robustness")
    mean = sum(per_seed) / 2
    # No predictions, so no interval: one decimal, never a 3-decimal figure the fit cannot support.
    sd = float(np.std(per_seed, ddof=1))
    assert erm_row.split(" | ")[col] == f"{mean:+.1f} ± {sd:.1f} (no interval)"
    assert "No interval (no predictions, or `evaluate.bootstrap_resamples` is 0): one decimal only." in built.markdown
    assert built.summary["gauss"]["erm"]["effective_robustness"] == pytest.approx(mean)
    note = next(r for r in built.markdown.splitlines() if r.startswith("**eff. robustness**"))
    assert "logit axes" in note and "reference family erm, lda (`evaluate.er_reference`): 4 points" in note
    assert "Not in this run" not in note
    assert "logit fit" in built.svgs["gauss-id-vs-ood"] and "over erm, lda" in built.svgs["gauss-id-vs-ood"]
    assert "reference family erm, lda" in built.markdown.split("gauss-id-vs-ood.svg")[0].rsplit("![", 1)[1]

    # The default family (erm, probe, finetune) has only erm's 2 points here: n/a, with the reason
    # and the absent models named, in markdown and HTML alike; no number anywhere.
    built = render.build_report(runs, boot=defaults("evaluate", "default"))
    erm_row = next(r for r in built.markdown.splitlines() if r.startswith("| erm"))
    assert erm_row.split(" | ")[col] == "n/a"
    note = next(r for r in built.markdown.splitlines() if r.startswith("**eff. robustness**"))
    assert "reference family erm, probe, finetune" in note
    assert note.endswith("**n/a** here: 2 reference points, needs 3. Not in this run: probe, finetune.")
    assert "<strong>n/a</strong> here: 2 reference points, needs 3. Not in this run: probe, finetune." in built.html
    assert "effective_robustness" not in built.summary["gauss"]["erm"]
    assert "logit fit" not in built.svgs["gauss-id-vs-ood"]


def test_report_rejects_an_er_reference_that_is_no_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _run_params(tmp_path)
    assert report.main([*_report_args(params), "evaluate.er_reference=[erm,ermm]"]) == 2
    err = capsys.readouterr().err
    assert "evaluate.er_reference: 'ermm' is not a model name" in err


def test_report_names_model_types() -> None:
    assert comparison.model_type({"kind": "lda"}) == "generative"
    assert comparison.model_type({"kind": "diffusion"}) == "generative"
    assert (
        comparison.model_type({"kind": "groupdro", "selection": "val_worst_group"}) == "discriminative"
    )
    assert (
        comparison.model_type({"kind": "distill", "teacher": "lda"})
        == "discriminative (student of lda)"
    )
    assert comparison.model_type({}) == "?"


def _run_params(tmp_path: Path) -> Path:
    text = (REPO / "params.yaml").read_text()
    params = tmp_path / "params.yaml"
    params.write_text(text)
    return params


def fake_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the repo: every fake run's metrics and predictions, the prepared files'
    regimes, and params.yaml (returned)."""
    monkeypatch.chdir(tmp_path)
    params = _run_params(tmp_path)
    for r in RUNS:
        write_json(fake_metrics(*r), metrics_path(*r))
        write_fake_predictions(*r)
    write_fake_prepared_regimes()
    return params


def _report_args(params: Path) -> list[str]:
    return [
        "--params",
        str(params),
        "run.datasets=[gauss,digits]",
        "run.methods=[erm,lda]",
        "run.teachers=[]",
        "run.models=[erm,lda]",
        "run.seeds=[0,1]",
    ]


def test_report_run_writes_deterministic_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = fake_run(tmp_path, monkeypatch)
    assert report.main([*_report_args(params), "evaluate.bootstrap_resamples=50"]) == 0
    out = Path("data/reports")
    files = [
        "leaderboard.parquet",
        "report.md",
        "report.html",
        "summary.json",
        "plots/id_vs_ood.json",
        "plots/worst_group.json",
        "plots/shift_curve.json",
        "figures/gauss-shift.svg",
    ]
    first = {f: (out / f).read_bytes() for f in files}
    assert read_parquet(out / "leaderboard.parquet", LEADERBOARD_SCHEMA).num_rows == 32
    assert report.main([*_report_args(params), "evaluate.bootstrap_resamples=50"]) == 0
    assert {f: (out / f).read_bytes() for f in files} == first
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 8 and "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "vs best (worst-group)" in (out / "report.md").read_text()


def write_fake_prepared_regimes() -> None:
    """Prepared files whose metadata the report reads: gauss states its regime, digits predates it."""
    from stages.core.artifacts import prepared_path
    from stages.core.io import write_parquet

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    table = pa.table({"id": pa.array([0], pa.int64())}, schema=schema)
    meta = {"separation": {"cue": 10.0, "core": 2.0}, "separation_source": "closed_form"}
    write_parquet(table, prepared_path("gauss"), schema, metadata=meta)
    write_parquet(table, prepared_path("digits"), schema, metadata={})


def test_report_states_each_datasets_regime_and_what_was_observed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The regime line: the prepared file's separation, what it predicts, and the generative
    models' ID→OOD drop against the discriminative reference (`evaluate.evidence_reference`) —
    and no verdict word, since without an interval (no bootstrap here) the evidence has none."""
    params = fake_run(tmp_path, monkeypatch)
    assert report.main([*_report_args(params), "evaluate.bootstrap_resamples=0", "evaluate.evidence_reference=[erm]"]) == 0
    md = Path("data/reports/report.md").read_text()
    summary = json.loads(Path("data/reports/summary.json").read_text())

    def drop(dataset: str, model: str) -> float:
        return float(np.mean([a[0] - a[1] for a in ACCS[(dataset, model)]]))

    gen, ref = drop("gauss", "lda"), drop("gauss", "erm")
    gauss = md.split("## gauss")[1].split("## digits")[0]
    assert "**Regime** (closed form): separation cue 10 vs core 2" in gauss
    assert f"generative {gen:.3f} (lda {gen:.3f}) vs discriminative reference {ref:.3f} (erm {ref:.3f}), a difference of {gen - ref:+.3f}" in gauss
    for word in ("as predicted", "contrary to the prediction", "generative better", "discriminative better"):
        assert word not in md, word
    assert "**Evidence** over 2 replicates of gauss, matched pairs: lda − erm" in gauss and "not distinguishable" in gauss
    assert [p["verdict"] for p in summary["_evidence"]["gauss"]["pairs"]] == ["not distinguishable"]
    assert summary["_evidence"]["gauss"]["note"].startswith("No interval")
    assert summary["gauss"]["_regime"] == pytest.approx(
        {"separation_cue": 10.0, "separation_core": 2.0, "drop_generative": gen, "drop_reference": ref}
    )
    assert "**Regime**: not recorded" in md.split("## digits")[1]
    assert "separation_cue" not in summary["digits"]["_regime"]


def write_fake_predictions(dataset: str, model: str, seed: int, per_split: int = 40) -> None:
    """A predictions file for a fake run: every split, all four groups, seeded random logits."""
    rng = np.random.default_rng([sum(map(ord, dataset)), sum(map(ord, model)), seed])
    prepared = toy_prepared(per_split, seed=0)
    logits = toy_logits(prepared, seed=int(rng.integers(1000)))
    table, _, _ = evaluate.evaluate_predictions(prepared, logits, 10)
    write_parquet(table, predictions_path(dataset, model, seed), predictions_schema(2),
                  metadata={"provenance": fake_provenance(dataset, model, seed)})


def test_report_missing_metrics_exits_2_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _run_params(tmp_path)
    for r in RUNS:
        if r != ("digits", "lda", 1):
            write_json(fake_metrics(*r), metrics_path(*r))
    assert report.main(_report_args(params)) == 2
    err = capsys.readouterr().err
    assert "data/metrics/digits/lda/seed=1.json" in err
    assert "dvc repro evaluate@digits-lda-1" in err
    assert not Path("data/reports/report.md").exists()


def test_report_rejects_a_malformed_metrics_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    params = _run_params(tmp_path)
    for r in RUNS:
        m = fake_metrics(*r)
        if r == ("gauss", "lda", 0):
            del m["splits"]["test_ood"]["ece"]
        write_json(m, metrics_path(*r))
    assert report.main(_report_args(params)) == 2
    err = capsys.readouterr().err
    assert "data/metrics/gauss/lda/seed=0.json" in err and "splits.test_ood.ece" in err


def model_rows(markdown: str) -> dict[str, list[str]]:
    """The cells of every model table row (the rows with the model table's width), by model."""
    cells = [line[2:-2].split(" | ") for line in markdown.splitlines() if line.startswith("| ")]
    return {c[0]: c for c in cells if len(c) == len(render.HEADER) and c[0] not in ("model", "---")}


def test_ties_are_ties_and_best_only_when_the_paired_test_says_so() -> None:
    from stages.core.config import defaults
    from tests.test_evidence import _run
    from tests.test_report_html import _runs

    # lda has the highest worst-group accuracy, erm's difference to it holds 0: tied, no best.
    metrics, data = _runs()
    built = render.build_report(metrics, data, boot=defaults("evaluate", "default", bootstrap_resamples=200))
    rows = model_rows(built.markdown)
    col = render.HEADER.index("vs best (worst-group)")
    assert rows["lda"][col] == "highest, **tied** with erm"
    assert rows["erm"][col].endswith("not significant: **tied**")
    assert rows["groupdro"][col].endswith(" significant") and "tied" not in rows["groupdro"][col]
    assert "**Takeaway:** no single best: the highest OOD worst-group accuracy, lda (0.545), is not distinguishable " \
           "from erm (0.500) at this split's group sizes (smallest test_ood group: 4 examples)" in built.markdown
    assert "best OOD worst-group accuracy" not in built.markdown
    assert "| worst-group acc (smallest group: 4) |" in built.markdown
    assert built.summary["toy"]["_smallest_group"] == {"test_id": 2, "test_ood": 4}
    # One model far ahead of the others on 240 examples a group: called best.
    metrics, data = _run([("toy", 0)], gen_acc=0.95, ref_acc=0.3, n=240)
    keep = [m for m in metrics if m["model"] != "qda"]
    built = render.build_report(keep, data, boot=defaults("evaluate", "default", bootstrap_resamples=200))
    assert "**Takeaway:** best OOD worst-group accuracy: **lda** (" in built.markdown
    assert "ahead of every other model (paired bootstrap, each interval excludes 0)" in built.markdown


def test_effective_robustness_interval_precision_and_extrapolation() -> None:
    from stages.core.config import defaults
    from tests.test_report_html import _runs

    # One seed of three reference models: 3 points, a line but no interval (a mixture of ~4 lines).
    metrics, data = _runs()
    boot = defaults("evaluate", "default", bootstrap_resamples=200, er_reference=["groupdro", "lda_student", "lda"])
    built = render.build_report(metrics, data, boot=boot)
    assert "effective_robustness_ci" not in built.summary["toy"]["lda"]
    note = next(r for r in built.markdown.splitlines() if r.startswith("**eff. robustness**"))
    assert "**No interval**: 3 reference points; an interval needs at least 9" in note
    # Three seeds each: 9 points, intervals.
    metrics, data = _runs(seeds=3)
    built = render.build_report(metrics, data, boot=boot)
    col = render.HEADER.index("eff. robustness")
    rows = model_rows(built.markdown)
    for model in ("erm", "lda", "groupdro", "lda_student"):
        s = built.summary["toy"][model]
        lo, hi = s["effective_robustness_ci"]
        d = render.supported_decimals([lo, hi])
        assert lo <= s["effective_robustness"] <= hi or d < 3, model
        assert rows[model][col].split(" ± ")[0] == f"{s['effective_robustness']:+.{d}f}", rows[model][col]
        assert f" [{lo:+.{d}f}, {hi:+.{d}f}]" in rows[model][col], rows[model][col]
    # The reference points' ID accuracies span their range; erm's lie below it: extrapolated.
    ids = [m["splits"]["test_id"]["acc"] for m in metrics if m["model"] in ("groupdro", "lda_student", "lda")]
    erm_ids = [m["splits"]["test_id"]["acc"] for m in metrics if m["model"] == "erm"]
    assert max(erm_ids) < min(ids)
    assert built.summary["toy"]["erm"]["effective_robustness_extrapolated"] is True
    assert rows["erm"][col].endswith("*extrapolated*")
    note = next(r for r in built.markdown.splitlines() if r.startswith("**eff. robustness**"))
    assert f"**Extrapolated** (a seed's ID acc outside the reference points' {min(ids):.3f}–{max(ids):.3f}" in note
    assert "resampled and the line refitted each time" in note
    assert render.supported_decimals([0.0, 0.8]) == 1 and render.supported_decimals([0.0, 0.08]) == 2
    assert render.supported_decimals([0.0, 0.008]) == 3 and render.supported_decimals(None) == 1


def test_replicate_base_reads_the_prepared_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    table = pa.table({"id": pa.array([0], pa.int64())}, schema=schema)
    write_parquet(table, prepared_path("gauss_seed3"), schema, metadata={"replicate_of": "gauss", "replicate_seed": 3})
    write_parquet(table, prepared_path("gauss"), schema, metadata={})
    write_parquet(table, prepared_path("bad"), schema, metadata={"replicate_of": 7})
    assert comparison.replicate_base("gauss_seed3") == "gauss"
    assert comparison.replicate_base("gauss") == "gauss"
    with pytest.raises(ArtifactError, match=r"data/prepared/bad.parquet: file metadata 'replicate_of' must be a dataset name, got 7"):
        comparison.replicate_base("bad")


def test_training_cell_shows_the_over_fitting_flag() -> None:
    runs = [fake_metrics("gauss", "erm", s) for s in (0, 1)]
    runs[0]["model_config"] = {**KINDS["erm"], "convergence": {"flag": "plateaued", "improvement": -0.075, "overfitting": True}}
    runs[1]["model_config"] = {**KINDS["erm"], "convergence": {"flag": "may be under-trained", "improvement": 0.02, "overfitting": False}}
    row = next(r for r in render.build_report(runs).markdown.splitlines() if r.startswith("| erm"))
    cell = row.split(" | ")[render.HEADER.index("training")]
    assert cell == "**may be under-trained** (improved 2.0%, 1/2 seeds); **may be over-fitting** (1/2 seeds)"
