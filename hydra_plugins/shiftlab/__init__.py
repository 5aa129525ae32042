"""shiftlab's Hydra plugin: DVC's Hydra composition (`dvc exp run`, `make params`) imports it.

- `shiftlab_groups`, a config whose defaults list places every `conf/dataset/<name>.yaml` under
  `dataset.<name>` and every `conf/method/<name>.yaml` under `method.<name>`: adding a dataset
  or a method is one YAML file there (plus its module), not an edit of conf/config.yaml.
- the resolver `${shiftlab.models:${run.methods},${run.teachers}}`: every method and the
  student of every teacher, so `run.models` is derived, never written by hand.
- the resolver `${shiftlab.among:[lda, diffusion],${run.methods}}`: the default teachers the
  run trains (a run restricted to other methods distils none of them).
- the resolver `${shiftlab.dag:${run},${dataset},${method},${phase}}`: params.yaml's `dag` section,
  the items of dvc.yaml's stages with the code each runs (stages/dag.py; with `run.redraw_data`,
  one dataset instance per seed of each generated dataset: stages/core/replicates.py). It first validates
  the whole composed config (`stages.core.config.check_composed`, every section against its
  schema): DVC's `compose_and_dump` resolves the config before it writes params.yaml, so a
  bad override (`dvc exp run -S method.erm.lr=abc`) stops `dvc exp run` there, with
  params.yaml as it was and no stage run, hence no output deleted.

DVC runs Hydra in its own process, with the project not on sys.path: stages/dag.py (which
imports nothing itself) is loaded by file, and the check imports `stages.core.config` with the
project root put on sys.path for the import only.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

GROUPS = ("dataset", "method")
STUDENT_SUFFIX = "_student"


_ROOT = [Path(__file__).resolve().parents[2]]


def register(conf: Path) -> None:
    """(Re)register `shiftlab_groups` from the YAML files under `conf` (the project is its parent;
    a conf/ copied on its own, without the project's code beside it, keeps this plugin's project)."""
    _ROOT[0] = conf.parent if (conf.parent / "stages" / "dag.py").is_file() else Path(__file__).resolve().parents[2]
    defaults = [
        {f"/{group}@{group}.{path.stem}": path.stem}
        for group in GROUPS
        for path in sorted((conf / group).glob("*.yaml"))
    ]
    ConfigStore.instance().store(name="shiftlab_groups", node={"defaults": defaults})


def models(methods: ListConfig, teachers: ListConfig) -> ListConfig:
    """The models a run evaluates: its methods, then the student of each teacher."""
    return OmegaConf.create([*methods, *(f"{t}{STUDENT_SUFFIX}" for t in teachers)])


def extend(base: ListConfig, added: ListConfig) -> ListConfig:
    """`base` then each entry of `added` not already in it: `run.datasets` / `run.methods` from
    conf/config.yaml's list and `run.add_datasets` / `run.add_methods` (`-S 'run.add_methods=[x]'`
    adds one without restating the list)."""
    return OmegaConf.create([*base, *(a for a in added if a not in base)])


def among(names: ListConfig, methods: ListConfig) -> ListConfig:
    """`${shiftlab.among:[lda, diffusion],${run.methods}}`: the default teachers that this run
    trains, in their order (a run restricted to other methods distils none of them; a teacher
    named by hand, `-S 'run.teachers=[...]'`, must be in run.methods)."""
    return OmegaConf.create([n for n in names if n in methods])


def dag(run: DictConfig, datasets: DictConfig, methods: DictConfig, phase: DictConfig, *, _root_: DictConfig) -> DictConfig:
    """params.yaml's `dag` section (stages/dag.py `plan`), once the whole config is valid (`check`)."""
    root = _ROOT[0]
    check(_root_, root)
    spec = importlib.util.spec_from_file_location("shiftlab_dag", root / "stages" / "dag.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    plain: Any = OmegaConf.to_container
    return OmegaConf.create(module.plan(plain(run, resolve=True), plain(datasets), plain(methods), plain(phase), root))


def _in_dvc_experiment() -> bool:
    """Whether this composition is `dvc exp run`'s (DVC's experiments code is on the call stack):
    it then runs the experiment, after a checkout that removes the outputs of stages the
    experiment lacks, so a missing download must stop it here. Composing alone (`make params`,
    the tests' recipes) does not need the data."""
    import traceback

    return any(f"{os.sep}dvc{os.sep}repo{os.sep}experiments{os.sep}" in frame.filename for frame in traceback.extract_stack())


def check(config: DictConfig, root: Path) -> None:
    """Validate the composed `config` (all but `dag`, which is being resolved) with the project's
    `stages.core.config.check_composed`; a ConfigError says what is wrong in one line.

    In a Python without the project's dependencies (a DVC installed on its own) the check cannot
    run: it says so on stderr and lets composition go on (each stage still checks its section).
    """
    plain = {k: v for k, v in OmegaConf.to_container(config, resolve=False).items() if k != "dag"}  # type: ignore[union-attr]
    composed = OmegaConf.create(plain)
    OmegaConf.resolve(composed)
    path = str(root)
    sys.path.insert(0, path)
    try:
        config_module: Any = importlib.import_module("stages.core.config")
    except (ImportError, SystemExit) as e:  # stages/__init__.py exits naming the packages it lacks
        print(f"shiftlab: cannot check the composed config in this Python ({e}); run DVC from the project's "
              f"virtualenv", file=sys.stderr)
        return
    finally:
        sys.path.remove(path)
    try:
        config_module.check_composed(composed)
        if _in_dvc_experiment():  # about to run: what it reads from outside the DAG must be there
            config_module.check_inputs(composed)
    except config_module.ConfigError as e:
        lines = [ln.removeprefix("params.yaml: ") for ln in str(e).splitlines() if ln.strip()]
        raise config_module.ConfigError(
            f"{'; '.join(lines)}; the composed config is refused: params.yaml is not written and no stage runs"
        ) from None


register(Path(__file__).resolve().parents[2] / "conf")
for _name, _fn in (("shiftlab.models", models), ("shiftlab.extend", extend), ("shiftlab.among", among), ("shiftlab.dag", dag)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)
