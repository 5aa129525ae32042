"""A fresh workspace of the project: its source files, without generated data or run state."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


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
