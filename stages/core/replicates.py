"""Replicates that redraw the data (`run.redraw_data`): the datasets a run prepares, and which
seeds train and evaluate on each.

A replicate redraws what a user's next experiment would redraw: the model's initialisation
(the run seed) and, with `run.redraw_data`, a generated dataset itself. Each generated dataset
of `run.datasets` (its kind registered `generate=`) then gets one *instance* per run seed k, a
dataset of its own named `<dataset>_seed<k>` (so data/prepared/<instance>.parquet and every
path and stage name after it follow the artifact contract unchanged), drawn from the dataset's
section with its `seed` replaced by `data_seed(seed, k)`; seed k's models train and evaluate on
instance k only. Real datasets keep their fixed splits: one dataset for every seed, as when
the mode is off. The prepared file of an instance records `replicate_of: <dataset>` and
`replicate_seed: <k>` (stages/prepare.py).

Nothing here reads params.yaml or imports a dataset module: stages.core.config applies it to a
params file (the registry says which kinds are generated) and stages/dag.py to DVC's items.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from stages.core.schema import ConfigError

SUFFIX = "_seed"
_INSTANCE = re.compile(rf"^(?P<dataset>.+){SUFFIX}(?P<seed>0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class DataInstance:
    """One prepared dataset of a run and the seeds that use it."""

    name: str  # data/prepared/<name>.parquet, prepare@<name>, train@<name>-<method>-<seed>, ...
    dataset: str  # the section it is drawn from: dataset.<dataset>
    replicate_seed: int | None  # the run seed whose redrawn data it is; None: the dataset itself
    seeds: tuple[int, ...]  # the run seeds whose models train and evaluate on it


def instance_name(dataset: str, seed: int) -> str:
    """The name of dataset `dataset`'s instance for run seed `seed`."""
    return f"{dataset}{SUFFIX}{seed}"


def parse(name: str) -> tuple[str, int] | None:
    """(dataset, seed) when `name` has an instance's form (`<dataset>_seed<k>`, k written as
    `instance_name` writes it), else None."""
    m = _INSTANCE.match(name)
    return (m.group("dataset"), int(m.group("seed"))) if m else None


def data_seed(dataset_seed: int, seed: int) -> int:
    """The generator seed of a dataset's instance for run seed `seed`: the first 32-bit word of
    numpy's SeedSequence(dataset_seed, spawn_key=(seed,)) — the `seed`-th child of the
    dataset's own seed sequence (`SeedSequence(dataset_seed).spawn(n)[seed]`), numpy's way to
    derive independent streams from one seed. In [0, 2**32 - 1] like every seed (schema.SEED_MAX).
    SeedSequence hashes integers only (no floating point), so the value is the same on every
    machine; tests/test_replicates.py pins a few values, so a numpy that changed it would fail
    there rather than silently redraw every instance."""
    import numpy as np

    return int(np.random.SeedSequence(dataset_seed, spawn_key=(seed,)).generate_state(1, np.uint32)[0])


def plan(
    datasets: Sequence[str], seeds: Sequence[int], redraw: bool, generated: Callable[[str], bool], sections: Collection[str]
) -> dict[str, DataInstance]:
    """The run's prepared datasets in `run.datasets` order (a dataset's instances in seed order).

    `generated(name)` says whether dataset `name`'s kind is generated; `sections` are the names
    under `dataset` (an instance may not take one of them: ConfigError naming both)."""
    out: dict[str, DataInstance] = {}
    for d in datasets:
        if not (redraw and generated(d)):
            out[d] = DataInstance(d, d, None, tuple(seeds))
            continue
        for s in seeds:
            name = instance_name(d, s)
            if name in sections:
                raise ConfigError(
                    f"params.yaml: dataset.{name}: its name is that of dataset.{d}'s replicate for seed {s} "
                    f"(run.redraw_data: true); rename the section"
                )
            out[name] = DataInstance(name, d, s, (s,))
    return out
