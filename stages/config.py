"""The one config loader: a stage's own section of params.yaml, validated against a typed schema.

`conf/` (Hydra groups) is composed by DVC into `params.yaml`; stages never read `conf/`.
Each stage asks for its section (`dataset.gaussian_shortcut`, `method.erm`, ...), which is
merged into the section's dataclass: an unknown key, a wrong type or an out-of-range value
raises `ConfigError` naming the full key before any work starts.

    python -m stages.config check      # validate the whole params.yaml
    python -m stages.config compose    # regenerate params.yaml from conf/ (as `dvc exp run` does)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")
PARAMS = Path("params.yaml")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def _help(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": text})
    return field(default=default, metadata={"help": text}, **kw)


class _Checks:
    """Collects range checks; `key` is relative to the section."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def require(self, ok: bool, key: str, msg: str) -> None:
        if not ok:
            self.errors.append((key, msg))

    def prob(self, value: float, key: str) -> None:
        self.require(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value}")

    def positive(self, value: float, key: str) -> None:
        self.require(value > 0, key, f"must be > 0, got {value}")

    def non_negative(self, value: float, key: str) -> None:
        self.require(value >= 0, key, f"must be >= 0, got {value}")

    def choice(self, value: str, key: str, options: Sequence[str]) -> None:
        self.require(value in options, key, f"must be one of {list(options)}, got '{value}'")


# ---- schemas ------------------------------------------------------------------------------


@dataclass
class GaussianShortcutConfig:
    """Two classes y∈{±1}: core feature N(y, σ²), spurious feature ±B agreeing with y w.p. ρ."""

    kind: str = _help("dataset generator", "gaussian_shortcut")
    seed: int = _help("generator seed", 0)
    sigma: float = _help("std of the core feature around ±1", 1.0)
    spurious_scale: float = _help("B: the spurious feature is ±B (plus noise)", 1.0)
    spurious_noise: float = _help("std of the noise added to the spurious feature", 0.2)
    rho_train: float = _help("P(spurious sign agrees with y) in train, val and test_id", 0.95)
    rho_ood: float = _help("P(spurious sign agrees with y) in test_ood", 0.05)
    d_noise: int = _help("number of pure-noise N(0,1) dimensions", 8)
    n_train: int = _help("train examples", 4000)
    n_val: int = _help("validation examples", 1000)
    n_test_id: int = _help("in-distribution test examples", 2000)
    n_test_ood: int = _help("shifted test examples", 2000)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["gaussian_shortcut"])
        c.positive(self.sigma, "sigma")
        c.non_negative(self.spurious_scale, "spurious_scale")
        c.non_negative(self.spurious_noise, "spurious_noise")
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.non_negative(self.d_noise, "d_noise")
        for k in ("n_train", "n_val", "n_test_id", "n_test_ood"):
            c.require(getattr(self, k) >= 8, k, f"must be >= 8, got {getattr(self, k)}")


@dataclass
class ColoredDigitsConfig:
    """scikit-learn's 8×8 digits, y = digit < 5, with a spurious attribute agreeing with y w.p. ρ."""

    kind: str = _help("dataset generator", "colored_digits")
    seed: int = _help("split/attribute seed", 0)
    rho_train: float = _help("P(attribute == label) in train, val and test_id", 0.95)
    rho_ood: float = _help("P(attribute == label) in test_ood (0.05 = reversed)", 0.05)
    spurious: str = _help("form of the spurious cue: color | marker | background", "color")
    spurious_noise: float = _help("std of the noise on the spurious cue (0 = exact)", 0.1)
    val_frac: float = _help("fraction of images in val", 0.15)
    test_id_frac: float = _help("fraction of images in test_id", 0.15)
    test_ood_frac: float = _help("fraction of images in test_ood", 0.2)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["colored_digits"])
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.choice(self.spurious, "spurious", ["color", "marker", "background"])
        c.non_negative(self.spurious_noise, "spurious_noise")
        for k in ("val_frac", "test_id_frac", "test_ood_frac"):
            c.require(0 < getattr(self, k) < 1, k, f"must be in (0, 1), got {getattr(self, k)}")
        total = self.val_frac + self.test_id_frac + self.test_ood_frac
        c.require(total < 0.9, "val_frac", f"val+test fractions must leave >= 10% for train, got {total}")


