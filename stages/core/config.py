"""The one config loader: a section of params.yaml, validated against its typed schema.

`conf/` (Hydra groups) is composed by DVC into `params.yaml`; stages never read `conf/`.
Each stage asks for its section (`dataset.<name>`, `method.<name>`, `evaluate`, ...),
which is merged into the section's dataclass: an unknown key, a missing key, a wrong type
or an out-of-range value raises `ConfigError` naming the full key before any work starts.
A dataset's or method's schema is the one its `kind` registered (stages/core/registry.py); the
stage sections' schemas are in stages/core/settings.py.

    python -m stages.core.config check      # validate the whole params.yaml
    python -m stages.core.config compose    # regenerate params.yaml from conf/ (as `dvc exp run` does)
    python -m stages.core.config compose a=1 --set b=1 --set b=2    # check both compose; write nothing

Composition validates before anything is written: our Hydra plugin's `shiftlab.dag` resolver
(hydra_plugins/shiftlab) runs `check_composed` on the composed config while DVC's
`compose_and_dump` resolves it, before it writes params.yaml. So `dvc exp run -S
method.<name>.lr=abc` stops there, with params.yaml as it was and no stage run (DVC deletes a
stage's outputs only when it runs it), and `compose` exits 2 with one line. `compose` also
writes params.yaml atomically (a temp file renamed over it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from stages.core import registry, replicates
from stages.core.schema import LOCAL_FILES, ConfigError, check
from stages.core.settings import (
    DistillConfig,
    EvaluateConfig,
    PhaseConfig,
    PretrainConfig,
    RunConfig,
    RuntimeConfig,
    TrainConfig,
    ValidateConfig,
    student_name,
)

__all__ = ["ConfigError", "load_params", "section", "dataset_config", "method_config", "defaults", "check_all"]

T = TypeVar("T")
PARAMS = Path("params.yaml")
CONF = Path(__file__).resolve().parents[2] / "conf"  # the project's, wherever the cwd is
# The stage sections every full run reads, and their schemas.
STAGE_SECTIONS: dict[str, type] = {
    "pretrain": PretrainConfig,
    "distill": DistillConfig,
    "train": TrainConfig,
    "runtime": RuntimeConfig,
    "validate": ValidateConfig,
    "evaluate": EvaluateConfig,
    "phase": PhaseConfig,
}


@functools.cache
def _yaml_loader() -> Any:
    """OmegaConf's YAML loader (its float rule, no timestamps, duplicate keys refused) on libyaml's
    C parser where PyYAML has it: the pure-Python parser spends ~0.1 s on a composed params.yaml,
    which every stage, `make check` and each `dvc exp run` read. Same values either way (the C
    parser only tokenises; tags are resolved and values built by the same Python code)."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    base = get_yaml_loader()
    try:
        from yaml.cyaml import CParser
    except ImportError:  # PyYAML built without libyaml
        return base

    class Loader(CParser, base):  # type: ignore[misc,valid-type]  # as yaml.CSafeLoader is built
        def __init__(self, stream: Any) -> None:
            CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    return Loader


