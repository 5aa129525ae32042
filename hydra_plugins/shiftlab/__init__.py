"""shiftlab's Hydra plugin: DVC's Hydra composition (`dvc exp run`, `make params`) imports it.

- `shiftlab_groups`, a config whose defaults list places every `conf/dataset/<name>.yaml` under
  `dataset.<name>` and every `conf/method/<name>.yaml` under `method.<name>`: adding a dataset
  or a method is one YAML file there (plus its module), not an edit of conf/config.yaml.
- the resolver `${shiftlab.models:${run.methods},${run.teachers}}`: every method and the
  student of every teacher, so `run.models` is derived, never written by hand.
- the resolver `${shiftlab.dag:${run},${dataset},${method},${phase}}`: params.yaml's `dag` section,
  the items of dvc.yaml's stages with the code each runs (stages/dag.py).

DVC runs Hydra in its own process, so this file imports nothing from the project but
stages/dag.py, which imports nothing itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

GROUPS = ("dataset", "method")
STUDENT_SUFFIX = "_student"


_ROOT = [Path(__file__).resolve().parents[2]]


def register(conf: Path) -> None:
    """(Re)register `shiftlab_groups` from the YAML files under `conf` (the project is its parent)."""
    _ROOT[0] = conf.parent
    defaults = [
        {f"/{group}@{group}.{path.stem}": path.stem}
        for group in GROUPS
        for path in sorted((conf / group).glob("*.yaml"))
    ]
    ConfigStore.instance().store(name="shiftlab_groups", node={"defaults": defaults})


def models(methods: ListConfig, teachers: ListConfig) -> ListConfig:
    """The models a run evaluates: its methods, then the student of each teacher."""
    return OmegaConf.create([*methods, *(f"{t}{STUDENT_SUFFIX}" for t in teachers)])


def dag(run: DictConfig, datasets: DictConfig, methods: DictConfig, phase: DictConfig) -> DictConfig:
    """params.yaml's `dag` section (stages/dag.py `plan`)."""
    root = _ROOT[0]
    spec = importlib.util.spec_from_file_location("shiftlab_dag", root / "stages" / "dag.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    plain: Any = OmegaConf.to_container
    return OmegaConf.create(module.plan(plain(run, resolve=True), plain(datasets), plain(methods), plain(phase), root))


register(Path(__file__).resolve().parents[2] / "conf")
for _name, _fn in (("shiftlab.models", models), ("shiftlab.dag", dag)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)
