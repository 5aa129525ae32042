"""Same bytes on any x86-64 CPU: the numerical libraries' code paths, pinned by the stage process.

PyTorch, MKL, oneDNN and OpenBLAS each pick their kernels by the CPU they run on (AVX-512 on one
machine, AVX2 on another), and those kernels round differently: the same params and seed gave
different weights on an AVX-512 Xeon than on an AVX2 machine, LDA's float64 closed form included
(MKL's LAPACK), so a clone could not reproduce the committed dvc.lock. `pin()` sets, in the
process's own environment and before torch or numpy is imported, the instruction set each of them
may use to AVX2 — the floor of the x86-64 machines shiftlab supports — and one BLAS thread:

    ATEN_CPU_CAPABILITY=avx2            PyTorch's own CPU kernels
    MKL_CBWR=AVX2,STRICT                MKL's conditional numerical reproducibility (BLAS, LAPACK)
    MKL_ENABLE_INSTRUCTIONS=AVX2        MKL's instruction ceiling
    ONEDNN_MAX_CPU_ISA=AVX2             oneDNN's JIT kernels (DNNL_ for older names)
    OPENBLAS_CORETYPE=Haswell           numpy's and scikit-learn's OpenBLAS kernels
    OPENBLAS_NUM_THREADS=1              its blocking, whatever the core count

Every stage process gets them from `import stages` (stages/__init__.py runs this first, before
any stage imports torch or numpy); the flow's warm helpers set them before they preload torch
(pipeline/stage_helper.py). A value in the user's shell is overridden: a shell's
`ATEN_CPU_CAPABILITY=default` changes no output. `SHIFTLAB_NATIVE_CPU=1` leaves the libraries
their native choice (faster on some machines, not byte-identical across them). A CPU without
AVX2 runs its own, lower, paths: its bytes can differ. CUDA runs are not bit-identical to CPU
runs (runtime.deterministic keeps a GPU run repeatable on its own kind of device).
"""

from __future__ import annotations

import os

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
}
NATIVE = "SHIFTLAB_NATIVE_CPU"


def pin() -> str:
    """Set PINNED in this process's environment (and so its children's), unless NATIVE is set;
    what config.json records as the CPU code path: "avx2 (pinned)" or "native"."""
    if os.environ.get(NATIVE, "").strip() not in ("", "0"):
        return "native"
    os.environ.update(PINNED)
    return "avx2 (pinned)"


def code_path() -> str:
    """The CPU code path this process runs (what `pin` chose)."""
    pinned = all(os.environ.get(k) == v for k, v in PINNED.items())
    return "avx2 (pinned)" if pinned else "native"