def load_yaml(path: Path, omit: Sequence[str] = ()) -> DictConfig:
    """`OmegaConf.load(path)`, faster (`_yaml_loader`); raises what OmegaConf.load raises.
    The top-level keys in `omit` are left out (never made into OmegaConf nodes)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        obj = yaml.load(f, Loader=_yaml_loader())
    if obj is not None and not isinstance(obj, (list, dict, str)):
        raise OSError(f"Invalid loaded object type: {type(obj).__name__}")
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in omit}
    return OmegaConf.create() if obj is None else OmegaConf.create(obj)


# params.yaml's sections the stages never read: `dag` lists the DAG's items for dvc.yaml's
# `foreach` (DVC reads it; stages/dag.py and tests read it from the file). It is ~70 % of the
# file, and making it OmegaConf nodes cost ~55 ms of every stage's start.
NOT_READ_BY_STAGES = ("dag",)


def _nearest_key(cfg: DictConfig, key: str) -> str:
    """The way to a key that exists: at the first part of `key` params.yaml lacks, '; did you
    mean ...?' with the closest key of that section (difflib), else the section's keys."""
    import difflib

    parts = key.split(".")
    section: Any = cfg
    for i, part in enumerate(parts):
        if not isinstance(section, DictConfig):
            return f"; '{'.'.join(parts[:i])}' is a value, not a section"
        if part in section:
            section = section[part]
            continue
        parent = ".".join(parts[:i])
        keys = [str(k) for k in section]
        close = difflib.get_close_matches(part, keys, n=1)
        if close:
            return f"; did you mean '{'.'.join([*parts[:i], close[0], *parts[i + 1 :]])}'?"
        shown = ", ".join(keys[:12]) + (", ..." if len(keys) > 12 else "")
        return f" (the keys of {parent or 'params.yaml'}: {shown})"
    return ""


def yaml_problem(e: BaseException, path: Path) -> str:
    """A YAML parser's error as one line: what it found and where (line, column), not PyYAML's
    several lines of context; a TAB where indentation belongs says so."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    try:
        line = path.read_text(errors="replace").splitlines()[mark.line]
    except (OSError, IndexError):
        line = ""
    if line[mark.column : mark.column + 1] == "\t":
        return f"a TAB at {where}: YAML indents with spaces"
    return f"{' '.join(problem.split())} at {where}"


def load_params(path: str | Path = PARAMS, overrides: Sequence[str] = ()) -> DictConfig:
    """Read params.yaml (without NOT_READ_BY_STAGES) and apply `key=value` overrides (the hand-run path)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder; expected the params YAML file (params.yaml)")
    if not path.is_file():
        raise ConfigError(f"{path}: not found (run `make params` to compose it from conf/)")
    try:
        cfg = load_yaml(path, omit=NOT_READ_BY_STAGES)
    except Exception as e:  # yaml errors come in many classes
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(e, path)})") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    for ov in overrides:
        if "=" not in ov or ov.startswith("="):
            raise ConfigError(f"override '{ov}': expected key=value")
        key, value = ov.split("=", 1)
        key = key.lstrip("+")
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__" and not ov.startswith("+"):
            raise ConfigError(f"override '{ov}': unknown key '{key}'{_nearest_key(cfg, key)}")
        try:
            OmegaConf.update(cfg, key, OmegaConf.create({"v": _parse_value(value)}).v, merge=False, force_add=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"override '{ov}': {e.msg if hasattr(e, 'msg') else e}") from e
    return cfg


def _parse_value(text: str) -> Any:
    """Parse an override value the way Hydra does for plain values (YAML scalars and lists)."""
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def section(params: DictConfig, key: str, schema: type[T]) -> T:
    """Validate `params[key]` against `schema`; errors name the full key."""
    node = OmegaConf.select(params, key)
    if node is None:
        raise ConfigError(f"params.yaml: missing section '{key}'")
    if not isinstance(node, DictConfig):
        raise ConfigError(f"params.yaml: '{key}' must be a mapping, got {type(node).__name__}")
    return validate(node, key, schema)


def validate(node: Any, key: str, schema: type[T]) -> T:
    """`node` (a mapping) as a checked `schema` instance; errors name `key`."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        sub = getattr(e, "full_key", "") or ""
        reason = str(getattr(e, "msg", e)).splitlines()[0]
        if "Missing mandatory value" in reason:
            reason = "missing (every key of the schema needs a value in conf/)"
        raise ConfigError(f"params.yaml: {key}{'.' + sub if sub else ''}: {reason}") from None
    errors = check(obj)
    if errors:
        raise ConfigError("\n".join(f"params.yaml: {key}.{k}: {m}" for k, m in errors))
    return obj  # type: ignore[return-value]


def dataset_section(params: DictConfig, key: str) -> Any:
    """The validated dataset config at `key` (schema chosen by its `kind`)."""
    return section(params, key, registry.dataset(_kind(params, key, "dataset")).schema)


def dataset_config(params: DictConfig, name: str) -> Any:
    """The validated config of dataset `name` (schema chosen by its `kind`); for a replicate
    instance `<dataset>_seed<k>` (`run.redraw_data`), `dataset.<dataset>` with its seed replaced
    by the instance's (stages/core/replicates.py `data_seed`)."""
    base, replicate = dataset_source(params, name)
    cfg = dataset_section(params, f"dataset.{base}")
    if replicate is None:
        return cfg
    return dataclasses.replace(cfg, seed=replicates.data_seed(cfg.seed, replicate))


