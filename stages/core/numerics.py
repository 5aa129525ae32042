"""Same bytes on any x86-64 CPU: the numerical libraries' code paths, pinned by the stage process.

PyTorch, MKL, oneDNN and OpenBLAS each pick their kernels by the CPU they run on (AVX-512 on one
machine, AVX2 on another, Intel's or AMD's), and those kernels round differently: the same params
and seed gave different weights on an AVX-512 Xeon than on an AVX2 machine, LDA's float64 closed
form included (MKL's LAPACK), so a clone could not reproduce the committed dvc.lock. `pin()` sets,
in the process's own environment and before torch or numpy is imported, the code path each of
them may use, and one BLAS thread:

    ATEN_CPU_CAPABILITY=avx2            PyTorch's own CPU kernels: AVX2, the floor of the x86-64
                                        machines shiftlab supports
    MKL_CBWR=COMPATIBLE                 MKL's conditional numerical reproducibility branch that
                                        MKL runs on every x86-64 CPU, Intel's and AMD's alike
    MKL_ENABLE_INSTRUCTIONS=AVX2        MKL's instruction ceiling elsewhere
    ONEDNN_MAX_CPU_ISA=AVX2             oneDNN's JIT kernels (DNNL_ for older names)
    OPENBLAS_CORETYPE=Haswell           numpy's and scikit-learn's OpenBLAS kernels
    OPENBLAS_NUM_THREADS=1              its blocking, whatever the core count

MKL's AVX2 branch (`MKL_CBWR=AVX2`) is reproducible on Intel CPUs only: on an AMD EPYC with
AVX-512 MKL silently runs its AUTO branch instead (MKL_VERBOSE prints `CNR:AUTO`), and every
weight differed from the committed dvc.lock's. COMPATIBLE (SSE2 without the approximate
reciprocals, whose results differ between vendors) is the branch MKL documents for the same
results on Intel and non-Intel CPUs. oneDNN has no such mode (it is run-to-run deterministic on
one platform only: its blocking follows the CPU's cache sizes), so `pin_torch()` turns PyTorch's
use of it off at a fixed thread count (the default: one): convolutions then run PyTorch's own
kernels and MKL's GEMM.

Every stage process gets the variables from `import stages` (stages/__init__.py runs this first,
before any stage imports torch or numpy) and `pin_torch()` from `setup_torch`; the flow's warm
helpers set the variables before they preload torch (pipeline/stage_helper.py). A value in the
user's shell is overridden: a shell's `ATEN_CPU_CAPABILITY=default` changes no output.
`SHIFTLAB_NATIVE_CPU=1` leaves the libraries their native choice (faster on some machines, not
byte-identical across them). A CPU without AVX2 runs its own, lower, paths: its bytes can differ.
CUDA runs are not bit-identical to CPU runs (runtime.deterministic keeps a GPU run repeatable on
its own kind of device).
"""

from __future__ import annotations

import os

PINNED = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
}
NATIVE = "SHIFTLAB_NATIVE_CPU"


def pin() -> str:
    """Set PINNED in this process's environment (and so its children's), unless NATIVE is set;
    what config.json records as the CPU code path: "pinned" or "native"."""
    if os.environ.get(NATIVE, "").strip() not in ("", "0"):
        return "native"
    os.environ.update(PINNED)
    return "pinned"


def code_path() -> str:
    """The CPU code path this process runs (what `pin` chose)."""
    pinned = all(os.environ.get(k) == v for k, v in PINNED.items())
    return "pinned" if pinned else "native"


def pin_torch(onednn: bool = False) -> None:
    """Turn PyTorch's oneDNN kernels off unless NATIVE is set or `onednn` keeps them on (see above:
    their results follow the CPU's cache sizes). Called by `setup_torch`, after torch is imported,
    with `onednn` true for `runtime.threads: 0`: a run on every core gives other bytes on a machine
    with another core count anyway, so oneDNN's speed costs it nothing it has (the real-data
    recipes run so; a fixed thread count, the default one, keeps the same bytes on any CPU)."""
    import torch

    torch.backends.mkldnn.enabled = onednn or code_path() == "native"
