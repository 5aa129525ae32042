"""The one-line command line every shiftlab command shares (the stages, `stages.core.config`,
`pipeline.flows`, `pipeline.sweep`, `pipeline.inspect`, `pipeline.lock`): a usage error is one line.

It imports nothing of the project, so any layer may use it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a usage error on one line, exit 2: `<name>: error: <what>; usage: ...`.

    Every command line of the project (the stages, `stages.core.config`, `pipeline.flows`,
    `pipeline.sweep`, `pipeline.inspect`, `pipeline.lock`) uses it, so each refusal a user can cause is one line, no traceback.
    """

    def __init__(self, *args: object, name: str, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.name = name

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        self.exit(2, f"{self.name}: error: {message}; {usage} (--help for more)\n")


def count_of(what: str, least: int = 1) -> Callable[[str], int]:
    """argparse type: a whole number of `what`, at least `least` (`--max-parallel`, `--workers`,
    `--rows`); anything else is the parser's one-line error naming the option and the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number of {what} >= {least}, got {text!r}")
        return value

    return parse
