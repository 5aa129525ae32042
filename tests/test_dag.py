"""dvc.yaml's code dependencies are exactly the code each stage runs (stages/dag.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dvc.repo import Repo
from omegaconf import OmegaConf

from stages import dag
from stages.core import registry

ROOT = Path(__file__).resolve().parent.parent


def test_dvc_yaml_code_lists_are_up_to_date(tmp_path):
    copy = tmp_path / "dvc.yaml"
    shutil.copy(ROOT / "dvc.yaml", copy)
    assert not dag.rewrite_dvc_yaml(copy, ROOT), "dvc.yaml's code deps are stale: run `make params`"


@pytest.fixture(scope="module")
def stage_deps() -> dict[str, list[str]]:
    with Repo(str(ROOT)) as repo:
        return {stage.addressing: [str(d.def_path) for d in stage.deps] for stage in repo.index.stages}


def expected_code(name: str, params) -> set[str]:
    """The entrypoint's closure plus the modules its kinds add, from params.yaml's own kinds."""
    stage, _, item = name.partition("@")
    files = [ROOT / "stages" / f"{stage}.py"]
    kind = {n: c.kind for n, c in params.method.items()}
    # a prepared dataset's kind is its section's (a replicate instance's: the dataset it redraws)
    dkind = {n: params.dataset[i.dataset].kind for n, i in params.dag.prepare.items()}
    if stage == "prepare":
        files.append(ROOT / "stages/datasets" / f"{dkind[item]}.py")
    elif stage in ("train", "distill", "evaluate"):
        dataset = next(d for d in params.dag.prepare if item.startswith(d + "-"))
        model = item[len(dataset) + 1 :].rsplit("-", 1)[0]
        if stage == "evaluate":
            files.append(ROOT / "stages/datasets" / f"{dkind[dataset]}.py")
        if stage == "train":
            files.append(ROOT / "stages/models" / f"{kind[model]}.py")
            up = dag.upstream(kind[model], OmegaConf.to_container(params.method[model]), ROOT)
            if up is not None:  # the method whose model it reads: its schema validates that model's settings
                files.append(ROOT / "stages/models" / f"{kind[up[1]]}.py")
        else:  # evaluate and distill load the model: the modules of every model kind its method may save,
            # and the method's own (its schema validates the settings the model was trained under)
            archs = ("mlp",) if model.endswith("_student") else (*registry.method(kind[model]).models, kind[model])
            files += [ROOT / "stages/models" / f"{arch}.py" for arch in archs]
    elif stage == "report":
        files += sorted((ROOT / "stages/models").glob("*.py"))
    elif stage == "phase":
        files.append(ROOT / "stages/datasets" / f"{params.phase.base.kind}.py")
        files.append(ROOT / "stages/models" / f"{params.phase.generative.kind}.py")
    return set(dag.code_deps(dag.closure(files, ROOT)))


def test_every_stage_depends_on_exactly_the_code_it_runs(stage_deps):
    params = OmegaConf.load(ROOT / "params.yaml")
    assert len(stage_deps) > 40
    for name, deps in stage_deps.items():
        code = {d for d in deps if d.startswith("stages/") and (d.endswith(".py") or d in dag.SHARED)}
        assert code == expected_code(name, params), name


def test_only_methods_that_read_the_encoder_wait_for_pretraining(stage_deps):
    reads = {name for name, deps in stage_deps.items() if name.startswith("train@") and any(d.startswith("data/pretrained/") for d in deps)}
    assert {f"train@colored_digits-{m}-0" for m in ("probe", "finetune")} <= reads
    # dfr re-trains the last layer of the model its `features` names (erm by default), not the DAE's
    assert not {f"train@colored_digits-{m}-0" for m in ("lda", "erm", "diffusion", "groupdro", "dfr")} & reads


def test_a_method_that_reads_another_methods_model_waits_for_it(stage_deps):
    params = OmegaConf.load(ROOT / "params.yaml")
    features = params.method.dfr.features
    # the run's (prepared dataset, seed) pairs: one per seed with run.redraw_data's instances
    pairs = {(i.dataset, i.seed) for i in params.dag.train.values()}
    assert pairs == {(d, s) for d in params.run.datasets for s in params.run.seeds}  # redraw_data off here
    for d, s in pairs:
        assert f"data/models/{d}/{features}/seed={s}" in stage_deps[f"train@{d}-dfr-{s}"]
    reads = {name for name, deps in stage_deps.items() if any(x.startswith("data/models/") for x in deps)}
    assert {name for name in reads if name.startswith("train@")} == {f"train@{d}-dfr-{s}" for d, s in pairs}


def test_a_kind_with_more_code_than_the_slots_is_an_error(tmp_path):
    root = tmp_path
    (root / "stages" / "models").mkdir(parents=True)
    (root / "stages" / "__init__.py").write_text("")
    (root / "stages" / "models" / "__init__.py").write_text("")
    (root / "stages" / "train.py").write_text("")
    names = [f"m{i}" for i in range(dag.SLOTS["train"] + 1)]
    for n in names:
        (root / "stages" / "models" / f"{n}.py").write_text("")
    (root / "stages" / "models" / "big.py").write_text("".join(f"import stages.models.{n}\n" for n in names))
    with pytest.raises(ValueError, match="raise stages/dag.py SLOTS"):
        dag.kind_code("train", ["stages.models.big"], root)
    assert dag.kind_code("train", ["stages.models.m0"], root) == ["stages/models/m0.py"] * dag.SLOTS["train"]


def test_the_slots_fit_every_kind_in_the_repository():
    """Every method and dataset module (and every pairing evaluate and the phase diagram can make)
    adds no more code deps than its stage's slots: a new kind that needs more fails here, not in a
    user's `dvc exp run`."""
    methods = sorted(registry.methods())
    datasets = sorted(registry.datasets())
    mkind = {m: f"stages.models.{m}" for m in methods}
    dmod = [f"stages.datasets.{d}" for d in datasets]
    items = [("prepare", [d]) for d in dmod]
    for m in methods:
        items += [("train", [mkind[m]]), ("distill", dag.model_modules(m))]
        items += [(stage, mods) for d in dmod for stage, mods in (("evaluate", [*dag.model_modules(m), d]), ("phase", [d, mkind[m]]))]
    for stage, mods in items:
        code = dag.kind_code(stage, mods)  # raises when the kind needs more slots
        assert len(code) == dag.SLOTS[stage], (stage, mods)
    for m in methods:  # a method's own module is among its train stage's slots
        assert f"stages/models/{m}.py" in dag.kind_code("train", [mkind[m]]), m


def test_a_shared_package_is_one_directory_dependency():
    assert dag.code_deps(["stages/core/io.py", "stages/core/cli.py", "stages/train.py"]) == ["stages/core", "stages/train.py"]
    for stage in dag.ENTRYPOINTS:
        code = dag.entrypoint_code(stage)
        assert "stages/core" in code and not any(c.startswith("stages/core/") for c in code), (stage, code)


def test_imports_follow_functions_but_not_type_checking(tmp_path):
    root = tmp_path
    (root / "stages").mkdir()
    (root / "stages" / "__init__.py").write_text("")
    for n in ("a", "b", "c", "d"):
        (root / "stages" / f"{n}.py").write_text("")
    (root / "stages" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nimport stages.b\nif TYPE_CHECKING:\n    import stages.c\n"
        "def f():\n    from stages import d\n"
    )
    assert dag.closure([root / "stages" / "a.py"], root) == ["stages/__init__.py", "stages/a.py", "stages/b.py", "stages/d.py"]
