"""The one registry: every kind lives in one module, every value in conf/, imports run one way."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from stages.core import registry
from stages.core.config import CONF, STAGE_SECTIONS, ConfigError, defaults, load_params
from stages.core.settings import RunConfig

ROOT = Path(__file__).resolve().parent.parent
# The stage entrypoints: run by DVC's command lines, imported by nobody in stages/ or pipeline/.
ENTRYPOINTS = {f"stages.{n}" for n in ("fetch", "prepare", "validate", "pretrain", "train", "distill", "evaluate", "report", "phase")}
# A word that names a kind and, independently, something else. The shift curve's
# "reweight" route (reweighting the test examples, stages/evaluation/shift.py) is written into the
# plot data, so renaming it would change every evaluate output.
HOMONYMS = {"reweight": {"stages/evaluation/shift.py"}}


def grep_files(word: str) -> set[str]:
    out = subprocess.run(["git", "grep", "--untracked", "-lw", word, "--", "stages", "pipeline"], cwd=ROOT, capture_output=True, text=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("kind", sorted(registry.methods()))
def test_a_method_kind_is_named_in_its_own_module_only(kind):
    """Its declaration module, and the implementation module it names by reference if any."""
    spec = registry.method(kind)
    own = spec.module.replace(".", "/") + ".py"
    assert own == f"stages/models/{kind}.py"
    implementation = {m.replace(".", "/") + ".py" for m in spec.implementation}
    assert grep_files(kind) - HOMONYMS.get(kind, set()) - implementation == {own}


@pytest.mark.parametrize("kind", sorted(registry.datasets()))
def test_a_dataset_kind_is_named_in_its_own_module_only(kind):
    spec = registry.dataset(kind)
    own = spec.module.replace(".", "/") + ".py"
    assert own == f"stages/datasets/{kind}.py"
    assert grep_files(kind) == {own}


def test_lookup_imports_only_the_kind_asked_for():
    code = (
        "import sys; from stages.core import registry; registry.method('erm'); registry.dataset('colored_digits');"
        "print(sorted(m for m in sys.modules if m.startswith(('stages.models.', 'stages.datasets.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out.strip()))
    assert "stages.models.erm" in loaded and "stages.datasets.colored_digits" in loaded
    others = {f"stages.models.{k}" for k in registry.methods() if k != "erm"} | {
        f"stages.datasets.{k}" for k in registry.datasets() if k != "colored_digits"
    }
    assert not loaded & others, loaded & others


def test_unknown_kinds_name_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown method kind 'nope' \(known: \[.*'erm'.*\]\)"):
        registry.method("nope")
    with pytest.raises(ConfigError, match=r"unknown dataset kind 'nope' \(known: \[.*'colored_digits'.*\]\)"):
        registry.dataset("nope")


def test_a_kind_registered_twice_by_two_modules_is_an_error():
    spec = registry.method("erm")
    with pytest.raises(TypeError, match="method kind 'erm' registered twice"):
        registry.register_method("erm", spec.schema, test_a_kind_registered_twice_by_two_modules_is_an_error)
    assert registry.method("erm") is spec


def _schemas() -> list[tuple[str, str, type]]:
    """(group, file name, schema) for every YAML file of conf/ that a schema validates."""
    out = []
    for path in sorted((CONF / "method").glob("*.yaml")):
        out.append(("method", path.stem, registry.method(OmegaConf.load(path).kind).schema))
    for path in sorted((CONF / "dataset").glob("*.yaml")):
        out.append(("dataset", path.stem, registry.dataset(OmegaConf.load(path).kind).schema))
    for group, schema in STAGE_SECTIONS.items():
        for path in sorted((CONF / group).glob("*.yaml")):
            out.append((group, path.stem, schema))
    return out


@pytest.mark.parametrize(("group", "name", "schema"), _schemas(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_value_is_written_once_in_conf(group, name, schema):
    """A schema declares no value (so none can drift from conf/); the YAML gives every key once."""
    for f in dataclasses.fields(schema):
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, (schema, f.name)
    node = OmegaConf.load(CONF / group / f"{name}.yaml")
    keys = {k for k in node if k != "defaults"}
    assert keys == {f.name for f in dataclasses.fields(schema)}
    defaults(group, name)  # and the values pass the schema's checks


def test_the_run_section_has_a_schema_and_no_default():
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(RunConfig))


def test_train_help_shows_exactly_what_a_run_uses():
    out = subprocess.run([sys.executable, "-m", "stages.train", "--help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    params = load_params()
    shown = re.findall(r"^  (method\.\w+\.\w+): \S+ = (.+?)  — ", out, flags=re.M)
    assert len(shown) > 50
    for key, value in shown:
        assert ast.literal_eval(value) == OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(params, key)}))["v"], key
    for name in params.method:
        assert f"method.{name}.kind" in dict(shown)


def _project_modules() -> dict[str, Path]:
    mods = {}
    for top in ("stages", "pipeline"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path, mods: dict[str, Path], name: str) -> set[str]:
    """Project modules `path` imports anywhere (top level, in functions, under TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import"
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in mods}


