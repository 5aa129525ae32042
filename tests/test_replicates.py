"""Replicates that redraw the data (`run.redraw_data`, stages/core/replicates.py): the plan DVC
runs, the instances' configs and prepared files, and a real `dvc repro` / `dvc exp run`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from stages.core import artifacts, config, replicates
from stages.core.config import (
    ConfigError,
    check_all,
    dataset_config,
    dataset_source,
    instances,
    load_params,
)
from stages.core.io import read_json, read_metadata, read_parquet
from stages.prepare import main as prepare_main
from tests.support import project_env, repro_project

ROOT = Path(__file__).resolve().parents[1]


def compose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> dict:
    """conf/ composed with `overrides` exactly as `dvc exp run` does (plugin and `dag` included)."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"
    config.compose(ROOT / "conf", out, list(overrides))
    return yaml.safe_load(out.read_text())


REDRAW = ["run.redraw_data=true", "run.seeds=[0,1,2]", "run.datasets=[gaussian_shortcut,waterbirds,colored_digits]",
          "run.methods=[erm,lda,dfr]", "run.teachers=[lda]"]


def test_the_plan_gives_each_seed_its_own_instance_of_each_generated_dataset(tmp_path, monkeypatch):
    dag = compose(tmp_path, monkeypatch, *REDRAW)["dag"]
    generated = [f"{d}_seed{s}" for d in ("gaussian_shortcut", "colored_digits") for s in (0, 1, 2)]
    # run.datasets order; a real dataset keeps its fixed splits: one dataset for every seed
    assert list(dag["prepare"]) == generated[:3] + ["waterbirds"] + generated[3:]
    assert {k: v["dataset"] for k, v in dag["prepare"].items()} == {
        **{f"gaussian_shortcut_seed{s}": "gaussian_shortcut" for s in (0, 1, 2)},
        **{f"colored_digits_seed{s}": "colored_digits" for s in (0, 1, 2)},
        "waterbirds": "waterbirds",
    }
    # seed k trains, distills and evaluates on instance k only; the real dataset on every seed
    pairs = {(v["dataset"], v["seed"]) for v in dag["train"].values()}
    assert pairs == {(f"{d}_seed{s}", s) for d in ("gaussian_shortcut", "colored_digits") for s in (0, 1, 2)} | {
        ("waterbirds", s) for s in (0, 1, 2)}
    assert {(v["dataset"], v["seed"]) for v in dag["evaluate"].values()} == pairs
    assert {(v["dataset"], v["seed"]) for v in dag["distill"].values()} == pairs
    assert set(dag["train"]) == {f"{d}-{m}-{s}" for d, s in pairs for m in ("erm", "lda", "dfr")}
    # stage items point at the instance's own files (dfr reads erm's model of the same instance and seed)
    item = dag["train"]["colored_digits_seed2-dfr-2"]
    assert item["upstream"] == "data/models/colored_digits_seed2/erm/seed=2"
    assert item["code"] == dag["train"]["waterbirds-dfr-2"]["code"]  # the method's code, whatever the data
    assert dag["prepare"]["gaussian_shortcut_seed1"]["code"] == dag["prepare"]["gaussian_shortcut_seed0"]["code"]


def test_off_by_default_the_plan_is_one_dataset_for_every_seed(tmp_path, monkeypatch):
    params = compose(tmp_path, monkeypatch, "run.seeds=[0,1]")
    assert params["run"]["redraw_data"] is False
    assert list(params["dag"]["prepare"]) == params["run"]["datasets"]
    assert {(v["dataset"], v["seed"]) for v in params["dag"]["train"].values()} == {
        (d, s) for d in params["run"]["datasets"] for s in (0, 1)}


def test_derived_dataset_seeds_are_distinct_stable_and_in_range():
    # SeedSequence(dataset seed, spawn_key=(run seed,)): pinned, so a change can never pass unnoticed
    assert [replicates.data_seed(0, k) for k in range(5)] == [3757552657, 673228719, 3241444873, 3685993406, 1216546553]
    assert replicates.data_seed(7, 0) == 1201125462
    seeds = [replicates.data_seed(d, k) for d in (0, 1, 7, 2**32 - 1) for k in range(200)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s <= 2**32 - 1 for s in seeds)
    assert replicates.data_seed(2**32 - 1, 2**32 - 1) == replicates.data_seed(2**32 - 1, 2**32 - 1)


