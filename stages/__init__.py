"""shiftlab stages: one module per DVC stage (prepare, validate, pretrain, train, distill, evaluate,
report, phase), and the library they share in named sub-packages (core, evaluation, datasets,
models, validation, reporting; see the README's Layout).

Importing the package first checks that this Python has the project's packages, so a stage
started by another Python (`python3 -m stages.train ...` outside the venv, or `.venv/bin/dvc
repro` with no activated venv, whose stage commands call the first `python` on PATH) stops
with one line naming the environment to use instead of a ModuleNotFoundError traceback.
`find_spec` only locates the packages (nothing is imported): a few stat calls.

It then pins the numerical libraries' CPU code paths (stages/core/numerics.py) before any stage
imports torch or numpy, so a stage writes the same bytes on any x86-64 CPU.
"""

import importlib.util as _util
import sys as _sys

REQUIRED = ("numpy", "pyarrow", "omegaconf", "torch", "safetensors", "tqdm", "sklearn")
"""Packages every stage needs; stages.* are never imported without them."""


_missing = [name for name in REQUIRED if _util.find_spec(name) is None]
if _missing:
    raise SystemExit(
        f"shiftlab: {_sys.executable} lacks the project's packages ({', '.join(_missing)}): "
        "use the project's environment: .venv/bin/python, or `source .venv/bin/activate` first "
        "(`make repro` or `make test` creates .venv)"
    )

from stages.core.numerics import pin as _pin  # noqa: E402 - after the check: nothing heavy is imported

_pin()