def dataset_source(params: DictConfig, name: str) -> tuple[str, int | None]:
    """(section, replicate seed) of dataset `name`: (name, None) for a dataset under `dataset`,
    (dataset, k) for an instance `<dataset>_seed<k>` of a generated dataset with a `seed` key.

    The instance is read from its name alone (not from run.seeds), so prepare and validate
    depend on `dataset.<dataset>` only and a hand-run `python -m stages.prepare <instance>` works
    for any k. A name that is neither falls through to the usual "no section" error."""
    if OmegaConf.select(params, f"dataset.{name}") is not None:
        return name, None
    parsed = replicates.parse(name)
    if parsed is not None and _redrawable(params, parsed[0]):
        return parsed
    return name, None


def _generated(params: DictConfig, name: str) -> bool:
    """Whether dataset `name`'s kind is generated (registered `generate=`); the kind is checked
    (ConfigError naming the known ones)."""
    return registry.dataset(_kind(params, f"dataset.{name}", "dataset")).generate is not None


def _redrawable(params: DictConfig, name: str) -> bool:
    node = OmegaConf.select(params, f"dataset.{name}")
    kind = node.get("kind") if isinstance(node, DictConfig) else None
    spec = registry.find_dataset(kind) if isinstance(kind, str) else None
    return spec is not None and spec.generate is not None and "seed" in {f.name for f in dataclasses.fields(spec.schema)}


def instances(params: DictConfig, run: RunConfig | None = None) -> dict[str, replicates.DataInstance]:
    """The datasets the run prepares, with the seeds that train and evaluate on each: one per
    dataset of run.datasets, or with run.redraw_data one instance per seed of each generated one
    (stages/core/replicates.py). Every stage that enumerates the run's datasets reads this (DVC's
    through params.yaml's `dag` section, which stages/dag.py derives the same way).

    ConfigError when a generated kind to redraw has no `seed` key or an instance's name is taken."""
    run = run if run is not None else section(params, "run", RunConfig)
    node = OmegaConf.select(params, "dataset")
    names = [str(k) for k in node] if isinstance(node, DictConfig) else []
    if run.redraw_data:
        for name in run.datasets:
            if _generated(params, name) and not _redrawable(params, name):
                kind = OmegaConf.select(params, f"dataset.{name}.kind")
                raise ConfigError(
                    f"params.yaml: run.redraw_data: dataset.{name} (kind {kind}) is generated but its schema has no "
                    f"`seed` key to redraw it with; set run.redraw_data=false or give the kind a seed"
                )
    return replicates.plan(run.datasets, run.seeds, run.redraw_data, lambda d: _generated(params, d), names)


def method_section(params: DictConfig, key: str) -> Any:
    """The validated method config at `key` (schema chosen by its `kind`)."""
    return section(params, key, registry.method(_kind(params, key, "method")).schema)


def method_config(params: DictConfig, name: str) -> Any:
    """The validated config of method `name` (schema chosen by its `kind`)."""
    return method_section(params, f"method.{name}")


def maker_config(params: DictConfig, key: str) -> Any:
    """The validated section `key` (`method.<name>`, `distill` or `pretrain`) that the stage making
    an artifact runs under, for a reader to compare with the artifact's provenance
    (`provenance.Expected.config`); None when params has no such section (a hand-written params
    file), which leaves that artifact's settings unchecked."""
    if OmegaConf.select(params, key) is None:
        return None
    return method_section(params, key) if key.startswith("method.") else section(params, key, STAGE_SECTIONS[key])


def _kind(params: DictConfig, key: str, what: str) -> str:
    node = OmegaConf.select(params, key)
    if node is None:
        parent = OmegaConf.select(params, key.rsplit(".", 1)[0])
        known = list(parent.keys()) if isinstance(parent, DictConfig) else []
        raise ConfigError(f"params.yaml: no section '{key}' (known: {known})")
    kind = node.get("kind") if isinstance(node, DictConfig) else None
    find = registry.find_dataset if what == "dataset" else registry.find_method
    if not isinstance(kind, str) or find(kind) is None:  # only then list (and import) every kind
        known = registry.datasets() if what == "dataset" else registry.methods()
        raise ConfigError(f"params.yaml: {key}.kind: must be one of {list(known)}, got '{kind}'")
    return kind


