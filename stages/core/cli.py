"""The command line every stage shares: `python -m stages.<stage> <args> [key=value ...]`."""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from stages.core.console import ArgumentParser
from stages.core.schema import ConfigError, seed_problem

# What to lower when a stage's config asks for more memory than the machine has.
_MEMORY_HINTS = {
    "prepare": "lower the dataset's sizes (dataset.<name>.n_* or its resolution)",
    "phase": "lower phase.base's sizes or the panels' values",
    "report": "fewer models or seeds (run.models, run.seeds)",
}
_MEMORY_HINT = "lower the batch_size, the hidden widths or the dataset's sizes in params.yaml"
_SIZE = re.compile(r"(?:tried to allocate|Unable to allocate)\s+(\d+ bytes|[0-9.]+\s*[KMGTPE]i?B)", re.I)


def _memory_error(e: BaseException) -> bool:
    """An allocation the machine cannot satisfy: MemoryError (numpy's _ArrayMemoryError is one),
    torch's "DefaultCPUAllocator: can't allocate memory" or a CUDA out-of-memory RuntimeError."""
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _memory_line(name: str, e: BaseException) -> str:
    m = _SIZE.search(str(e))
    size = m.group(1) if m else ""
    if size.endswith(" bytes"):
        n, units = float(size.split()[0]), ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"]
        while n >= 1024 and len(units) > 1:
            n, units = n / 1024, units[1:]
        size = f"{n:.1f} {units[0]}"
    what = f"could not allocate {re.sub(r'[.](?=[^0-9])', '', size)}" if size else "an allocation failed"
    return (f"{name}: error: out of memory: {what}; the config asks for more memory than this machine has: "
            f"{_MEMORY_HINTS.get(name, _MEMORY_HINT)} and run again (outputs are written atomically: none was changed)")


# OS errors a user's environment causes (not a bug): a full disk, a read-only or forbidden folder.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def stage_main(
    name: str,
    doc: str,
    positionals: Sequence[str],
    help_sections: Callable[[], str],
    run: Callable[..., str],
    argv: Sequence[str] | None = None,
) -> int:
    """Shared `main()` of every stage: parse args, load params, run, print one summary line.

    `run(params, *positionals)` returns the summary line. Config and artifact errors
    print one clear line on stderr and exit 2 without a traceback.
    """
    from stages.core.config import PARAMS, load_params
    from stages.core.io import ArtifactError, StageInterrupted

    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = bool({"-h", "--help"} & set(argv))  # the epilog imports every method's module
    parser = ArgumentParser(
        name=name,
        prog=f"python -m stages.{name}",
        description=doc,
        epilog=("params read (values from params.yaml):\n" + help_sections()) if wants_help else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for p in positionals:
        parser.add_argument(p)
    parser.add_argument("overrides", nargs="*", default=[], help="Hydra-style key=value overrides of params.yaml")
    parser.add_argument("--params", default=str(PARAMS), help="params file (default: params.yaml)")
    args = parser.parse_intermixed_args(argv)  # `--params p.yaml` may come before the overrides
    try:
        for p in positionals:  # names become paths and DVC stage names: no '/', '..' or spaces
            if p != "seed":
                check_name(p, getattr(args, p))
        params = load_params(args.params, args.overrides)
        summary = run(params, *[getattr(args, p) for p in positionals])
    except (ConfigError, ArtifactError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except StageInterrupted as e:  # stopped cleanly, resumable (see stages/core/checkpoint.py)
        print(f"{name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every output is written atomically, so none is half-written", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:  # an allocation that cannot succeed: one line, not a traceback
        if not _memory_error(e):
            raise
        print(_memory_line(name, e), file=sys.stderr)
        return 2
    except OSError as e:  # disk full, a read-only or forbidden folder met after the pre-flight check
        if e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"{name}: error: {where}{e.strerror or e} (outputs are written atomically: none was half-written)", file=sys.stderr)
        return 2
    print(f"{name}: {summary}")
    _record_imports(name)
    return 0


def _record_imports(name: str) -> None:
    """With SHIFTLAB_IMPORTS=<file>, write the project modules this run imported (one path a
    line); with SHIFTLAB_IMPORTS=<folder>, write them to <folder>/<stage>.txt, the stage being
    DVC's name for it (DVC_STAGE, which `dvc repro` and the flow set) or else `name`.
    tests/test_dvc_pipeline.py checks each is among the stage's DVC deps."""
    out = os.environ.get("SHIFTLAB_IMPORTS")
    if not out:
        return
    if Path(out).is_dir():
        out = str(Path(out) / f"{os.environ.get('DVC_STAGE') or name}.txt")
    files = sorted(
        Path(m.__file__).resolve().relative_to(Path.cwd().resolve()).as_posix()
        for name, m in list(sys.modules.items())
        if name.split(".")[0] in ("stages", "pipeline") and getattr(m, "__file__", None)
    )
    Path(out).write_text("".join(f"{f}\n" for f in files))


def check_name(what: str, name: str) -> str:
    """A dataset, method or model name from the command line (ConfigError unless it is one)."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"{what} '{name}' is not a name: use letters, digits, '_', '-' and '.' (the names under `dataset` and `method` in params.yaml)")
    return name


def parse_seed(seed: str | int) -> int:
    """The positional seed as an int in [0, 2**32 - 1] (stages.core.schema.SEED_MAX; ConfigError otherwise)."""
    if isinstance(seed, str) and not re.fullmatch(r"[+-]?[0-9]+", seed.strip()):
        raise ConfigError(f"seed must be an integer, got '{seed}'")
    value = int(seed)
    problem = seed_problem(value)
    if problem is not None:
        raise ConfigError(problem)
    return value
