"""The phase stage's cells (data/phase/phase.json) as the report reads them, and who wins each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.core.io import ArtifactError, read_json

PHASE_PATH = Path("data") / "phase" / "phase.json"


def phase_wins(cells: list[dict[str, Any]]) -> tuple[int, int]:
    """(cells the generative classifier wins, cells the discriminative one wins): the sign of
    `diff` = generative − discriminative worst-group OOD accuracy."""
    return sum(c["diff"] > 0 for c in cells), sum(c["diff"] < 0 for c in cells)


def load_phase(path: Path = PHASE_PATH) -> list[dict[str, Any]]:
    """The phase stage's cells ([] when the file is absent or empty)."""
    if not path.is_file():
        return []
    cells = read_json(path)
    if not isinstance(cells, list):
        raise ArtifactError(f"{path}: expected a JSON list of cells")
    return cells
