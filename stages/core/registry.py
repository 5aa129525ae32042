"""The one registry of methods, datasets and model architectures, keyed by `kind`.

Like timm's `@register_model`: a method is one module `stages/models/<kind>.py`, a dataset
one module `stages/datasets/<kind>.py`, and each declares itself once, at import, with
`register_method` / `register_dataset`: its config schema, the function that does the work
and its capabilities. Every list of kinds (schemas, dispatch, `--help`, the report's model
types, text checks, `run.methods: all`) is read from here. A model architecture (what a
`model.safetensors` holds) registers its class with `register_model`.

Looking up one kind imports only that kind's module (so a stage imports, and DVC tracks,
only the code it runs); listing every kind imports every module of the package. Adding a
method or a dataset edits no list: see docs/extending.md.

A registration is cheap to import: validating a config (what `dvc exp run` does for every
method and dataset while it composes params.yaml) needs the schemas and capabilities, never
torch. So a method whose implementation is heavy names its functions by reference,
`"stages.models.<impl>:<function>"`, resolved on first use; stages/dag.py reads the same
strings to make the implementation a DVC dependency of the method's stages.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.schema import ConfigError

METHOD_PACKAGE = "stages.models"
DATASET_PACKAGE = "stages.datasets"


# `pretrained=`: "never", "always", or the name of a config key (e.g. "init") whose value
# PRETRAINED_VALUE means the method reads data/pretrained/<dataset>/.
PRETRAINED = ("never", "always")
PRETRAINED_VALUE = "pretrained"


Ref = Callable[..., Any] | str
"""A function, or where it lives as "package.module:function" (imported on first use)."""


def resolve(ref: Ref) -> Callable[..., Any]:
    """The function `ref` names (imports its module the first time)."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def ref_module(ref: Ref | None) -> str | None:
    """The module a reference names without importing it (None for a plain function or None)."""
    return ref.partition(":")[0] if isinstance(ref, str) else None


