"""A fresh workspace of the project: its source files, without generated data or run state."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any


def copy_project(src: Path, dest: Path) -> list[str]:
    """Copy the project's files (tracked + untracked-not-ignored) from `src` to `dest`.

    Leaves out what a run produces (`dvc.lock`, `data/` except the raw downloads' README and
    folders) and the tests. Used by the end-to-end tests and the benchmarks to run the real
    DAG in a throw-away copy. Returns the relative paths copied.
    """
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=src, text=True,
                           capture_output=True, check=True).stdout.split()
    copied = []
    for rel in files:
        generated = rel.startswith("data/") and not rel.startswith("data/raw/")
        if rel == "dvc.lock" or generated or rel.startswith("tests/") or not (src / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel)
        copied.append(rel)
    return copied


_LOCKS: dict[Path, tuple[tuple[int, int, int], Any]] = {}


def read_lock(root: Path) -> Any:
    """`root`/dvc.lock parsed (None when there is none), read-only: the object is shared between
    callers. Parsed with libyaml's C loader where PyYAML has it (the pure-Python loader takes
    ~1.3 s on the tiny DAG's lock and ~30 s on a 600-stage one) and kept while the file's inode,
    size and mtime stay the same (DVC replaces the file on every write), so `python -m
    pipeline.inspect data` parses it once, not once per file. Raises yaml.YAMLError or
    RecursionError when it is not valid YAML."""
    import yaml

    path = Path(root) / "dvc.lock"
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _LOCKS.get(path)
    if cached is None or cached[0] != key:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        _LOCKS[path] = cached = (key, yaml.load(path.read_text(), Loader=loader))
    return cached[1]
