"""The exact code each DVC stage runs, so DVC re-runs a stage when (and only when) it changes.

A stage's code is its entrypoint (stages/<stage>.py) with everything it imports, transitively,
plus the modules it reaches through the registry by kind: train its method's module
(stages/models/<kind>.py) and its upstream method's, prepare its dataset's module, evaluate its
dataset's, its model's (the model kind the method registered, e.g. `mlp`) and its method's,
distill its teacher's model's and method's (a reader validates the section its model was made
under: stages/core/provenance.py). Imports are read from the source
(`ast`), nothing is executed, and this module imports nothing from the project at import time,
so that DVC's own Hydra composition (hydra_plugins/shiftlab) can load it by file (`plan` imports
stages.core once the plugin's config check has made the project importable: the run's datasets,
replicate instances included, come from stages.core.config `instances`, as the stages' do):

- the code common to every item of a stage (its entrypoint's closure) is written into
  dvc.yaml itself by `python -m stages.dag` (`make params`; tests/test_dag.py fails when
  dvc.yaml is stale);
- the part that depends on an item's kind goes into params.yaml's `dag` section, which
  `run.*` and the kinds in `dataset.*` / `method.*` determine, as a fixed number of slots
  (`${item.code[0]}` ...; DVC cannot interpolate a list into deps), padded by repeating an
  entry already present — DVC records a repeated dependency twice, which changes nothing.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stages",)
ENTRYPOINTS = ("fetch", "prepare", "validate", "pretrain", "train", "distill", "evaluate", "phase", "report")
# Per-item code deps a stage may add to its entrypoint's (dvc.yaml's `${item.code[i]}` slots, padded
# by repetition: DVC records every slot, so each one unused is a wasted entry in dvc.lock); more is
# an error naming the number to raise. Sized to the largest kind in the repository (tests/test_dag.py).
SLOTS = {"prepare": 4, "train": 8, "distill": 8, "evaluate": 16, "phase": 16}
# Packages that every stage imports most of: each is one directory dependency rather than a file
# dependency per module it holds. Editing one of its modules re-runs the stages that import any
# module of it (nearly all do); dvc.lock is ~40 % shorter, and DVC re-reads and rewrites the whole
# lock after every stage it runs (ruamel's round trip: most of `dvc repro`'s own time).
SHARED = ("stages/core",)
STUDENT_SUFFIX = "_student"  # stages.core.settings.STUDENT_SUFFIX (this module imports nothing)
STUDENT_MODEL = "mlp"  # the model kind stages/distill.py trains


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The file of a project module (`stages.models.<kind>` -> stages/models/<kind>.py), or None."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


REGISTRATIONS = ("register_method", "register_dataset")
REFERENCE = re.compile(r"^((?:stages)(?:\.\w+)+):\w+$")  # stages.core.registry.Ref as a string


def imports(path: Path, root: Path = ROOT) -> set[Path]:
    return set(_imports(Path(path), root, Path(path).stat().st_mtime_ns))


@functools.cache
def _imports(path: Path, root: Path, mtime: int) -> frozenset[Path]:
    """Project files `path` imports: at top level or inside functions (they run too), not under
    `if TYPE_CHECKING:`; importing a.b.c counts a/__init__.py and a/b/__init__.py too. A
    registration's "module:function" references (stages/core/registry.py) count as imports."""
    names: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:  # one walk, not into `if TYPE_CHECKING:` blocks
        node = todo.pop()
        if isinstance(node, ast.If) and _typing_only(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
            continue
        if isinstance(node, ast.ImportFrom):
            if node.module and not node.level:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}
            continue
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in REGISTRATIONS:
            # a registration's "module:function" references run when the kind is used
            names |= {m.group(1) for a in [*node.args, *(k.value for k in node.keywords)]
                      if isinstance(a, ast.Constant) and isinstance(a.value, str) and (m := REFERENCE.match(a.value))}
        if isinstance(node, ast.expr) and not isinstance(node, (ast.Call, ast.Lambda)):
            continue  # no import or registration inside a plain expression
        todo.extend(ast.iter_child_nodes(node))
    found = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            f = module_file(".".join(parts[:i]), root)
            if f is not None:
                found.add(f)
    return frozenset(found)


