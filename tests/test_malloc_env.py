"""The flow starts stage processes with glibc's malloc keeping large blocks (pipeline.flows.MALLOC_ENV):
the setting is in the environment they start from, a user's own value wins, and glibc honours it
(a 64 MiB array comes from the heap, not from a mapping of its own that `free` hands back)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pipeline.flows import MALLOC_ENV, tool_env

# glibc's mallinfo2(): `hblkhd` is the bytes held in mmap'ed chunks (each returned to the kernel
# when freed), `arena` the bytes of the heap.
MAPPED = textwrap.dedent("""
    import ctypes
    import numpy as np

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    a = np.ones(64 << 17)  # 64 MiB of float64, above glibc's largest adaptive mmap threshold (32 MiB)
    info = mallinfo2()
    print(info.hblkhd, info.arena)
""")
MIB = 1 << 20


def mapped_and_heap(env: dict[str, str]) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", MAPPED], env=env, capture_output=True, text=True, check=True).stdout
    mapped, heap = map(int, out.split())
    return mapped, heap


def test_stage_processes_start_with_malloc_keeping_large_blocks(monkeypatch):
    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    env = tool_env()
    assert {k: env[k] for k in MALLOC_ENV} == MALLOC_ENV
    plain = {k: v for k, v in env.items() if k not in MALLOC_ENV}
    # glibc's defaults map the array on its own (freed: unmapped, faulted in afresh next time) ...
    mapped, _ = mapped_and_heap(plain)
    assert mapped >= 64 * MIB, mapped
    # ... the flow's settings put it in the heap, which keeps it when freed.
    mapped, heap = mapped_and_heap(env)
    assert mapped < 64 * MIB <= heap, (mapped, heap)


def test_a_value_in_the_shell_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert tool_env()["MALLOC_TRIM_THRESHOLD_"] == "131072"
