"""The model names the installed timm builds, for config validation, without importing timm each time.

A method's `backbone` is `mlp` (the hand-written MLP) or a timm model name, and the config is
validated before any work starts: in `make check`, in every stage, and in DVC's own process while
`dvc exp run -S experiment=<an image recipe>` composes params.yaml. Listing timm's names imports timm,
and with it torch, torchvision and TorchDynamo: ~2.7 s of CPU in a process that would otherwise
import none of them (measured on this project's 2-core machine; README, Performance).

So the list is cached, one JSON file per installed timm in the user's cache directory
(platformdirs: `~/.cache/shiftlab/timm-names-<version>-<install>.json` on Linux, `$XDG_CACHE_HOME`
honoured), keyed by timm's version, where it is installed and its version file's size and modification
time (all read without importing timm). The file is written atomically; one that is missing,
unreadable, not this project's format or of another timm install is rebuilt from
`timm.list_models()`, and a cache directory that cannot be written (or found: no home directory)
only costs the import. A name the list lacks is always looked up in timm itself for its one-line
error (close matches).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

LIBRARY = "timm"
MLP = "mlp"  # the `backbone` value that keeps the hand-written MLP (stages/models/mlp.py; every default)
FORMAT = "shiftlab timm names, v1"


def installed() -> dict[str, Any] | None:
    """What identifies the installed timm (version, location, its version file's size and mtime),
    read without importing it; None when timm is not installed."""
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or not spec.submodule_search_locations:
        return None
    where = Path(next(iter(spec.submodule_search_locations)))
    try:
        stat = (where / "version.py").stat()
        version = importlib.metadata.version(LIBRARY)
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return {"format": FORMAT, "version": version, "path": str(where), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cache_path(key: dict[str, Any]) -> Path | None:
    """Where the names of the timm install `key` (`installed()`) are cached: the user's cache
    directory, one file per version and install location (two venvs do not overwrite each other's).
    None where there is no such directory: no home directory (a container's arbitrary user with HOME
    unset, where platformdirs raises), or a relative path (platformdirs ignores a relative
    XDG_CACHE_HOME, as the XDG spec says; checked anyway: it would write into the project)."""
    from platformdirs import user_cache_path

    try:
        top = user_cache_path("shiftlab")
    except RuntimeError:  # platformdirs: "could not determine the home directory"
        return None
    if not top.is_absolute():
        return None
    where = hashlib.sha256(key["path"].encode()).hexdigest()[:12]
    return top / f"timm-names-{key['version']}-{where}.json"


def list_names() -> list[str]:
    """Every name timm builds, from timm itself (imports it): architectures and tagged names
    (`resnet50.a1_in1k`), sorted."""
    import timm

    return sorted(set(timm.list_models()) | set(timm.list_models(pretrained=True)))


@functools.cache
def timm_names() -> frozenset[str]:
    """Every model name the installed timm builds, from the cache when it is this install's."""
    key = installed()
    path = cache_path(key) if key is not None else None
    if path is None:  # no timm (its own ImportError) or no cache directory: timm itself
        return frozenset(list_names())
    from stages.core.io import ArtifactError, read_json, write_json

    try:
        cached = read_json(path)
    except (ArtifactError, OSError, ValueError):  # missing, unreadable, not JSON, not text
        cached = None
    if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("names"), list):
        return frozenset(cached["names"])
    names = list_names()
    with contextlib.suppress(OSError):  # a cache directory that cannot be written: every validation imports timm
        write_json({"key": key, "names": names}, path)
    return frozenset(names)


def name_problem(name: str) -> str | None:
    """Why `name` is not a backbone value (one line listing close timm names), or None."""
    if name == MLP or name in timm_names():
        return None
    import timm

    names = timm.list_models()
    close = [n for n in names if n.startswith(name)][:5]  # e.g. vit_small -> vit_small_patch16_224, ...
    close += [n for n in difflib.get_close_matches(name, names, n=5, cutoff=0.6) if n not in close][: 5 - len(close)]
    hint = f"close matches: {close}" if close else "none close"
    return f"must be '{MLP}' or a timm model name (timm {timm.__version__}: `timm.list_models()`), got '{name}' ({hint})"
