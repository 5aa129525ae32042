"""The folder tree shows the layers (README, "Layout"): stages/ holds the stage entrypoints, the
library lives in named sub-packages, imports run one way, and no module grows past a size a
reader can hold.

Imports are read from the source (`ast`), at module level and inside functions alike (a
function-level import still ties two modules together), except under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "pipeline", "hydra_plugins")
ENTRYPOINTS = {"fetch", "prepare", "validate", "pretrain", "train", "distill", "evaluate", "report", "phase"}
COMMANDS = {"dag"}  # `python -m stages.dag` writes dvc.yaml's code deps (make params)
MAX_LINES = 800

# Bottom to top: a module may import its own layer and the layers below it, never above.
LAYERS: dict[str, int] = {
    "stages": 0,  # the package's own __init__ (checks the environment, imports nothing)
    "stages.core": 0,  # io, schema, settings, registry, config, cli, runtime, artifacts, provenance, stream, checkpoint
    "stages.evaluation": 1,  # metrics, regime, shift, the report's numbers
    "stages.datasets": 2,
    "stages.models": 2,
    "stages.validation": 3,  # the Great Expectations suite's helpers, Data Docs
    "stages.reporting": 3,  # the report's pages and figures
    **{f"stages.{name}": 4 for name in ENTRYPOINTS | COMMANDS},
    "hydra_plugins": 4,  # DVC's Hydra composition: validates through stages.core.config
    "pipeline": 5,  # orders and launches the stages; reads their files at most
}


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def imported(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts a.b.c when that is a module)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            names |= subs or {node.module}
    return {n for n in names if n in known}


def graph(root: Path = REPO) -> nx.DiGraph:
    modules = project_modules(root)
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, target) for target in imported(path, set(modules)) if target != name)
    return g


def layer(module: str) -> tuple[str, int]:
    """The layer `module` belongs to: its longest prefix in LAYERS."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in LAYERS:
            return prefix, LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and to the README's Layout)")


def test_stages_folder_holds_only_the_entrypoints():
    top = {p.stem for p in (REPO / "stages").glob("*.py")} - {"__init__"}
    assert top == ENTRYPOINTS | COMMANDS, f"library modules belong in a sub-package: {sorted(top - ENTRYPOINTS - COMMANDS)}"


def test_no_import_circles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph()) if len(c) > 1]
    assert not cycles, f"import circles: {cycles}"


def test_imports_run_down_the_layers():
    """Down only; and within layers 2-4 no package imports its neighbour (datasets and models meet
    through the registry, an entrypoint never imports another)."""
    upward = [
        f"{a} (layer {layer(a)[1]}) imports {b} (layer {layer(b)[1]})"
        for a, b in graph().edges
        if layer(b)[1] > layer(a)[1] or (layer(b)[1] == layer(a)[1] >= 2 and layer(a)[0] != layer(b)[0])
    ]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_module_over_the_size_limit():
    long = {name: n for name, p in project_modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these (a second job hides inside): {long}"


def test_a_function_level_circle_is_found(tmp_path):
    """The check sees imports inside functions, not only at the top (the circles it was written
    for, cli <-> config <-> runtime, went through function-level imports)."""
    (tmp_path / "stages" / "core").mkdir(parents=True)
    (tmp_path / "stages" / "__init__.py").write_text("")
    (tmp_path / "stages" / "core" / "__init__.py").write_text("")
    (tmp_path / "stages" / "core" / "a.py").write_text("from stages.core import b\n")
    (tmp_path / "stages" / "core" / "b.py").write_text("def f():\n    from stages.core.a import x\n")
    (tmp_path / "stages" / "core" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stages.core import a\n")
    g = graph(tmp_path)
    assert [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1] == [["stages.core.a", "stages.core.b"]]
    assert not g.has_edge("stages.core.c", "stages.core.a")  # typing-only imports do not count
