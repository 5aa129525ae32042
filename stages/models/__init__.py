"""Trained models on disk: the folder format, `save_model` and `load_model`.

A model folder (`artifacts.model_dir(dataset, model, seed)`) holds

    model.safetensors  the weights; its shiftlab metadata holds `kind` and the architecture
                       arguments to rebuild the network (standardisation is in the tensors),
                       and the folder's `provenance` (stages/core/provenance.py)
    final.safetensors  a model trained by epochs only: the weights of its last epoch, same
                       architecture and provenance (DFR's base model; model.safetensors holds
                       the epoch the selection criterion chose)
    config.json        resolved method config, dataset, seed, selection criterion,
                       selected epoch and its metrics (and `teacher` for a student), and
                       the same `provenance`
    history.parquet    artifacts.HISTORY_SCHEMA, one row per epoch and split (scored metrics,
                       and the training objective on train and val every epoch)

Kinds (`Classifier.kind`, the architecture, not the training method) are registered by
their classes (`registry.register_model`; `registry.model_kinds()` lists them): an MLP
classifier (stages/models/nets.py) for the discriminative methods and students, a timm image
network for those whose config names a timm `backbone` (stages/models/backbone.py), and one
per generative or text model in its method's module. `logits` are the pre-softmax class scores
of a discriminative model, log p(x, y) (or a score of it, e.g. an ELBO estimate) of a
generative one, which also has `log_likelihood(x)`, per-example log p(x).

For all, softmax(logits) is the predicted p(y | x). Loading only ever parses safetensors
(never unpickles) and rejects weights that do not fit the declared architecture; a reader
that says what it expects (`load_model(..., expect=)`) also gets a one-line error for a model
made for another dataset, model, seed or input file, or under other settings than the params it
runs under (naming the keys that differ).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa

from stages.core import provenance as prov
from stages.core.artifacts import HISTORY_SCHEMA
from stages.core.io import (
    PROVENANCE,
    ArtifactError,
    fault_point,
    load_weights,
    read_json,
    save_weights,
    sweep_stale_temps,
    temp_prefix,
    write_json,
    write_parquet,
)

if TYPE_CHECKING:
    from torch import nn

    from stages.models.nets import DenoisingAutoencoder, MLPEncoder, Standardize

WEIGHTS = "model.safetensors"
FINAL_WEIGHTS = "final.safetensors"
CONFIG = "config.json"
HISTORY = "history.parquet"
ENCODER = "encoder.safetensors"
EMBEDDINGS = "embeddings.parquet"


class Classifier(Protocol):
    """What evaluate relies on: class scores for raw inputs."""

    n_classes: int
    kind: str

    def logits(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """float32 (n, n_classes) class scores; softmax of them is p(y | x)."""
        ...


def target_logits(model: Any, x: Any) -> np.ndarray:
    """The logits a student distilled from `model` matches: its `target_logits(x)` (optional on a
    Classifier) or else its `logits(x)`. A kind whose stored scoring approximates its own scores
    (the denoising classifier's sequential elimination: only the argmax is full scoring's, a dropped
    class's logit is a capped stand-in) gives its full scores there."""
    target = getattr(model, "target_logits", None)
    return np.asarray(target(x) if callable(target) else model.logits(x))


def inference_cost(model: Any) -> dict[str, Any] | None:
    """The model's `cost_per_example()` (optional on a Classifier), or None if it has none.

    A deterministic figure computed from the architecture, not a timing: at least
    `params` (stored numbers the classifier needs at inference, i.e. its state_dict size)
    and `macs` (multiply-adds to score one example against every class, as implemented);
    a kind may add its own keys (e.g. network evaluations per example). `save_model`
    writes it into config.json as `inference_cost`.
    """
    cost = getattr(model, "cost_per_example", None)
    return dict(cost()) if callable(cost) else None


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; it replaces `path` only if the block succeeds.

    The old folder is renamed away, the new one renamed in, then the old one deleted: a
    failure anywhere before the swap leaves the previous folder untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temps(path)  # folders left by a killed writer (see stages/core/io.py)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the folder is an ordinary output
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    try:
        yield tmp
        fault_point("before_rename", path.name)
        if old.exists():
            shutil.rmtree(old)
        had_old = path.exists()
        if had_old:
            os.rename(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            if had_old:
                os.rename(old, path)
            raise
        if had_old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_model(
    model_dir: str | os.PathLike[str],
    model: Any,
    config: dict[str, Any],
    history: pa.Table | None,
    provenance: dict[str, Any] | None = None,
    final: dict[str, Any] | None = None,
) -> Path:
    """Write model.safetensors, config.json and (if given) history.parquet as one atomic folder;
    with `final` (the state_dict of a model's last epoch), final.safetensors too.

    `model` is an MLPClassifier or LDAClassifier (anything with `state_dict()` and `arch()`);
    config.json gets the model's `inference_cost` added when the model defines one.
    `provenance` (stages.core.provenance.record; every stage gives one) goes into both the weights'
    header and config.json.
    """
    model_dir = Path(model_dir)
    cost = inference_cost(model)
    if cost is not None:
        config = {**config, "inference_cost": cost}
    if provenance is not None:
        config = {**config, PROVENANCE: provenance}
    with atomic_dir(model_dir) as tmp:
        save_weights(model.state_dict(), tmp / WEIGHTS, meta=model.arch(), provenance=provenance)
        if final is not None:
            save_weights(final, tmp / FINAL_WEIGHTS, meta=model.arch(), provenance=provenance)
        write_json(config, tmp / CONFIG)
        if history is not None:
            write_parquet(history, tmp / HISTORY, HISTORY_SCHEMA)
    return model_dir


def load_model(model_dir: str | os.PathLike[str], expect: prov.Expected | None = None, weights: str = WEIGHTS) -> Classifier:
    """Rebuild the classifier stored in `model_dir` (see the module docstring for the kinds), from
    its `weights` file (FINAL_WEIGHTS: the last epoch's).

    With `expect`, the folder's provenance must be what the reader asks for (stages/core/provenance.py),
    in model.safetensors and config.json alike; checked once the weights are known to be sound.
    """
    path = Path(model_dir) / weights
    tensors, meta = load_weights(path)
    model = _build(meta, path)
    _load_checked(model, tensors, path)
    if expect is not None:
        config_file = Path(model_dir) / CONFIG
        recorded = read_json(config_file) if config_file.is_file() else None
        settings = recorded.get("config") if isinstance(recorded, dict) else None
        found = prov.check(path, prov.read(path), expect, settings)
        if config_file.is_file():
            prov.check_agree(path, found, config_file, expect)
    model.eval()
    return model  # type: ignore[return-value]


def _build(meta: dict[str, Any], path: Path) -> nn.Module:
    from stages.core import registry
    kind = meta.get("kind")
    cls = registry.model_class(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ArtifactError(f"{path}: unknown model kind {kind!r} (expected one of {registry.model_kinds()})")
    _positive_int(meta, "in_dim", path)
    _positive_int(meta, "n_classes", path)
    try:
        return cls.from_arch(meta)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: metadata does not describe a {kind} model ({e})") from None


def _positive_int(meta: dict[str, Any], key: str, path: Path) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ArtifactError(f"{path}: metadata '{key}' must be a positive integer, got {value!r}")
    return value


def _widths(meta: dict[str, Any], path: Path) -> list[int]:
    hidden = meta.get("hidden")
    if not isinstance(hidden, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
        raise ArtifactError(f"{path}: metadata 'hidden' must be a list of positive integers, got {hidden!r}")
    return hidden


def _load_checked(module: nn.Module, tensors: dict[str, Any], path: Path) -> None:
    """Load `tensors` into `module` after checking names, shapes and dtypes exactly."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ArtifactError(
            f"{path}: weights do not match the declared architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise ArtifactError(
                f"{path}: tensor '{name}' is {got.dtype} {tuple(got.shape)}, "
                f"the declared architecture needs {want.dtype} {tuple(want.shape)}"
            )
    module.load_state_dict(tensors, strict=True)


# ---- pretrained encoders --------------------------------------------------------------------


def save_encoder(
    path: str | os.PathLike[str], dae: DenoisingAutoencoder, provenance: dict[str, Any] | None = None
) -> Path:
    """Save a DAE's standardisation and encoder (not its decoder) as safetensors, with the
    pretrain stage's `provenance` in the header."""
    state = {k: v for k, v in dae.state_dict().items() if k.startswith(("standardize.", "encoder."))}
    meta = {"kind": "dae_encoder", "in_dim": dae.encoder.in_dim, "hidden": dae.encoder.hidden}
    return save_weights(state, path, meta=meta, provenance=provenance)


def load_encoder(path: str | os.PathLike[str]) -> tuple[Standardize, MLPEncoder]:
    """The standardisation and encoder saved by `save_encoder`, architecture from its metadata."""
    from torch import nn

    from stages.models.nets import MLPEncoder, Standardize

    path = Path(path)
    tensors, meta = load_weights(path)
    if meta.get("kind") != "dae_encoder":
        raise ArtifactError(f"{path}: expected a 'dae_encoder', metadata says kind {meta.get('kind')!r}")
    in_dim = _positive_int(meta, "in_dim", path)
    hidden = _widths(meta, path)
    holder = nn.Module()
    holder.standardize = Standardize(in_dim)
    holder.encoder = MLPEncoder(in_dim, hidden)
    _load_checked(holder, tensors, path)
    return holder.standardize, holder.encoder