DATASET_SCHEMAS: dict[str, type] = {
    "gaussian_shortcut": GaussianShortcutConfig,
    "colored_digits": ColoredDigitsConfig,
}

SELECTIONS = ("val_avg", "val_worst_group", "oracle")


@dataclass
class ErmConfig:
    """Empirical risk minimisation with an MLP."""

    kind: str = _help("method family", "erm")
    init: str = _help("scratch | pretrained (encoder from the pretrain stage)", "scratch")
    hidden: list[int] = _help("hidden layer widths (ignored with init=pretrained)", [64])
    lr: float = _help("Adam learning rate", 1e-3)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    epochs: int = _help("training epochs", 30)
    batch_size: int = _help("minibatch size", 128)
    selection: str = _help("checkpoint selection: val_avg | val_worst_group | oracle", "val_avg")

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))
        c.choice(self.init, "init", ["scratch", "pretrained"])
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.positive(self.lr, "lr")
        c.non_negative(self.weight_decay, "weight_decay")
        c.require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        c.require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        c.choice(self.selection, "selection", SELECTIONS)


@dataclass
class GroupDROConfig(ErmConfig):
    """Group DRO (Sagawa et al. 2020): exponentiated-gradient weights on the worst groups."""

    kind: str = _help("method family", "groupdro")
    eta: float = _help("step size of the group-weight update", 0.1)

    def check(self, c: _Checks) -> None:
        super().check(c)
        c.positive(self.eta, "eta")


@dataclass
class LDAConfig:
    """Generative classifier: class-conditional Gaussians with a shared, shrunk covariance."""

    kind: str = _help("method family", "lda")
    shrinkage: float = _help("covariance shrinkage towards a scaled identity, in [0, 1]", 0.1)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", list(METHOD_SCHEMAS))
        c.prob(self.shrinkage, "shrinkage")


METHOD_SCHEMAS: dict[str, type] = {"erm": ErmConfig, "groupdro": GroupDROConfig, "lda": LDAConfig}


@dataclass
class PretrainConfig:
    """Denoising autoencoder fitted on train inputs only, without labels."""

    kind: str = _help("pretraining objective", "dae")
    seed: int = _help("seed", 0)
    hidden: list[int] = _help("encoder widths; the last is the embedding size", [64])
    noise_std: float = _help("std of the Gaussian corruption", 0.3)
    lr: float = _help("Adam learning rate", 1e-3)
    epochs: int = _help("epochs", 20)
    batch_size: int = _help("minibatch size", 128)

    def check(self, c: _Checks) -> None:
        c.choice(self.kind, "kind", ["dae"])
        c.require(len(self.hidden) >= 1 and all(h > 0 for h in self.hidden), "hidden", f"need >= 1 width > 0, got {self.hidden}")
        c.non_negative(self.noise_std, "noise_std")
        c.positive(self.lr, "lr")
        c.require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        c.require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")


@dataclass
class DistillConfig:
    """A student MLP trained on a teacher's temperature-softened predictions."""

    hidden: list[int] = _help("student hidden widths", [64])
    temperature: float = _help("softmax temperature applied to the teacher's logits", 2.0)
    alpha: float = _help("weight of the soft (teacher) loss; 1-alpha goes to the hard labels", 1.0)
    lr: float = _help("Adam learning rate", 1e-3)
    epochs: int = _help("epochs", 30)
    batch_size: int = _help("minibatch size", 128)
    selection: str = _help("checkpoint selection: val_avg | val_worst_group | oracle", "val_avg")

    def check(self, c: _Checks) -> None:
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.positive(self.temperature, "temperature")
        c.prob(self.alpha, "alpha")
        c.positive(self.lr, "lr")
        c.require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        c.require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        c.choice(self.selection, "selection", SELECTIONS)


