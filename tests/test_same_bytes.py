"""Two machines in one: the stages write the same bytes whatever CPU code paths, thread counts
and cores the environment they start in would give them (stages/core/numerics.py).

Each run is a chain of fresh stage processes on a small gaussian_shortcut (`experiment=tiny`):
prepare, train erm, lda, diffusion and dfr (on erm's features), evaluate each, report. One run
starts each stage as `dvc repro` does (a new interpreter), from a plain environment on this
machine; the other as `make repro`'s flow does (forks of a warm stage helper that imported torch
first: pipeline/stage_helper.py), from an environment that imitates a lesser machine — PyTorch's
generic kernels (`ATEN_CPU_CAPABILITY=default`), MKL and oneDNN capped at SSE4.2, OpenBLAS's
oldest x86-64 kernels, numpy without its AVX-512 loops, four OpenMP/BLAS threads and one core of
affinity. So the two ways the stages start must agree as well as the two machines.
Before the stages pinned their code paths, the second run's erm weights (PyTorch's kernels) and
lda weights (MKL's float64 LAPACK) differed from the first's, and with them every file after.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.stage_helper import StageHelper
from stages.core.numerics import PINNED
from tests.support import project_env

REPO = Path(__file__).resolve().parents[1]
DS = "gaussian_shortcut"
pytestmark = [pytest.mark.slow]

LESSER_MACHINE = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "DNNL_MAX_CPU_ISA": "SSE41",
    "OPENBLAS_CORETYPE": "Prescott",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",  # numpy's AVX-512 loops, as on an AVX2-only CPU
    "OMP_NUM_THREADS": "4",
    "OPENBLAS_NUM_THREADS": "4",
    "MKL_NUM_THREADS": "4",
}


def shell_env() -> dict[str, str]:
    """project_env() as a plain shell gives it: none of the pins, imitations or SHIFTLAB_NATIVE_CPU
    (this test process pinned its own environment when it imported stages)."""
    env = project_env()
    for key in (*PINNED, *LESSER_MACHINE, "SHIFTLAB_NATIVE_CPU"):
        env.pop(key, None)
    return env


def python_m(module: str, args: list[str], cwd: str, env: dict[str, str]) -> tuple[int, str]:
    """`python -m <module> <args>` in a new interpreter, as `dvc repro` starts a stage: exit code
    and output, as StageHelper.run_module gives them for a fork."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, text=True, capture_output=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def run_chain(root: Path, env: dict[str, str], lesser: bool) -> dict[str, str]:
    """The stages, each in a fresh process; {output file: sha256} of everything they wrote.
    `lesser`: forked from a stage helper started in `env`, on one core; else `python -m` each."""
    shutil.copytree(REPO / "conf", root / "conf")
    params = root / "params.yaml"
    steps = [
        ["stages.core.config", "compose", "--params", str(params), "experiment=tiny", f"run.datasets=[{DS}]",
         "run.methods=[erm,lda,diffusion,dfr]", "run.teachers=[]"],
        ["stages.prepare", DS],
        *(["stages.train", DS, m, "0"] for m in ("erm", "lda", "diffusion", "dfr")),
        *(["stages.evaluate", DS, m, "0"] for m in ("erm", "lda", "diffusion", "dfr")),
        ["stages.report"],
    ]
    env = {**env, "PYTHONPATH": str(REPO)}
    with contextlib.ExitStack() as stack:
        run = python_m
        if lesser:
            helper = stack.enter_context(StageHelper(str(root), env))
            os.sched_setaffinity(helper.start().pid, {min(os.sched_getaffinity(0))})  # its forks inherit it
            run = helper.run_module
        for module, *args in steps:
            args += ["--params", str(params)] if module != "stages.core.config" else []
            code, out = run(module, args, str(root), env)
            assert code == 0, f"{module} {' '.join(args)}:\n{out[-4000:]}"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "data").rglob("*")) if p.is_file()
    }


def test_the_stages_write_the_same_bytes_on_a_lesser_machine(tmp_path: Path) -> None:
    plain = shell_env()
    here = run_chain(tmp_path / "here", plain, lesser=False)
    there = run_chain(tmp_path / "there", {**plain, **LESSER_MACHINE}, lesser=True)
    models = [f for f in here if f.endswith("model.safetensors")]
    assert len(models) == 4 and any(f.endswith("report.html") for f in here)
    differ = sorted(f for f in here if here[f] != there.get(f))
    assert not differ and set(here) == set(there), differ


# A stage's numerical work: a convolution (oneDNN's, unless turned off) and a matrix product
# (MKL's SGEMM), forward and backward, after `import stages` and `setup_torch` as every stage does.
KERNELS = """
import stages, torch
from stages.core.runtime import setup_torch
setup_torch(0)
conv = torch.nn.Conv2d(3, 8, 3)
loss = (conv(torch.randn(16, 3, 12, 12)).flatten(1) @ torch.randn(8 * 10 * 10, 4)).sum()
loss.backward()
"""


def kernel_log(native: bool) -> str:
    """What MKL and oneDNN report running KERNELS in a fresh process (their verbose modes)."""
    env = shell_env()
    env.update(MKL_VERBOSE="1", ONEDNN_VERBOSE="1", **({"SHIFTLAB_NATIVE_CPU": "1"} if native else {}))
    proc = subprocess.run([sys.executable, "-c", KERNELS], cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_mkl_runs_its_vendor_neutral_branch_and_onednn_runs_nothing():
    """The pins hold on this very CPU, whatever its vendor: MKL runs the COMPATIBLE branch it was
    given (its AVX2 branch is Intel's only: on an AMD EPYC MKL silently ran AUTO, `CNR:AUTO`, and
    every weight differed from the committed dvc.lock's), and oneDNN, whose blocking follows the
    CPU's cache sizes, executes no primitive. With SHIFTLAB_NATIVE_CPU=1 the same code does use
    oneDNN and MKL's own choice, so the check can tell the two apart."""
    pinned = kernel_log(native=False)
    branches = set(re.findall(r"MKL_VERBOSE SGEMM\(.*?CNR:(\S+)", pinned))
    assert branches == {"COMPATIBLE"}, branches
    assert not re.search(r"onednn_verbose.*,exec,", pinned)
    native = kernel_log(native=True)
    assert re.search(r"onednn_verbose.*,exec,cpu,convolution", native)
    assert "CNR:COMPATIBLE" not in native


def test_onednn_stays_on_only_for_a_run_on_every_core(monkeypatch):
    """`runtime.threads: 0` (the real-data recipes) gives other bytes on a machine with another core
    count anyway, so it keeps oneDNN's speed; a fixed thread count (the default: one) turns it off."""
    import torch

    from stages.core import runtime
    from stages.core.config import configure_runtime, load_params

    monkeypatch.delenv("SHIFTLAB_NATIVE_CPU", raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    previous, torch_threads = runtime.current(), torch.get_num_threads()
    try:
        for threads, onednn in ((0, True), (1, False), (0, True)):
            rt = configure_runtime(load_params(REPO / "params.yaml", [f"runtime.threads={threads}"]))
            assert rt.all_cores is (threads == 0) and rt.threads >= 1
            runtime.setup_torch(0)
            assert torch.backends.mkldnn.enabled is onednn
    finally:  # this test process's runtime and thread count as they were (mkldnn: monkeypatch)
        runtime.use(previous)
        torch.set_num_threads(torch_threads)
