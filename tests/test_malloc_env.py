"""The flow starts stage processes with glibc's malloc keeping large blocks (pipeline.flows.MALLOC_ENV):
the setting is in the environment they start from, a user's own value wins, and glibc honours it
(a process that allocates and frees a 64 MiB array 20 times takes far fewer page faults)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pipeline.flows import MALLOC_ENV, tool_env

FAULTS = textwrap.dedent("""
    import resource
    import numpy as np
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        a = np.ones(64 << 17)  # 64 MiB of float64, above glibc's largest adaptive mmap threshold
        del a
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults(env: dict[str, str]) -> int:
    return int(subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True).stdout)


def test_stage_processes_start_with_malloc_keeping_large_blocks(monkeypatch):
    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    env = tool_env()
    assert {k: env[k] for k in MALLOC_ENV} == MALLOC_ENV
    plain = {k: v for k, v in env.items() if k not in MALLOC_ENV}
    kept, freed = faults(env), faults(plain)
    # Without it each 64 MiB array is mapped afresh and faulted in; with it the heap keeps the block.
    assert kept * 5 < freed, (kept, freed)


def test_a_value_in_the_shell_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert tool_env()["MALLOC_TRIM_THRESHOLD_"] == "131072"