def test_no_library_module_imports_a_stage_entrypoint():
    mods = _project_modules()
    bad = {name: _imports(path, mods, name) & ENTRYPOINTS for name, path in mods.items() if name not in ENTRYPOINTS}
    assert not {k: v for k, v in bad.items() if v}


def test_no_import_circles():
    """Module-level imports (not those inside functions or under TYPE_CHECKING) form no cycle."""
    mods = _project_modules()

    def top_level(path: Path, name: str) -> set[str]:
        found = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        return {m for m in found if m in mods and m != name}

    graph = {name: top_level(path, name) for name, path in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_student_suffix_is_one_value_everywhere():
    """Written once in stages/core/settings.py; the two modules that may import nothing of the
    project (DVC's Hydra plugin, stages/dag.py) and dvc.yaml's distill outs spell it too."""
    import hydra_plugins.shiftlab as plugin
    from stages import dag
    from stages.core import settings
    assert plugin.STUDENT_SUFFIX == dag.STUDENT_SUFFIX == settings.STUDENT_SUFFIX
    assert f"${{item.teacher}}{settings.STUDENT_SUFFIX}/seed=" in (ROOT / "dvc.yaml").read_text()


def test_validating_every_section_imports_no_implementation():
    """Composing params.yaml (every `dvc exp run`) checks every method and dataset section: the
    registrations must be cheap to import — no torch, no scikit-learn, no implementation module
    (docs/extending.md, "Keep the registration light")."""
    code = (
        "import sys; from stages.core import config, registry; registry.methods(); registry.datasets();"
        "config.check_composed(config.load_params());"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sklearn', 'scipy', 'timm', 'transformers', 'diffusers')"
        " or m.endswith('_model') or m in ('stages.models.training', 'stages.models.nets')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(out.strip()) == []


def test_applicability_is_one_rule_read_the_same_by_the_dag_and_the_stages():
    # the DAG reads the registrations' source (stages/dag.py), the stages the registry: they agree
    # on every pair of kinds, and only diffusion is withheld, only from the discrete-feature tables
    from stages import dag

    withheld = set()
    for d in registry.datasets():
        for m in registry.methods():
            why = registry.not_applicable(d, m)
            assert dag.applies(d, m) == (why is None), (d, m)
            if why is not None:
                withheld.add((d, m))
    discrete = {d for d, spec in registry.datasets().items() if spec.features == "discrete"}
    assert discrete == {"adult", "celeba_attributes"}
    assert withheld == {(d, "diffusion") for d in discrete}


def test_a_dataset_with_unknown_features_is_refused_at_registration():
    with pytest.raises(TypeError, match="features must be one of"):
        registry.register_dataset("odd_features", object, generate=lambda cfg: None, features="ordinal")