def _typing_only(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def closure(files: Iterable[Path], root: Path = ROOT) -> list[str]:
    """`files` and every project file they import, transitively, as sorted repo-relative paths."""
    seen: set[Path] = set()
    todo = [Path(f) for f in files]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo.extend(imports(f, root) - seen)
    return sorted(p.relative_to(root).as_posix() for p in seen)


def code_deps(paths: Iterable[str]) -> list[str]:
    """Repo-relative code files as DVC deps: those in a SHARED package as the package's folder."""
    return sorted({next((pkg for pkg in SHARED if p.startswith(pkg + "/")), p) for p in paths})


def entrypoint_code(stage: str, root: Path = ROOT) -> list[str]:
    """The code every item of `stage` runs: stages/<stage>.py and its imports (for the report,
    which asks every model's method module whether it is generative, every method module's too)."""
    files = [root / "stages" / f"{stage}.py"]
    if stage == "report":
        files += sorted((root / "stages" / "models").glob("*.py"))
    return code_deps(closure(files, root))


def kind_code(stage: str, modules: Iterable[str], root: Path = ROOT) -> list[str]:
    """The code an item adds by its kinds' `modules` (e.g. `stages.models.<kind>`): their closure
    (as `code_deps`) minus the entrypoint's, padded to SLOTS[stage] by repeating its last entry."""
    files = []
    for m in modules:
        f = module_file(m, root)
        if f is None:
            raise ValueError(f"no module {m} (a kind's module is stages/models/<kind>.py or stages/datasets/<kind>.py)")
        files.append(f)
    common = set(entrypoint_code(stage, root))
    extra = [p for p in code_deps(closure(files, root)) if p not in common]
    slots = SLOTS[stage]
    if len(extra) > slots:
        raise ValueError(f"{stage}: {len(extra)} kind-specific code files {extra}; raise stages/dag.py SLOTS['{stage}'] (then `make params`)")
    return extra + [extra[-1]] * (slots - len(extra)) if extra else [f"stages/{stage}.py"] * slots


def registered(module_path: Path, call: str) -> dict[str, Any]:
    """The literal keyword arguments of the module's `call(...)` (its registration)."""
    return dict(_registered(module_path, call, module_path.stat().st_mtime_ns))


@functools.cache
def _registered(module_path: Path, call: str, mtime: int) -> tuple[tuple[str, Any], ...]:
    for node in ast.walk(ast.parse(module_path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == call:
            out = {}
            for kw in node.keywords:
                try:
                    out[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    out[kw.arg] = None
            return tuple(out.items())
    raise ValueError(f"{module_path}: no {call}(...) call")


def method_registration(kind: str, root: Path = ROOT) -> dict[str, Any]:
    """The literal keywords of stages/models/<kind>.py's `register_method` (see stages/core/registry.py)."""
    return registered(root / "stages" / "models" / f"{kind}.py", "register_method")


PRETRAINED_VALUE = "pretrained"  # stages.core.registry.PRETRAINED_VALUE (this module imports nothing)


def applies(dataset_kind: str, method_kind: str, root: Path = ROOT) -> bool:
    """Whether method `method_kind` applies to a dataset of kind `dataset_kind`: not when the
    dataset registers `features="discrete"` and the method `not_on_discrete=...`
    (stages.core.registry.not_applicable, read here from the registrations' source)."""
    features = registered(root / "stages" / "datasets" / f"{dataset_kind}.py", "register_dataset").get("features", "continuous")
    return not (features == "discrete" and method_registration(method_kind, root).get("not_on_discrete"))


def needs_pretrained(kind: str, cfg: Mapping[str, Any], root: Path = ROOT) -> bool:
    """Whether method `kind` with config `cfg` reads data/pretrained (its registration's
    `pretrained`: "never", "always", or a config key, e.g. "init", whose value "pretrained"
    means it does)."""
    rule = method_registration(kind, root).get("pretrained", "never")
    if rule in ("never", "always"):
        return rule == "always"
    return cfg.get(rule) == PRETRAINED_VALUE


def upstream(kind: str, cfg: Mapping[str, Any], root: Path = ROOT) -> tuple[str, str] | None:
    """(config key, method) when method `kind` with config `cfg` reads another method's trained
    model (its registration's `upstream`: a config key whose value, unless "pretrained", names
    that method), else None."""
    key = method_registration(kind, root).get("upstream")
    value = cfg.get(key) if key else None
    return None if value is None or value == PRETRAINED_VALUE else (key, str(value))


def config_error(message: str) -> ValueError:
    """stages.core.schema.ConfigError(message) — a ValueError — where the project is importable;
    a plain ValueError in a process that loaded this file alone (DVC's Hydra composition turns
    either into a composition error with the message)."""
    try:
        from stages.core.schema import ConfigError
    except ImportError:
        return ValueError(message)
    return ConfigError(message)


def model_modules(kind: str, root: Path = ROOT) -> list[str]:
    """The modules of the model kinds method `kind` may save (its registration's `model`, one kind or
    several), which is what evaluate and distill import to load it."""
    model = method_registration(kind, root).get("model", "mlp")
    return [f"stages.models.{m}" for m in ([model] if isinstance(model, str) else model)]


RAW = "data/raw"  # stages.datasets.packages.RAW (this module imports nothing)


def raw_input(cfg: Mapping[str, Any], module: str, root: Path = ROOT) -> str:
    """What prepare reads from outside the code, as one DVC dep: data/raw/<source> for a kind
    fetched from a registry (stage fetch@<source> writes it), the raw folder (`root`) of a
    downloaded benchmark, else (a generated dataset) its module's file again, a dep it has anyway."""
    source = cfg.get("source")
    if isinstance(source, Mapping) and "name" in source:
        return f"{RAW}/{source['name']}"
    if cfg.get("root"):
        return str(cfg["root"])
    f = module_file(module, root)
    return f.relative_to(root).as_posix() if f is not None else f"{RAW}"


def plan(
    run: Mapping[str, Any], datasets: Mapping[str, Any], methods: Mapping[str, Any], phase: Mapping[str, Any],
    root: Path = ROOT,
) -> dict[str, Any]:
    """params.yaml's `dag` section: per stage, per item (named as DVC names it), what dvc.yaml
    interpolates — the item's fields and `code`, its kind-specific code slots. A method that does
    not apply to a dataset (`applies`) gets no train, distill or evaluate item on it."""

    def dkind(name: str) -> str:
        return str(datasets[name]["kind"])

    def mkind(name: str) -> str:
        return str(methods[name]["kind"])

    @functools.cache
    def code(stage: str, modules: tuple[str, ...]) -> list[str]:  # items share kinds: once per kind
        return kind_code(stage, modules, root)

    from omegaconf import OmegaConf

    from stages.core.config import instances
    from stages.core.schema import LOCAL_FILES

    # The prepared datasets and the seeds run on each (run.redraw_data: an instance per seed of
    # each generated dataset, seed k on instance k only): stages.core.config.instances, the one
    # enumeration the stages use too. `dataset` is the section an instance is drawn from.
    data = instances(OmegaConf.create({"run": dict(run), "dataset": dict(datasets)}))
    dmod = {d: f"stages.datasets.{dkind(i.dataset)}" for d, i in data.items()}
    out: dict[str, Any] = {"fetch": {}, "prepare": {}, "train": {}, "distill": {}, "evaluate": {}}
    for d, i in data.items():
        # validate and pretrain iterate these items too (dvc.yaml): every dataset the run prepares
        out["prepare"][d] = {"dataset": i.dataset, "code": code("prepare", (dmod[d],)), "raw": raw_input(datasets[i.dataset], dmod[d], root)}
        source = datasets[i.dataset].get("source")
        if isinstance(source, Mapping) and "name" in source:  # its fetch stage, once per source
            out["fetch"].setdefault(str(source["name"]), {"dataset": i.dataset})
    ups = {m: upstream(mkind(m), methods[m], root) for m in run["methods"]}
    for m, up in ups.items():
        if up is not None and (up[1] not in run["methods"] or up[1] == m):
            raise config_error(
                f"method.{m}.{up[0]}: '{up[1]}' names the method whose trained model method '{m}' reads, "
                f"so it must be another method of run.methods {list(run['methods'])}; add it there, "
                f"or set method.{m}.{up[0]}={PRETRAINED_VALUE}"
            )
    def fits(d: str, m: str) -> bool:  # a student applies where its teacher does
        teacher = m[: -len(STUDENT_SUFFIX)] if m.endswith(STUDENT_SUFFIX) else m
        return applies(dkind(data[d].dataset), mkind(teacher), root)

    for d, i in data.items():
        for m in run["methods"]:
            if not fits(d, m):
                continue
            for s in i.seeds:
                pretrained = needs_pretrained(mkind(m), methods[m], root)
                up = ups[m]
                out["train"][f"{d}-{m}-{s}"] = {
                    "dataset": d, "method": m, "seed": s,
                    # its method's module; the upstream method's too, whose schema validates the settings
                    # that method's model must have been trained under (provenance's config check)
                    "code": code("train", tuple(dict.fromkeys([f"stages.models.{mkind(m)}", *([f"stages.models.{mkind(up[1])}"] if up else [])]))),
                    # with no pretrained encoder to read, the slot repeats the prepared file
                    "pretrained": f"data/pretrained/{d}" if pretrained else f"data/prepared/{d}.parquet",
                    # the trained model of the method it reads (same dataset and seed); else again the prepared file
                    "upstream": f"data/models/{d}/{up[1]}/seed={s}" if up else f"data/prepared/{d}.parquet",
                    # the local files a network starts from (`weights`, `vocab`), else the prepared file again
                    **{k: str(methods[m].get(k) or f"data/prepared/{d}.parquet") for k in LOCAL_FILES},
                }
        for t in run["teachers"]:
            if not fits(d, t):
                continue
            for s in i.seeds:
                out["distill"][f"{d}-{t}-{s}"] = {
                    "dataset": d, "teacher": t, "seed": s,
                    "code": code("distill", (*model_modules(mkind(t), root), f"stages.models.{mkind(t)}")),
                }
        for m in run["models"]:
            if not fits(d, m):
                continue
            student = m.endswith(STUDENT_SUFFIX)
            # the model kind's module, and the method's (its schema validates the settings the model
            # must have been trained under: provenance's config check)
            modules = [f"stages.models.{STUDENT_MODEL}"] if student else [*model_modules(mkind(m), root), f"stages.models.{mkind(m)}"]
            for s in i.seeds:
                out["evaluate"][f"{d}-{m}-{s}"] = {
                    "dataset": d, "model": m, "seed": s,
                    "code": code("evaluate", (*modules, dmod[d])),
                }
    # the phase diagram's generated dataset and its generative classifier's module
    kinds = [f"stages.datasets.{phase['base']['kind']}", f"stages.models.{phase['generative']['kind']}"]
    out["phase"] = {"code": code("phase", tuple(kinds))}
    return out


# ---- dvc.yaml: the common code lists ---------------------------------------------------------


def rewrite_dvc_yaml(path: Path = ROOT / "dvc.yaml", root: Path = ROOT) -> bool:
    """Set each stage's code deps in dvc.yaml (its leading `- stages/...` entries) to its
    entrypoint's code (`entrypoint_code`) and its `${....code[i]}` slots to SLOTS[stage], keeping every other line;
    True if the file changed."""
    lines = path.read_text().splitlines(keepends=True)
    out: list[str] = []
    stage = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^  (\w+):\s*$", line)
        if m:
            stage = m.group(1)
        if stage in ENTRYPOINTS and line.strip() == "deps:":
            out.append(line)
            i += 1
            indent = None
            while i < len(lines) and re.match(r"^\s+- stages/", lines[i]):
                indent = lines[i][: lines[i].index("-")]
                i += 1
            if indent is None:
                raise ValueError(f"{path}: stage {stage}'s deps do not start with its code (- stages/...)")
            out += [f"{indent}- {f}\n" for f in entrypoint_code(stage, root)]
            ref = None  # then the item's kind slots, SLOTS of them
            while i < len(lines) and (m := re.match(r"^\s+- \$\{(.+)\.code\[\d+\]\}\s*$", lines[i])):
                ref = m.group(1)
                i += 1
            if ref is not None:
                out += [f"{indent}- ${{{ref}.code[{k}]}}\n" for k in range(SLOTS[stage])]
            continue
        out.append(line)
        i += 1
    new = "".join(out)
    if new != path.read_text():
        path.write_text(new)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    from stages.core.console import ArgumentParser  # a usage error is one line

    ArgumentParser(name="dag", prog="python -m stages.dag", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)  # no arguments; --help
    changed = rewrite_dvc_yaml()
    print(f"dag: dvc.yaml {'updated' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