def test_an_instance_reads_its_datasets_section_with_the_derived_seed():
    params = load_params(ROOT / "params.yaml", ["run.redraw_data=true", "run.seeds=[0,3]", "dataset.gaussian_shortcut.seed=7"])
    base = dataset_config(params, "gaussian_shortcut")
    inst = dataset_config(params, "gaussian_shortcut_seed3")
    assert inst.seed == replicates.data_seed(7, 3) and base.seed == 7
    assert {**vars(inst), "seed": 7} == vars(base)  # everything else is the section's
    assert dataset_source(params, "gaussian_shortcut_seed3") == ("gaussian_shortcut", 3)
    assert dataset_source(params, "colored_digits") == ("colored_digits", None)
    # not an instance: a real dataset has no replicates, a name must be canonical
    for name in ("waterbirds_seed1", "gaussian_shortcut_seed03", "gaussian_shortcut_seed"):
        with pytest.raises(ConfigError, match=f"no section 'dataset.{name}'"):
            dataset_config(params, name)
    assert {n: (i.dataset, i.replicate_seed, i.seeds) for n, i in instances(params).items()} == {
        "gaussian_shortcut_seed0": ("gaussian_shortcut", 0, (0,)),
        "gaussian_shortcut_seed3": ("gaussian_shortcut", 3, (3,)),
        "colored_digits_seed0": ("colored_digits", 0, (0,)),
        "colored_digits_seed3": ("colored_digits", 3, (3,)),
    }


def test_an_instance_name_taken_by_a_section_is_one_line_naming_both(tmp_path, monkeypatch):
    params = load_params(ROOT / "params.yaml", ["run.redraw_data=true", "run.seeds=[0,1]",
                                                "+dataset.colored_digits_seed1.kind=colored_digits"])
    with pytest.raises(ConfigError) as err:
        instances(params)
    assert str(err.value).count("\n") == 0
    assert "dataset.colored_digits_seed1" in str(err.value) and "dataset.colored_digits's replicate for seed 1" in str(err.value)
    # and composition refuses it before params.yaml is written
    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"
    with pytest.raises(ConfigError, match="dataset.colored_digits's replicate for seed 1"):
        config.compose(ROOT / "conf", out, ["run.redraw_data=true", "run.seeds=[0,1]",
                                            "+dataset@dataset.colored_digits_seed1=colored_digits"])
    assert not out.exists()


def test_a_redrawn_instance_records_what_it_replicates(tmp_path, monkeypatch):
    small = load_params(ROOT / "params.yaml", [
        "run.redraw_data=true", "dataset.gaussian_shortcut.n_train=100", "dataset.gaussian_shortcut.n_val=40",
        "dataset.gaussian_shortcut.n_test_id=40", "dataset.gaussian_shortcut.n_test_ood=40"])
    OmegaConf.save(small, tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)

    for name in ("gaussian_shortcut_seed0", "gaussian_shortcut_seed1", "gaussian_shortcut"):
        assert prepare_main([name]) == 0
    meta = {n: read_metadata(artifacts.prepared_path(n)) for n in ("gaussian_shortcut_seed0", "gaussian_shortcut_seed1", "gaussian_shortcut")}
    for k in (0, 1):
        m = meta[f"gaussian_shortcut_seed{k}"]
        assert (m["dataset"], m["replicate_of"], m["replicate_seed"]) == (f"gaussian_shortcut_seed{k}", "gaussian_shortcut", k)
        assert m["params"]["seed"] == replicates.data_seed(0, k)
    assert "replicate_of" not in meta["gaussian_shortcut"] and meta["gaussian_shortcut"]["params"]["seed"] == 0
    xs = [artifacts.read_prepared(artifacts.prepared_path(n)).x for n in meta]
    assert not np.array_equal(xs[0], xs[1]) and not np.array_equal(xs[0], xs[2])


def test_the_evidence_recipe_redraws_five_replicates_of_six_datasets(tmp_path, monkeypatch):
    params = compose(tmp_path, monkeypatch, "experiment=evidence")
    run = check_all(load_params(tmp_path / "params.yaml"))
    assert run.redraw_data and len(run.seeds) >= 5
    bases = ["gaussian_shortcut", "colored_digits", "mnist1d_shortcut"]
    assert sorted(run.datasets) == sorted(bases + [f"{b}_paper" for b in bases])
    assert len(params["dag"]["prepare"]) == len(run.datasets) * len(run.seeds)
    assert set(run.methods) == {"lda", "qda", "diffusion", "autoregressive", "erm", "groupdro", "jtt", "dfr"}
    # each _paper section is its dataset's section here with the paper regime's knobs on top
    # (conf/regime/paper/<dataset>.yaml, the values experiment=paper_regime gives the dataset),
    # except where this recipe changed the dataset's own value (the test sizes): then that one
    paper = compose(tmp_path, monkeypatch, "experiment=paper_regime")["dataset"]
    defaults = yaml.safe_load((ROOT / "params.yaml").read_text())["dataset"]
    for b in bases:
        regime = yaml.safe_load((ROOT / "conf/regime/paper" / f"{b}.yaml").read_text())
        assert regime and all(paper[b][k] == v for k, v in regime.items())
        ours = params["dataset"][b]
        for key, value in params["dataset"][f"{b}_paper"].items():
            regime_knob = key in regime and ours[key] == defaults[b][key]
            assert value == (regime[key] if regime_knob else ours[key]), (b, key)


