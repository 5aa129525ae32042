"""Provenance: every artifact records what made it, and every reader checks it before use.

A model folder (train, distill), the pretrain stage's outputs and every evaluation (its
predictions and metrics) carry one record, `record(...)`:

    dataset        the dataset the stage ran on
    model          what it is: the method's name under `method:` in params.yaml (train), the
                   student's `<teacher>_student` (distill), `pretrain` (the pretrain stage),
                   the evaluated model's name (evaluate)
    kind           the method's `kind`; `distill` for a student; the pretraining objective;
                   for an evaluation, the evaluated model's kind
    seed           the stage's seed (pretrain: `pretrain.seed`)
    stage          the DVC stage that wrote it, e.g. train@<dataset>-<model>-<seed>
    config_sha256  sha256 of the stage's own params section, resolved and validated, as
                   canonical JSON (sorted keys, no spaces): `method.<name>`, `distill`,
                   `pretrain` or `evaluate`
    inputs         {path: sha256 of its bytes} for every file the stage read: the prepared
                   Parquet, and the model it built on (the teacher's or the upstream method's
                   model.safetensors, the pretrain stage's encoder.safetensors and
                   embeddings.parquet); paths relative to the workspace

It lives under the key `provenance` (stages.core.io.PROVENANCE) of each artifact's metadata: the
shiftlab JSON header of model.safetensors / encoder.safetensors, config.json, the Parquet
file metadata of predictions and embeddings, and the metrics JSON. It holds no timestamp and
no absolute path, so the same params and seed still give byte-identical files.

`check` / `check_file` are the one check every consumer runs (evaluate on its model, distill on
its teacher, a method on the upstream model or the pretrained encoder it reads, the report on
predictions and metrics): the artifact must have been made for the dataset, model and seed
the consumer asks for, from the same bytes of the input files both read, and (where the reader
runs under params that hold the maker's section) under the same settings: `config_sha256` must be
that of the section as the reader's params resolve it, so weights of another architecture or
training are refused rather than used. A mismatch is one
`ArtifactError` line naming the artifact, what it was made as, what was asked for, and the
stage to re-run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.core.io import PROVENANCE, ArtifactError, read_json, read_metadata, read_weights_meta

FIELDS = ("dataset", "model", "kind", "seed", "stage", "config_sha256", "inputs")

# Hashes of the files hashed in this process, by (path, size, mtime, inode): a stage that reads
# the prepared file, checks its model against it and records it hashes it once.
_HASHES: dict[tuple[str, int, int, int], str] = {}


def canonical_json(value: Any) -> str:
    """The canonical JSON of `value`: sorted keys, no whitespace, ASCII only."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_sha256(config: Any) -> str:
    """sha256 of a stage's resolved params section (a dataclass or a mapping), as canonical JSON."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (computed once per version of the file)."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: file not found") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def record(
    *, dataset: str, model: str, kind: str, seed: int, stage: str, config: Any, inputs: Iterable[str | os.PathLike[str]]
) -> dict[str, Any]:
    """The provenance record of an artifact a stage writes (see the module docstring)."""
    return {
        "dataset": dataset,
        "model": model,
        "kind": kind,
        "seed": int(seed),
        "stage": stage,
        "config_sha256": config_sha256(config),
        "inputs": {Path(p).as_posix(): file_sha256(p) for p in sorted(set(map(Path, inputs)))},
    }


@dataclass(frozen=True)
class Expected:
    """What a consumer needs an artifact to be; None leaves a field unchecked.

    `inputs`: files the consumer reads too (e.g. the prepared Parquet): the artifact must have
    been made from their present bytes. `config`: the validated params section the artifact's
    maker runs under now (`config_key`, e.g. `method.<name>`): the artifact must record the same
    `config_sha256` (weights of another architecture or training are refused, not used). `made_by`: the stage that makes the artifact wanted,
    named in the error. `verb` and `role` word the error: "was trained as method 'x'",
    "was evaluated with model 'x'".
    """

    dataset: str
    made_by: str
    model: str | None = None
    seed: int | None = None
    inputs: tuple[str | os.PathLike[str], ...] = ()
    verb: str = "trained"
    role: str = "as method"
    config: Any = None
    config_key: str = ""


def _valid(found: Any) -> bool:
    return (
        isinstance(found, dict)
        and all(k in found for k in FIELDS)
        and all(isinstance(found[k], str) for k in ("dataset", "model", "kind", "stage", "config_sha256"))
        and isinstance(found["seed"], int)
        and isinstance(found["inputs"], dict)
    )


def _plain(text: str) -> str:
    """`text` as written, with any control character escaped (values come from files)."""
    return repr(text)[1:-1]


def _short(digest: Any) -> str:
    return f"{_plain(digest[:12])}…" if isinstance(digest, str) else "none recorded"


def check(artifact: str | os.PathLike[str], found: Any, want: Expected, settings: Any = None) -> dict[str, Any]:
    """`found` (the provenance `artifact` carries) if it is what `want` asks for, else ArtifactError.

    `settings`: the resolved config the artifact's maker recorded beside it (a model's config.json
    `config`), if any: a config mismatch then names the keys that differ."""
    hint = f"; re-run `dvc repro {want.made_by}`"
    if not _valid(found):
        raise ArtifactError(f"{artifact} has no provenance record (written by an older shiftlab or by hand){hint}")
    if found["dataset"] != want.dataset:
        raise ArtifactError(f"{artifact} was {want.verb} on dataset {found['dataset']!r}, not {want.dataset!r}{hint}")
    if want.model is not None and found["model"] != want.model:
        raise ArtifactError(
            f"{artifact} was {want.verb} {want.role} {found['model']!r} (kind {_plain(found['kind'])}), not {want.model!r}{hint}"
        )
    if want.seed is not None and found["seed"] != want.seed:
        raise ArtifactError(f"{artifact} was {want.verb} with seed {found['seed']}, not {want.seed}{hint}")
    for path in want.inputs:
        name, now = Path(path).as_posix(), file_sha256(path)
        then = found["inputs"].get(name)
        if then != now:
            raise ArtifactError(
                f"{artifact} was {want.verb} on another version of {name} (sha256 {_short(then)} then, {_short(now)} now){hint}"
            )
    if want.config is not None:
        now = config_sha256(want.config)
        if found["config_sha256"] != now:
            raise ArtifactError(
                f"{artifact} was {want.verb} under other settings of {want.config_key} than the params it is read with "
                f"(config_sha256 {_short(found['config_sha256'])} there, {_short(now)} now{_differ(settings, want.config)}){hint}"
            )
    return found


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _differ(recorded: Any, config: Any) -> str:
    """'; <key>: <then> there, <now> now' for up to three keys where the recorded config and the
    present one differ ('' when nothing was recorded to compare)."""
    if not isinstance(recorded, Mapping):
        return ""
    then, now = _flat(recorded), _flat(config)
    keys = sorted(k for k in then.keys() | now.keys() if then.get(k, "<absent>") != now.get(k, "<absent>"))
    shown = [f"{_plain(k)}: {canonical_json(then.get(k))} there, {canonical_json(now.get(k))} now" for k in keys[:3]]
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    return f"; {', '.join(shown)}{more}" if shown else ""


def read(path: str | os.PathLike[str]) -> Any:
    """The provenance an artifact carries (None if it has none): a safetensors file's header,
    a Parquet file's metadata, a JSON object's key."""
    path = Path(path)
    if path.suffix == ".safetensors":
        meta = read_weights_meta(path)
    elif path.suffix == ".parquet":
        meta = read_metadata(path)
    else:
        meta = read_json(path)
    return meta.get(PROVENANCE) if isinstance(meta, dict) else None


def check_file(path: str | os.PathLike[str], want: Expected) -> dict[str, Any]:
    """`check` the provenance stored in the file at `path`."""
    return check(path, read(path), want)


def check_agree(path: str | os.PathLike[str], found: Mapping[str, Any], other: str | os.PathLike[str], want: Expected) -> None:
    """Two files of one artifact (model.safetensors and config.json) must carry the same record."""
    theirs = read(other)
    if theirs != found:
        what = f"model {theirs['model']!r} on dataset {theirs['dataset']!r}, seed {theirs['seed']}" if _valid(theirs) else "no provenance record"
        raise ArtifactError(
            f"{other} does not belong with {path}: it records {what} (a file copied from another folder?); "
            f"re-run `dvc repro {want.made_by}`"
        )
