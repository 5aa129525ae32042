"""The command line every stage shares: `python -m stages.<stage> <args> [key=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from stages.schema import ConfigError


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
    from stages.config import PARAMS, load_params
    from stages.io import ArtifactError, StageInterrupted

    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = bool({"-h", "--help"} & set(argv))  # the epilog imports every method's module
    parser = argparse.ArgumentParser(
        prog=f"python -m stages.{name}",
        description=doc,
        epilog=("params read (values from params.yaml):\n" + help_sections()) if wants_help else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for p in positionals:
        parser.add_argument(p)
    parser.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides of params.yaml")
    parser.add_argument("--params", default=str(PARAMS), help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params, args.overrides)
        summary = run(params, *[getattr(args, p) for p in positionals])
    except (ConfigError, ArtifactError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except StageInterrupted as e:  # stopped cleanly, resumable (see stages/checkpoint.py)
        print(f"{name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every output is written atomically, so none is half-written", file=sys.stderr)
        return 130
    print(f"{name}: {summary}")
    _record_imports()
    return 0


def _record_imports() -> None:
    """With SHIFTLAB_IMPORTS=<file>, write the project modules this run imported (one path a
    line): tests/test_dvc_pipeline.py checks each is among the stage's DVC deps."""
    out = os.environ.get("SHIFTLAB_IMPORTS")
    if not out:
        return
    files = sorted(
        Path(m.__file__).resolve().relative_to(Path.cwd().resolve()).as_posix()
        for name, m in list(sys.modules.items())
        if name.split(".")[0] in ("stages", "pipeline") and getattr(m, "__file__", None)
    )
    Path(out).write_text("".join(f"{f}\n" for f in files))


def parse_seed(seed: str | int) -> int:
    """The positional seed as an int (ConfigError otherwise)."""
    try:
        return int(seed)
    except ValueError:
        raise ConfigError(f"seed must be an integer, got '{seed}'") from None