def defaults(group: str, name: str, **overrides: Any) -> Any:
    """The validated config `conf/<group>/<name>.yaml` with `overrides` applied: the values
    a run uses, for code and tests that build a config without a params.yaml."""
    path = CONF / group / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: not found")
    node = load_yaml(path)
    for k, v in overrides.items():
        OmegaConf.update(node, k, v, merge=False)
    key = f"{group}.{name}"
    if group == "dataset":
        return validate(node, key, registry.dataset(node.get("kind")).schema)
    if group == "method":
        return validate(node, key, registry.method(node.get("kind")).schema)
    schema = STAGE_SECTIONS.get(group)
    if schema is None:
        raise ConfigError(f"{path}: no schema for config group '{group}'")
    return validate(node, key, schema)


def configure_runtime(params: DictConfig, key: str = "runtime") -> Any:
    """Resolve the `runtime` section of `params` (conf/'s defaults where a hand-written params file
    has none) and make it this process's (`stages.core.runtime.use`): call it first in a stage,
    before reading any data, so a device this machine lacks stops the stage before any work."""
    from stages.core import runtime

    cfg = section(params, key, RuntimeConfig) if OmegaConf.select(params, key) is not None else defaults("runtime", "default")
    return runtime.use(runtime.resolve(cfg, key))


def check_all(params: DictConfig) -> RunConfig:
    """Validate every section `dvc repro` will read; raises on the first section with errors."""
    run = section(params, "run", RunConfig)
    datasets = {name: dataset_config(params, name) for name in run.datasets}
    instances(params, run)  # a replicate instance's name free, its kind redrawable
    for name in run.methods:
        cfg = method_config(params, name)
        # The train matrix runs every method on every dataset: a text method needs text everywhere.
        for dataset, dcfg in datasets.items():
            check_text_input(name, cfg, dataset, dcfg.kind)
        check_upstream(name, cfg, run.methods)
    for key, schema in STAGE_SECTIONS.items():
        section(params, key, schema)
    check_er_reference(params, section(params, "evaluate", EvaluateConfig))
    dataset_section(params, "phase.base")
    method_section(params, "phase.generative")
    return run


def check_inputs(params: DictConfig) -> None:
    """What the run needs from outside the DAG is there: each real benchmark's raw folder (its
    files, its CSVs' columns: the schema's `check_files`, stages/datasets/raw.py) and each
    method's local weights and vocabulary files, and the `runtime` device (a CUDA device this
    machine lacks). A cheap look (no file is read past a CSV's header), run by `stages.core.config check` (`make check`) and while `dvc exp run` composes
    params.yaml — before DVC's checkout, which removes the outputs of stages the experiment does
    not have: a recipe whose data is missing is refused with the workspace as it was."""
    from stages.core.io import ArtifactError

    run = section(params, "run", RunConfig)
    try:
        for name in run.datasets:
            cfg = dataset_config(params, name)
            if hasattr(cfg, "check_files"):
                cfg.check_files(name)
        for name in run.methods:
            cfg = method_config(params, name)
            for key in LOCAL_FILES:
                value = getattr(cfg, key, None)
                if value and not Path(value).is_file():
                    raise ConfigError(f"method.{name}.{key}: {value}: no such file (docs/datasets.md, "
                                      "'Published-scale recipes', says how to make it)")
    except ArtifactError as e:
        raise ConfigError(str(e)) from None
    runtime = section(params, "runtime", RuntimeConfig) if OmegaConf.select(params, "runtime") is not None else None
    if runtime is not None and runtime.device != "cpu":  # the CPU needs no look (and no torch import)
        from stages.core.runtime import resolve

        resolve(runtime)  # a CUDA device this machine lacks (or bf16 it cannot do) stops here