# ---- the real DAG -------------------------------------------------------------------------

TINY = [
    "experiment=tiny", "run.redraw_data=true", "run.seeds=[0,1]", "run.datasets=[gaussian_shortcut,colored_digits]",
    "run.methods=[lda]", "run.teachers=[]", "dataset.colored_digits.test_repeats=2",
]


def ran_stages(log: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", log))


@pytest.mark.slow
@pytest.mark.xdist_group("replicates_dvc")
def test_make_repro_trains_each_seed_once_on_its_own_instance(tmp_path: Path, prefect_home: Path) -> None:
    # The report and what it reads (pretrain is the one stage no lda model needs), run as `make
    # repro` runs it (the flow; tests/test_builtin_datasets.py runs a whole DAG with plain `dvc
    # repro`): each instance is prepared, validated, trained on and evaluated, and seed k's model
    # sees instance k only.
    log = repro_project(tmp_path, TINY, "report", prefect_home=prefect_home)
    ran = ran_stages(log)
    inst = {d: [f"{d}_seed{s}" for s in (0, 1)] for d in ("gaussian_shortcut", "colored_digits")}
    expected = {"phase", "report"}
    for names in inst.values():
        for s, name in enumerate(names):
            expected |= {f"prepare@{name}", f"validate@{name}", f"train@{name}-lda-{s}", f"evaluate@{name}-lda-{s}"}
    assert ran == expected  # each model trained once per seed, on its own instance, and nothing else

    for d, names in inst.items():
        preps = [artifacts.read_prepared(tmp_path / artifacts.prepared_path(n)) for n in names]
        for s, p in enumerate(preps):
            assert (p.meta["replicate_of"], p.meta["replicate_seed"]) == (d, s)
        # two draws of the same config: different data (attributes, cue noise; splits for the digits)
        assert not np.array_equal(preps[0].x, preps[1].x)
        assert preps[0].meta["split_sizes"] == preps[1].meta["split_sizes"]
        for s, name in enumerate(names):
            metrics = read_json(tmp_path / artifacts.metrics_path(name, "lda", s))
            assert (metrics["dataset"], metrics["seed"]) == (name, s)
            preds = read_parquet(tmp_path / artifacts.predictions_path(name, "lda", s))
            assert preds.column("id").to_pylist() == preps[s].id.tolist()
        # lda has no initialisation: its two seeds differ only because their data does
        first, second = (read_json(tmp_path / artifacts.metrics_path(n, "lda", s)) for s, n in enumerate(names))
        assert first["splits"]["test_ood"] != second["splits"]["test_ood"]
    board = read_parquet(tmp_path / "data/reports/leaderboard.parquet")
    assert set(zip(board.column("dataset").to_pylist(), board.column("seed").to_pylist(), strict=True)) == {
        (n, s) for names in inst.values() for s, n in enumerate(names)}

    # `dvc exp run -S dataset.gaussian_shortcut.rho_train=0.9` composes params.yaml as below, then
    # re-runs what DVC finds changed and what follows from it: the changed stages are exactly the
    # prepare stages of that dataset's instances (the others' params and inputs are as they were).
    env = project_env()
    subprocess.run([sys.executable, "-m", "stages.core.config", "compose", *TINY, "dataset.gaussian_shortcut.rho_train=0.9"],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    status = json.loads(subprocess.run(["dvc", "status", "--json"], cwd=tmp_path, env=env, check=True,
                                       capture_output=True, text=True).stdout)
    status = {k: v for k, v in status.items() if not k.startswith("pretrain@")}  # never run here (no lda reads it)
    assert set(status) == {f"prepare@{n}" for n in inst["gaussian_shortcut"]}, status
    for stage, changes in status.items():
        assert changes == [{"changed deps": {"params.yaml": {"dataset.gaussian_shortcut": "modified"}}}], (stage, changes)


def test_compose_cli_names_a_bad_redraw_value_in_one_line(tmp_path):
    out = tmp_path / "params.yaml"
    proc = subprocess.run([sys.executable, "-m", "stages.core.config", "compose", "--params", str(out), "run.redraw_data=maybe"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "run.redraw_data" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()