@dataclass
class ValidateConfig:
    """Great Expectations suite thresholds."""

    min_group_count: int = _help("minimum examples of every group in val, test_id and test_ood", 3)
    rho_tolerance: float = _help("allowed |observed - configured| train agreement rate", 0.05)
    min_shift: float = _help("test_ood agreement must differ from train's by at least this", 0.2)

    def check(self, c: _Checks) -> None:
        c.require(self.min_group_count >= 1, "min_group_count", f"must be >= 1, got {self.min_group_count}")
        c.prob(self.rho_tolerance, "rho_tolerance")
        c.prob(self.min_shift, "min_shift")


@dataclass
class EvaluateConfig:
    """Evaluation settings."""

    ece_bins: int = _help("equal-width confidence bins for ECE and the reliability curve", 15)
    batch_size: int = _help("examples scored per forward pass", 2048)

    def check(self, c: _Checks) -> None:
        c.require(self.ece_bins >= 1, "ece_bins", f"must be >= 1, got {self.ece_bins}")
        c.require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")


@dataclass
class RunConfig:
    """What `dvc repro` runs: the matrix over datasets × methods × seeds."""

    datasets: list[str] = _help("datasets to prepare (names under `dataset`)", ["gaussian_shortcut", "colored_digits"])
    methods: list[str] = _help("methods to train (names under `method`)", ["erm", "lda", "groupdro"])
    teachers: list[str] = _help("methods distilled into a student named <teacher>_student", ["lda"])
    models: list[str] = _help("models to evaluate: methods and <teacher>_student names", ["erm", "lda", "groupdro", "lda_student"])
    seeds: list[int] = _help("training seeds", [0])

    def check(self, c: _Checks) -> None:
        for key in ("datasets", "methods", "models", "seeds"):
            c.require(len(getattr(self, key)) > 0, key, "must not be empty")
            values = getattr(self, key)
            c.require(len(set(values)) == len(values), key, f"has duplicates: {values}")
        for t in self.teachers:
            c.require(t in self.methods, "teachers", f"teacher '{t}' is not in run.methods {self.methods}")
        producible = set(self.methods) | {student_name(t) for t in self.teachers}
        for m in self.models:
            c.require(m in producible, "models", f"'{m}' is neither a trained method nor a student of run.teachers")
        for m in self.methods:
            c.require(m in self.models, "models", f"trained method '{m}' is not evaluated; add it to run.models")


def student_name(teacher: str) -> str:
    """The model name of the student distilled from `teacher`."""
    return f"{teacher}_student"


# ---- loading --------------------------------------------------------------------------------