def check_composed(params: DictConfig) -> RunConfig:
    """`check_all`, then every other `dataset.<name>` and `method.<name>` section too: what a
    composed params.yaml must pass before it is written (a section this run does not read
    would still fail the next run that does)."""
    run = check_all(params)
    for group, validate_one in (("dataset", dataset_config), ("method", method_config)):
        node = OmegaConf.select(params, group)
        for name in node if isinstance(node, DictConfig) else ():
            validate_one(params, str(name))
    return run


def model_names(params: DictConfig) -> list[str]:
    """Every name a model can have: each method under `method`, then each one's student name."""
    node = OmegaConf.select(params, "method")
    methods = [str(k) for k in node] if isinstance(node, DictConfig) else []
    return methods + [student_name(m) for m in methods]


def check_er_reference(params: DictConfig, cfg: EvaluateConfig) -> None:
    """ConfigError unless every `evaluate.er_reference` and `evaluate.evidence_reference` entry,
    and `evaluate.evidence_matched`, is a model name (`model_names`).

    A name that is a model but not in this run is fine: the report says it is absent.
    """
    known = model_names(params)
    for key in ("er_reference", "evidence_reference", "evidence_matched"):  # the report's reference models
        value = getattr(cfg, key)
        bad = [m for m in ([value] if isinstance(value, str) else value) if m not in known]
        if bad:
            raise ConfigError(
                f"params.yaml: evaluate.{key}: {', '.join(repr(m) for m in bad)} "
                f"{'is not a model name' if len(bad) == 1 else 'are not model names'} "
                f"(a method under `method`: {', '.join(known[: len(known) // 2])}; or <method>{student_name('')})"
            )


def check_upstream(method: str, cfg: Any, methods: list[str]) -> None:
    """ConfigError when method `method` reads another method's trained model (its registered
    `upstream` key) and that method is not another one of `methods` (run.methods), so no train
    stage would make it. stages/dag.py checks the same when it plans the DAG."""
    spec = registry.method(cfg.kind)
    up = spec.upstream_method(cfg)
    if up is not None and (up not in methods or up == method):
        raise ConfigError(
            f"params.yaml: method.{method}.{spec.upstream}: '{up}' names the method whose trained model "
            f"method '{method}' reads, so it must be another method of run.methods {list(methods)}; add it "
            f"there, or set method.{method}.{spec.upstream}=pretrained"
        )


def check_text_input(method: str, cfg: Any, dataset: str, dataset_kind: str | None, has_text: bool | None = None) -> None:
    """ConfigError when method `method` (config `cfg`) reads text and dataset `dataset` has none.

    `has_text` (known once the prepared file is read) overrides the guess from `dataset_kind`.
    """
    if not registry.method(cfg.kind).reads_text:
        return
    if has_text is None:
        has_text = dataset_kind is not None and registry.dataset(dataset_kind).text
    if not has_text:
        text_kinds = [k for k, spec in registry.datasets().items() if spec.text]
        raise ConfigError(
            f"params.yaml: method.{method} (kind {cfg.kind}) reads the prepared `text` column, but dataset "
            f"'{dataset}' (kind {dataset_kind}) has none; run it on a text dataset ({', '.join(text_kinds)}), "
            f"e.g. `dvc exp run -S experiment=<a recipe on one of them>`"
        )


def describe_section(params: DictConfig | None, key: str, schema: type) -> str:
    """--help text of one section: its keys, types, meaning and the values params.yaml gives."""
    from stages.core.schema import describe

    values = OmegaConf.select(params, key) if params is not None else None
    return describe(schema, key, values if isinstance(values, DictConfig) else None)


def section_help(key: str, schema: type) -> Any:
    """The --help callback of a stage that reads one section: its keys and params.yaml's values."""
    return lambda: describe_section(help_params(), key, schema)


def help_params() -> DictConfig | None:
    """params.yaml for --help, or None when it is missing or unreadable (help still prints)."""
    try:
        return load_params()
    except ConfigError:
        return None


