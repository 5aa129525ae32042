"""What every config schema is made of: typed keys with help text, range checks, ConfigError.

A schema (a dataclass in the module of the method, dataset or stage it configures) declares
each key's type, meaning and allowed range. It declares no values: every value is written
once, in `conf/` (composed into params.yaml), so `--help`, a run and params.yaml always agree
(tests/test_registry.py checks that every key of every schema has exactly one value there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def option(text: str) -> Any:
    """A schema key with its help text and no default (the value comes from conf/)."""
    return field(metadata={"help": text})


# Checkpoint selection criteria, and the split each scores (the metric is in
# stages.models.history.SELECTION_METRIC).
SELECTIONS = ("val_avg", "val_worst_group", "oracle")
OPTIMIZERS = ("adamw", "sgd")
"""The optimisers of the shared training loop (stages/models/training.py `make_optimizer`)."""

SELECTION_SPLIT = {"val_avg": "val", "val_worst_group": "val", "oracle": "test_ood"}


# Every seed (a stage's positional seed, `run.seeds`, and each schema key named `seed`,
# `seeds` or `*_seed`) is in [0, 2**32 - 1]: the range every generator it reaches accepts.
# numpy's legacy np.random.seed and scikit-learn's random_state (DFR's liblinear) stop at
# 2**32 - 1, numpy's default_rng refuses negatives, torch.manual_seed overflows past 2**64.
SEED_MAX = 2**32 - 1
SEED_RANGE = f"[0, {SEED_MAX}]"


def seed_problem(value: Any) -> str | None:
    """Why `value` cannot be a seed (one line naming it and the allowed range), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"a seed must be an integer in {SEED_RANGE}, got {value!r}"
    if not 0 <= value <= SEED_MAX:
        return f"seed {value} is out of range: a seed must be an integer in {SEED_RANGE} (2**32 - 1, what torch, numpy and scikit-learn all accept)"
    return None


def _is_seed_key(name: str) -> bool:
    return name in ("seed", "seeds") or name.endswith(("_seed", "_seeds"))


def train_and_selection_splits(selection: str) -> tuple[str, ...]:
    """What a minibatch-trained method reads: train, and the split its selection criterion scores."""
    return tuple(dict.fromkeys(("train", SELECTION_SPLIT.get(selection, "val"))))


LOCAL_FILES = ("weights", "vocab")
"""Method config keys that name a local file a network starts from (its weights, its tokenizer's
vocabulary): the train stage's DVC deps (stages/dag.py), provenance inputs and resume fingerprint,
and what `dvc exp run` checks exists before it starts (stages/core/config.py `check_inputs`)."""