@dataclass(frozen=True)
class MethodSpec:
    """A training method: `train(job) -> Trained` (see stages/models/training.py)."""

    kind: str
    schema: type
    train_ref: Ref
    generative: bool  # classifies by argmax_y log p(x | y) + log p(y)
    reads_text: bool  # needs the prepared `text` column
    pretrained: str  # reads data/pretrained/<dataset>/: one of PRETRAINED, or a config key (see there)
    model: str | tuple[str, ...]  # the model kind(s) (`register_model`) its train may save, by its config
    # closed-form methods: fit(x, y, n_classes, cfg) -> model on in-memory arrays (the phase
    # diagram fits them cell by cell); None for the others
    fit_ref: Ref | None
    # a config key whose value, unless PRETRAINED_VALUE, names another method of run.methods
    # whose trained model (data/models/<dataset>/<that method>/seed=<seed>/) it reads; or None
    upstream: str | None
    module: str
    streams: bool = False  # trains from a `stream.PreparedFile` when runtime.stream is on (else reads the file whole)
    # why the method does not apply to a dataset whose features are discrete (FEATURES), one line;
    # None: it applies to every dataset
    not_on_discrete: str | None = None

    @property
    def summary(self) -> str:
        return (self.schema.__doc__ or self.kind).strip().splitlines()[0]

    @property
    def train(self) -> Callable[..., Any]:
        return resolve(self.train_ref)

    @property
    def fit(self) -> Callable[..., Any] | None:
        return None if self.fit_ref is None else resolve(self.fit_ref)

    @property
    def implementation(self) -> list[str]:
        """The modules its references name (imported only when used)."""
        return [m for m in (ref_module(self.train_ref), ref_module(self.fit_ref)) if m]

    def needs_pretrained(self, cfg: Any) -> bool:
        """Whether `cfg` reads the pretrain stage's outputs."""
        if self.pretrained in PRETRAINED:
            return self.pretrained == "always"
        return getattr(cfg, self.pretrained, None) == PRETRAINED_VALUE

    @property
    def models(self) -> tuple[str, ...]:
        """Every model kind this method's train may save (`model=`, one kind or several)."""
        return (self.model,) if isinstance(self.model, str) else tuple(self.model)

    def upstream_method(self, cfg: Any) -> str | None:
        """The method whose trained model `cfg` reads (the value of its `upstream` key), or None."""
        value = getattr(cfg, self.upstream, None) if self.upstream is not None else None
        return None if value is None or value == PRETRAINED_VALUE else str(value)


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset: built-ins `generate(cfg) -> (columns, meta)` in memory; real benchmarks
    `load(name, cfg, out_path) -> summary` from data/raw/, streaming their own file."""

    kind: str
    schema: type
    generate: Callable[[Any], Any] | None
    load: Callable[..., str] | None
    text: bool  # the prepared file has a `text` column
    # (cfg, n, rho, rng) -> (y, a, x): n examples drawn afresh at label-attribute agreement
    # rho, for evaluate's exact shift curve (stages/evaluation/shift.py); None = reweighting only.
    regenerate: Callable[..., Any] | None
    module: str
    features: str = "continuous"  # one of FEATURES

    @property
    def summary(self) -> str:
        return (self.schema.__doc__ or self.kind).strip().splitlines()[0]


# What a dataset's features are: "continuous" (real numbers, pixels), or "discrete" (some are
# binary attributes or one-hot categories: a table such as CelebA's attributes or UCI Adult).
FEATURES = ("continuous", "discrete")


def not_applicable(dataset_kind: str, method_kind: str) -> str | None:
    """Why method `method_kind` does not apply to a dataset of kind `dataset_kind` (one line), or
    None when it does. stages/dag.py reads the same registrations from the source (no train or
    evaluate stage is made for such a pair) and the report shows the pair as n/a with this line."""
    return not_on_features(dataset(dataset_kind).features, method_kind)


def not_on_features(features: str, method_kind: str) -> str | None:
    """`not_applicable` from a dataset's `features` (what a prepared file's metadata records, so a
    stage that reads the file needs no dataset module)."""
    m = method(method_kind)
    return m.not_on_discrete if features == "discrete" else None


_METHODS: dict[str, MethodSpec] = {}
_DATASETS: dict[str, DatasetSpec] = {}
_MODELS: dict[str, type] = {}
# Which call declares an entry of each table (a method or dataset lookup that misses imports only
# the modules that make it; a model lookup imports every module).
DECLARATION = {id(_METHODS): "register_method", id(_DATASETS): "register_dataset"}


def register_method(
    kind: str,
    schema: type,
    train: Ref,
    *,
    generative: bool = False,
    reads_text: bool = False,
    pretrained: str = "never",
    model: str | tuple[str, ...] = "mlp",
    fit: Ref | None = None,
    upstream: str | None = None,
    streams: bool = False,
    not_on_discrete: str | None = None,
) -> MethodSpec:
    """Declare a method kind (call once, at the bottom of its module). Give the capabilities
    as literals: stages/dag.py reads them from the source to write the DVC dependencies.
    `train` (and `fit`, closed-form methods' in-memory fit) may be "module:function" references
    to a heavier implementation module, so that importing the registration stays cheap.

    `pretrained`: "never", "always", or the name of a config key (e.g. "init") whose value
    "pretrained" means the method reads data/pretrained/<dataset>/. `upstream`: the name of a
    config key whose value, unless "pretrained", names another method (of run.methods) whose
    trained model, same dataset and seed, the method reads. `streams`: its train reads the prepared
    file row group by row group when runtime.stream is on (stages/core/stream.py); the others read it
    whole either way. `not_on_discrete`: one line saying why the method does not apply to a dataset
    registered with `features="discrete"` (`not_applicable`); None, it applies to every dataset."""
    keys = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set()
    if pretrained not in PRETRAINED and pretrained not in keys:
        raise TypeError(f"method kind '{kind}': pretrained must be one of {PRETRAINED} or a key of its schema {sorted(keys)}, got {pretrained!r}")
    if upstream is not None and upstream not in keys:
        raise TypeError(f"method kind '{kind}': upstream must be a key of its schema {sorted(keys)}, got {upstream!r}")
    module = sys._getframe(1).f_globals.get("__name__", schema.__module__)  # the declaring module
    spec = MethodSpec(kind, schema, train, generative, reads_text, pretrained, model, fit, upstream, module, streams, not_on_discrete)
    return _add(_METHODS, kind, spec, "method")


def register_dataset(
    kind: str,
    schema: type,
    *,
    generate: Callable[[Any], Any] | None = None,
    load: Callable[..., str] | None = None,
    text: bool = False,
    regenerate: Callable[..., Any] | None = None,
    features: str = "continuous",
) -> DatasetSpec:
    """Declare a dataset kind: exactly one of `generate` (built-in) or `load` (from data/raw/).
    `features`: one of FEATURES (give it as a literal: stages/dag.py reads it from the source)."""
    if (generate is None) == (load is None):
        raise TypeError(f"dataset kind '{kind}': give exactly one of generate= or load=")
    if features not in FEATURES:
        raise TypeError(f"dataset kind '{kind}': features must be one of {FEATURES}, got {features!r}")
    fn = generate or load
    spec = DatasetSpec(kind, schema, generate, load, text, regenerate, fn.__module__, features)  # type: ignore[union-attr]
    return _add(_DATASETS, kind, spec, "dataset")


def register_model(kind: str) -> Callable[[type], type]:
    """Class decorator: `cls.from_arch(meta)` rebuilds a saved model whose metadata says `kind`."""

    def deco(cls: type) -> type:
        _add(_MODELS, kind, cls, "model")
        cls.kind = kind  # type: ignore[attr-defined]
        return cls

    return deco


def _add(table: dict[str, Any], kind: str, value: Any, what: str) -> Any:
    old = table.get(kind)
    if old is not None and old is not value and _origin(old) != _origin(value):
        raise TypeError(f"{what} kind '{kind}' registered twice ({_origin(old)} and {_origin(value)})")
    table[kind] = value
    return value


def _origin(value: Any) -> str:
    return getattr(value, "module", None) or getattr(value, "__module__", "?")


def _lookup(table: dict[str, Any], package: str, kind: str) -> Any | None:
    """`table[kind]`, importing `<package>.<kind>` (the convention) and then, failing that,
    every module of the package."""
    if kind not in table and isinstance(kind, str) and kind.isidentifier():
        name = f"{package}.{kind}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    if kind not in table:
        _import_all(package, DECLARATION.get(id(table)))
    return table.get(kind)


def _import_all(package: str, declaring: str | None = None) -> None:
    """Import every module of `package`; with `declaring` ("register_method", ...) only those
    whose source calls it at top level (the declarations: cheap, no implementation)."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        name = f"{package}.{info.name}"
        if declaring is not None:
            spec = importlib.util.find_spec(name)
            origin = getattr(spec, "origin", None)
            if origin is None or not re.search(rf"^{declaring}\(", Path(origin).read_text(encoding="utf-8"), re.M):
                continue
        importlib.import_module(name)


def method(kind: str) -> MethodSpec:
    """The method registered as `kind` (ConfigError naming the known kinds otherwise)."""
    spec = _lookup(_METHODS, METHOD_PACKAGE, kind)
    if spec is None:
        raise ConfigError(f"unknown method kind '{kind}' (known: {sorted(methods())})")
    return spec


def find_method(kind: str) -> MethodSpec | None:
    """The method registered as `kind`, or None."""
    return _lookup(_METHODS, METHOD_PACKAGE, kind)


def find_dataset(kind: str) -> DatasetSpec | None:
    """The dataset registered as `kind`, or None."""
    return _lookup(_DATASETS, DATASET_PACKAGE, kind)


def dataset(kind: str) -> DatasetSpec:
    """The dataset registered as `kind` (ConfigError naming the known kinds otherwise)."""
    spec = _lookup(_DATASETS, DATASET_PACKAGE, kind)
    if spec is None:
        raise ConfigError(f"unknown dataset kind '{kind}' (known: {sorted(datasets())})")
    return spec


def model_class(kind: str) -> type | None:
    """The class registered for model architecture `kind`, or None: from `stages/models/<kind>.py`,
    else from the implementation of a method that saves that kind, else any module."""
    if kind not in _MODELS and isinstance(kind, str) and kind.isidentifier():
        name = f"{METHOD_PACKAGE}.{kind}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
        for spec in list(_METHODS.values()):
            if kind not in _MODELS and kind in spec.models:
                for module in spec.implementation:
                    importlib.import_module(module)
    return _lookup(_MODELS, METHOD_PACKAGE, kind)


def methods() -> dict[str, MethodSpec]:
    """Every method kind, sorted by name (imports every declaration in stages/models, no implementation)."""
    _import_all(METHOD_PACKAGE, "register_method")
    return dict(sorted(_METHODS.items()))


def datasets() -> dict[str, DatasetSpec]:
    """Every dataset kind, sorted by name (imports every declaration in stages/datasets)."""
    _import_all(DATASET_PACKAGE, "register_dataset")
    return dict(sorted(_DATASETS.items()))


def model_kinds() -> list[str]:
    """Every model architecture kind."""
    _import_all(METHOD_PACKAGE)
    return sorted(_MODELS)
