"""Process-wide set-up shared by every stage: determinism, seeds, progress bars."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch
    from tqdm import tqdm

T = TypeVar("T")


def setup_torch(seed: int) -> torch.Generator:
    """Seed every RNG and make torch deterministic; returns a seeded torch Generator.

    One intra-op thread: results then do not depend on the machine's core count, and
    the small models here gain little from threads anyway (see README, Determinism).
    """
    import torch

    torch.set_num_threads(1)
    # Same flag as torch.use_deterministic_algorithms(True), which also imports
    # torch._inductor.config (~1.5 s per process, x every stage of the DAG) only to
    # configure torch.compile, which shiftlab never uses.
    torch._C._set_deterministic_algorithms(True)
    assert torch.are_deterministic_algorithms_enabled()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> tqdm[T]:
    """A progress bar on stderr (tqdm), quiet when SHIFTLAB_QUIET=1 (tests, benchmarks).

    Iterate over it like `items`; `set_postfix_str` shows live figures (a no-op when quiet).
    """
    from tqdm import tqdm

    quiet = os.environ.get("SHIFTLAB_QUIET") == "1"
    return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, disable=quiet, mininterval=1.0, leave=False)