class Checks:
    """Collects range checks; `key` is relative to the section."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def require(self, ok: bool, key: str, msg: str) -> None:
        if not ok:
            self.errors.append((key, msg))

    def prob(self, value: float, key: str) -> None:
        self.require(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value}")

    def positive(self, value: float, key: str) -> None:
        self.at_least(value, key, 0, strict=True)

    def non_negative(self, value: float, key: str) -> None:
        self.at_least(value, key, 0)

    def at_least(self, value: float, key: str, low: float, strict: bool = False) -> None:
        """`value` >= `low` (> with `strict`). One rule and one wording for a float key: NaN and
        ±inf are refused as "must be a finite number > 0" (nan compares false, inf passes a lower
        bound, and either would train on NaN); an int key reads "must be >= 0"."""
        op = ">" if strict else ">="
        ok = value > low if strict else value >= low
        if isinstance(value, float):
            self.require(ok and math.isfinite(value), key, f"must be a finite number {op} {low}, got {value}")
        else:
            self.require(ok, key, f"must be {op} {low}, got {value}")

    def choice(self, value: str, key: str, options: Sequence[str]) -> None:
        self.require(value in options, key, f"must be one of {list(options)}, got '{value}'")

    def widths(self, value: Sequence[int], key: str = "hidden") -> None:
        self.require(all(h > 0 for h in value), key, f"widths must be > 0, got {list(value)}")

    def minibatch(self, cfg: Any) -> None:
        """The optimisation keys every minibatch-trained section shares: lr, epochs and
        batch_size, and weight_decay and selection where the section has them."""
        self.positive(cfg.lr, "lr")
        if hasattr(cfg, "weight_decay"):
            self.non_negative(cfg.weight_decay, "weight_decay")
        self.require(cfg.epochs >= 1, "epochs", f"must be >= 1, got {cfg.epochs}")
        self.require(cfg.batch_size >= 1, "batch_size", f"must be >= 1, got {cfg.batch_size}")
        if hasattr(cfg, "selection"):
            self.choice(cfg.selection, "selection", SELECTIONS)

    def fracs(self, *fracs: float) -> None:
        """val/test_id/test_ood fractions: each in (0, 1), together leaving >= 10% for train."""
        for k, v in zip(("val_frac", "test_id_frac", "test_ood_frac"), fracs, strict=True):
            self.require(0 < v < 1, k, f"must be in (0, 1), got {v}")
        self.require(sum(fracs) < 0.9, "val_frac", f"val+test fractions must leave >= 10% for train, got {sum(fracs)}")

    def sizes(self, cfg: Any, keys: Sequence[str] = ("n_train", "n_val", "n_test_id", "n_test_ood"), low: int = 8) -> None:
        for k in keys:
            self.require(getattr(cfg, k) >= low, k, f"must be >= {low}, got {getattr(cfg, k)}")


def non_finite(value: Any, key: str = "") -> list[tuple[str, Any]]:
    """(key, value) of every float in `value` that is NaN or ±inf, with its key relative to
    `value` (`lr`, `panels[0].x_values`): through dataclass fields, lists and mappings."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [(key, value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [hit for f in dataclasses.fields(value) for hit in non_finite(getattr(value, f.name), f"{key}.{f.name}".lstrip("."))]
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in non_finite(v, f"{key}.{k}".lstrip("."))]
    if isinstance(value, (list, tuple)):
        bad = [hit for i, v in enumerate(value) for hit in non_finite(v, f"{key}[{i}]")]
        # a list of numbers is one key: named once, with the whole list
        return [(key, list(value))] if bad and all(isinstance(v, (int, float)) for v in value) else bad
    return []


def check(obj: Any) -> list[tuple[str, str]]:
    """The range errors of a schema instance (its `check(Checks)`), as (relative key, message).

    Every float key of every schema must be finite, whatever its own check says: a NaN or ±inf
    left by a check that only bounds one side (`c.require(v > 0, ...)`) is refused here.
    """
    checks = Checks()
    obj.check(checks)
    named = {k for k, _ in checks.errors}
    bad = non_finite(obj)
    for key, value in bad:
        if key not in named and key.split("[")[0] not in named:
            what = "must hold finite numbers" if isinstance(value, list) else "must be a finite number"
            checks.require(False, key, f"{what}, got {value}")
    if bad:  # a NaN fails every comparison made with it (its range, then a sum of fractions under
        # another key's name): only the non-finite keys are named, each once, by the first message
        keys = [k for k, _ in bad] + [k.split("[")[0] for k, _ in bad]
        first = {k: m for k, m in reversed(checks.errors)}
        checks.errors = [(k, first[k]) for k in dict.fromkeys(keys) if k in first]
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        if _is_seed_key(f.name):  # one range for every seed of every schema
            value = getattr(obj, f.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                problem = seed_problem(v)
                if problem is not None:
                    checks.require(False, f.name, problem)
                    break
    return checks.errors


def describe(schema: type, prefix: str, values: Any = None) -> str:
    """Human-readable list of a schema's keys, types and meaning (for --help), with the values
    a run would use when `values` (the section from params.yaml) is given."""
    lines = [f"{prefix}  ({schema.__doc__.strip() if schema.__doc__ else schema.__name__})"]
    for f in dataclasses.fields(schema):
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        value = ""
        if values is not None and f.name in values:
            v = values[f.name]
            value = f" = {_plain(v)!r}"
        lines.append(f"  {prefix}.{f.name}: {type_name}{value}  — {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