def compose(config_dir: str | Path = "conf", output: str | Path = PARAMS, overrides: Sequence[str] = ()) -> Path:
    """Compose conf/ into params.yaml exactly as `dvc exp run` does (DVC's own function).

    The composed config is validated during composition (`check_composed`, via the plugin's
    resolver) and written to a temp file renamed over `output`: on any error `output` is left
    as it was and a ConfigError says why in one line.
    """
    import tempfile

    from dvc.utils.hydra import compose_and_dump
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from stages.core.io import write_text

    conf = Path(config_dir).resolve()
    _hydra_plugin().register(conf)  # this conf/'s files, even if another project's were registered first
    with tempfile.TemporaryDirectory(prefix="shiftlab-compose-") as tmp:
        staged = Path(tmp) / Path(output).name  # same suffix: compose_and_dump picks its dumper by it
        try:
            compose_and_dump(staged, str(conf), None, "config", str(Path.cwd()), list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            raise ConfigError(f"{config_dir}/ with overrides {list(overrides)}: {_one_line(e)}") from None
        write_text(staged.read_text(encoding="utf-8"), output)
    return Path(output)


def compose_each(sets: Sequence[Sequence[str]], config_dir: str | Path = "conf") -> int:
    """Compose conf/ with each set of overrides in turn, as `compose` does, into a scratch file:
    nothing in the project is written. The first set that does not compose raises its
    ConfigError prefixed `--set <n>: ` (1-based). Returns the number of sets. pipeline.sweep
    checks every grid value this way before any point starts."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shiftlab-compose-each-") as tmp:
        for n, overrides in enumerate(sets, 1):
            try:
                compose(config_dir, Path(tmp) / "params.yaml", overrides)
            except ConfigError as e:
                raise ConfigError(f"--set {n}: {e}") from None
    return len(sets)


def _hydra_plugin() -> Any:
    """hydra_plugins/shiftlab of the project in the working directory (DVC imports it the same way)."""
    import importlib

    sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module("hydra_plugins.shiftlab")
    finally:
        sys.path.remove(str(Path.cwd()))


# OmegaConf's wrapper around an error a resolver raised (the plugin's config check): the
# message after it is ours.
_RESOLVER_ERROR = re.compile(r"^\w+ raised while resolving interpolation: ")


def _one_line(e: Exception) -> str:
    """A Hydra error on one line: its message and the options it lists, without the search path."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keep = []
    for ln in lines:
        if ln.startswith(("Config search path", "full_key:", "object_type=")):
            break
        keep.append(ln)
    return _RESOLVER_ERROR.sub("", " ".join(keep)) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    from stages.core.console import ArgumentParser
    from stages.core.io import ArtifactError, check_writable

    parser = ArgumentParser(name="config", prog="python -m stages.core.config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "compose", "show"])
    parser.add_argument("overrides", nargs="*", default=[])
    parser.add_argument("--params", default=str(PARAMS))
    parser.add_argument(
        "--set", dest="sets", action="append", nargs="*", metavar="KEY=VALUE",
        help="compose only: compose once per --set (after the other overrides) and write nothing; "
             "the first that fails is named by its position (`--set 2: ...`)",
    )
    args = parser.parse_intermixed_args(argv)  # `compose --params p.yaml key=value` too
    try:
        if args.sets is not None:
            if args.command != "compose":
                parser.error("--set goes with compose")
            n = compose_each([[*args.overrides, *s] for s in args.sets])
            print(f"config: {n} override set(s) compose into valid configs (nothing written)")
            return 0
        if args.command == "compose":
            check_writable(args.params)  # a folder or a read-only one: say so before composing
            print(f"config: wrote {compose(output=args.params, overrides=args.overrides)}")
            return 0
        params = load_params(args.params, args.overrides)
        run = check_composed(params)
        if args.command == "check":
            check_inputs(params)  # the raw data and weights files the run reads are there, the device too
        if args.command == "show":
            print(OmegaConf.to_yaml(params))
        prepared = instances(params, run)
        redrawn = f" ({len(prepared)} prepared: each generated one redrawn per seed)" if len(prepared) != len(run.datasets) else ""
        print(f"config: {args.params} is valid ({len(run.datasets)} datasets{redrawn} × {len(run.models)} models × {len(run.seeds)} seeds)")
        return 0
    except (ConfigError, ArtifactError) as e:
        print(f"config: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