def load_params(path: str | Path = PARAMS, overrides: Sequence[str] = ()) -> DictConfig:
    """Read params.yaml and apply `key=value` overrides (the hand-run path)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: not found (run `make params` to compose it from conf/)")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in many classes
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    for ov in overrides:
        if "=" not in ov or ov.startswith("="):
            raise ConfigError(f"override '{ov}': expected key=value")
        key, value = ov.split("=", 1)
        key = key.lstrip("+")
        if OmegaConf.select(cfg, key, default="__missing__") == "__missing__" and not ov.startswith("+"):
            raise ConfigError(f"override '{ov}': unknown key '{key}' (prefix with + to add a new key)")
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
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        sub = getattr(e, "full_key", "") or ""
        reason = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"params.yaml: {key}{'.' + sub if sub else ''}: {reason}") from None
    checks = _Checks()
    obj.check(checks)  # type: ignore[attr-defined]
    if checks.errors:
        lines = [f"params.yaml: {key}.{k}: {m}" for k, m in checks.errors]
        raise ConfigError("\n".join(lines))
    return obj


def dataset_config(params: DictConfig, name: str) -> Any:
    """The validated config of dataset `name` (schema chosen by its `kind`)."""
    kind = _kind(params, f"dataset.{name}", DATASET_SCHEMAS)
    return section(params, f"dataset.{name}", DATASET_SCHEMAS[kind])


def method_config(params: DictConfig, name: str) -> Any:
    """The validated config of method `name` (schema chosen by its `kind`)."""
    kind = _kind(params, f"method.{name}", METHOD_SCHEMAS)
    return section(params, f"method.{name}", METHOD_SCHEMAS[kind])


def _kind(params: DictConfig, key: str, schemas: dict[str, type]) -> str:
    node = OmegaConf.select(params, key)
    if node is None:
        parent = OmegaConf.select(params, key.rsplit(".", 1)[0])
        known = list(parent.keys()) if isinstance(parent, DictConfig) else []
        raise ConfigError(f"params.yaml: no section '{key}' (known: {known})")
    kind = node.get("kind") if isinstance(node, DictConfig) else None
    if kind not in schemas:
        raise ConfigError(f"params.yaml: {key}.kind: must be one of {list(schemas)}, got '{kind}'")
    return str(kind)


def check_all(params: DictConfig) -> RunConfig:
    """Validate every section `dvc repro` will read; raises on the first section with errors."""
    run = section(params, "run", RunConfig)
    for name in run.datasets:
        dataset_config(params, name)
    for name in run.methods:
        method_config(params, name)
    for key, schema in (("pretrain", PretrainConfig), ("distill", DistillConfig), ("validate", ValidateConfig), ("evaluate", EvaluateConfig)):
        section(params, key, schema)
    return run


def describe(schema: type, prefix: str) -> str:
    """Human-readable list of a schema's keys, types, defaults and meaning (for --help)."""
    lines = [f"{prefix}  ({schema.__doc__.strip() if schema.__doc__ else schema.__name__})"]
    for f in dataclasses.fields(schema):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        lines.append(f"  {prefix}.{f.name}: {type_name} = {default!r}  — {f.metadata.get('help', '')}")
    return "\n".join(lines)


# ---- stage command lines --------------------------------------------------------------------


def stage_main(
    name: str,
    doc: str,
    positionals: Sequence[str],
    help_sections: Callable[[], str],
    run: Callable[..., str],
    argv: Sequence[str] | None = None,
) -> int:
    """Shared `main()` of every stage: parse args, load params, run, print one summary line.

    `run(params, *positionals)` returns the summary line. Config and artifact errors
    print one clear line on stderr and exit 2 without a traceback.
    """
    from stages.io import ArtifactError

    parser = argparse.ArgumentParser(
        prog=f"python -m stages.{name}",
        description=doc,
        epilog="params read:\n" + help_sections(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for p in positionals:
        parser.add_argument(p)
    parser.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides of params.yaml")
    parser.add_argument("--params", default=str(PARAMS), help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params, args.overrides)
        summary = run(params, *[getattr(args, p) for p in positionals])
    except (ConfigError, ArtifactError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    print(f"{name}: {summary}")
    return 0


def compose(config_dir: str | Path = "conf", output: str | Path = PARAMS, overrides: Sequence[str] = ()) -> Path:
    """Compose conf/ into params.yaml exactly as `dvc exp run` does (DVC's own function)."""
    from dvc.utils.hydra import compose_and_dump

    compose_and_dump(Path(output), str(Path(config_dir).resolve()), None, "config", str(Path.cwd()), list(overrides))
    return Path(output)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "compose", "show"])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--params", default=str(PARAMS))
    args = parser.parse_args(argv)
    try:
        if args.command == "compose":
            print(f"config: wrote {compose(overrides=args.overrides)}")
            return 0
        params = load_params(args.params, args.overrides)
        run = check_all(params)
        if args.command == "show":
            print(OmegaConf.to_yaml(params))
        print(f"config: {args.params} is valid ({len(run.datasets)} datasets × {len(run.models)} models × {len(run.seeds)} seeds)")
        return 0
    except ConfigError as e:
        print(f"config: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
