"""Kill a stage (SIGKILL) or stop it (SIGINT/SIGTERM) at a chosen point; the re-run ends byte-identical.

Faults come from the test-only hook SHIFTLAB_FAULT (stages/core/io.py `fault_point`), so every
kill lands at the same place each time: `kill_after_epoch:N` (training finished epoch N and
wrote its checkpoint if one was due), `kill_before_rename:<file>` (an atomic write is
complete but not yet renamed into place), `interrupt_`/`term_` for SIGINT/SIGTERM. The faulted
commands are forks of one warm stage helper, as `make repro`'s flow starts its stages; the
re-runs are in-process.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pytest

from pipeline.stage_helper import StageHelper
from stages import evaluate, train
from stages.core import checkpoint
from stages.core.artifacts import (
    metrics_path,
    model_dir,
    plots_dir,
    predictions_path,
    prepared_path,
    prepared_schema,
)
from stages.core.io import numpy_to_fixed_list, write_parquet

# One worker runs the module: its module-scoped fixture is built once, not on each xdist worker.
pytestmark = pytest.mark.xdist_group("kill_resume")

REPO = Path(__file__).resolve().parents[1]
DS = "gaussian_shortcut"
SIZES = {"train": 200, "val": 100, "test_id": 100, "test_ood": 100}
EPOCHS = 4


# Tiny configs. The generative ones score at epochs 3 and 4 only (eval_every=3), so the
# checkpoints of epochs 1-2 that the tests resume from have no best-so-far and a short history.
# groupdro draws its epochs group-balanced and jtt trains on its errors' copies (the published
# recipes): both samplers draw from the loop's generator, which the checkpoint carries.
TINY = {
    "diffusion": ["eval_every=3", "width=16", "steps=20", "draws=4", "select_draws=2", "batch_size=32"],
    "autoregressive": ["eval_every=3", "bins=8", "d_model=16", "ff=32", "batch_size=32"],
    "jtt": ["hidden=[8]", "lr=0.02", "id_epochs=1", "id_epochs_grid=[]", "upweight=10"],
}
RESUMABLE = ("erm", "groupdro", "jtt", "diffusion", "autoregressive")
# An autoregressive model that stops on the plateau test (patience 2) long before its budget.
PLATEAU = ["method.autoregressive.epochs=40", "method.autoregressive.patience=2", "method.autoregressive.eval_every=5",
           *(f"method.autoregressive.{kv}" for kv in ("bins=8", "d_model=16", "ff=32", "batch_size=32", "lr=0.01"))]


def fast(method: str) -> list[str]:
    tiny = TINY.get(method, ["hidden=[8]", "lr=0.02"])
    return [f"method.{method}.epochs={EPOCHS}", *(f"method.{method}.{kv}" for kv in tiny)]


def ckpt_dir(method: str) -> Path:
    return checkpoint.checkpoint_dir(f"train@{DS}-{method}-0")


class Ran(NamedTuple):
    returncode: int
    output: str  # stdout and stderr together, as the flow's log shows a stage's


@pytest.fixture(scope="module")
def stage_helper() -> Iterator[StageHelper]:
    """A warm stage helper (pipeline/stage_helper.py) for the module: each stage command is a fork
    of it, a process of its own as `make repro`'s flow starts a stage, that the faults kill or stop
    for real; started with this process's (pinned) environment, so its bytes are the in-process
    runs'. Each fork skips ~2 s of imports a new interpreter pays (torch, TorchDynamo)."""
    with StageHelper(str(REPO), {**os.environ, "PYTHONPATH": str(REPO)}) as helper:
        yield helper


@pytest.fixture
def run_stage(stage_helper: StageHelper) -> Callable[..., Ran]:
    def run(module: str, *args: str, fault: str | None = None) -> Ran:
        """`python -m stages.<module> ...` in the working directory, optionally with a fault."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "SHIFTLAB_QUIET": "1"}
        env.pop("SHIFTLAB_FAULT", None)
        if fault:
            env["SHIFTLAB_FAULT"] = fault
        return Ran(*stage_helper.run_module(f"stages.{module}", list(args), os.getcwd(), env))

    return run


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def strays(root: Path) -> list[Path]:
    """Temp files/folders of interrupted atomic writes anywhere under root/data."""
    return sorted(p.relative_to(root) for p in (root / "data").rglob(".*") if p.name.endswith(".tmp") or ".old-" in p.name)


def write_tiny_prepared(root: Path) -> Path:
    """A small gaussian-shortcut-like prepared file (core, spurious and 2 noise features), fixed seed."""
    rng = np.random.default_rng(0)
    parts = []
    for split, n in SIZES.items():
        y = rng.integers(0, 2, n)
        a = np.where(rng.random(n) < (0.1 if split == "test_ood" else 0.9), y, 1 - y)
        x = np.column_stack([2 * y - 1 + rng.standard_normal(n), 2 * a - 1 + 0.2 * rng.standard_normal(n),
                             rng.standard_normal((n, 2))]).astype(np.float32)
        parts.append((split, y, a, x))
    y, a, x = (np.concatenate([p[i] for p in parts]) for i in (1, 2, 3))
    table = pa.table({"id": np.arange(len(y), dtype=np.int64), "split": [p[0] for p in parts for _ in p[1]],
                      "y": y, "a": a, "g": 2 * y + a, "x": numpy_to_fixed_list(x)})
    meta = {"dataset": DS, "kind": "tiny_test", "n_classes": 2, "n_attrs": 2, "shape": [4], "rho_train": 0.9, "rho_ood": 0.1}
    return write_parquet(table, root / prepared_path(DS), prepared_schema(4), meta)


def workspace(root: Path) -> Path:
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    write_tiny_prepared(root)
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Model folders of uninterrupted runs of every resumable kind and erm's evaluation, made in their own folder."""
    root = tmp_path_factory.mktemp("reference")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        workspace(root)
        out: dict[str, dict[str, bytes]] = {}
        for method in RESUMABLE:
            assert train.main([DS, method, "0", *fast(method)]) == 0
            assert not ckpt_dir(method).exists(), "a successful stage deletes its checkpoints"
            out[method] = folder_bytes(model_dir(DS, method, 0))
        assert train.main([DS, "autoregressive", "0", *PLATEAU]) == 0
        out["plateau"] = folder_bytes(model_dir(DS, "autoregressive", 0))
        assert evaluate.main([DS, "erm", "0", *fast("erm")]) == 0
        out["evaluate"] = {"predictions": predictions_path(DS, "erm", 0).read_bytes(),
                           "metrics": metrics_path(DS, "erm", 0).read_bytes(), **{
                               f"plots/{k}": v for k, v in folder_bytes(plots_dir(DS, "erm", 0)).items()}}
        return out
    finally:
        os.chdir(cwd)


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return workspace(tmp_path)


@pytest.mark.parametrize("method", RESUMABLE)
def test_sigkill_mid_training_then_rerun_resumes_byte_identical(work, reference, method, capsys, run_stage):
    killed = run_stage("train", DS, method, "0", *fast(method), fault="kill_after_epoch:2")
    assert killed.returncode == -signal.SIGKILL
    assert not model_dir(DS, method, 0).exists() and strays(work) == []
    assert sorted(p.name for p in ckpt_dir(method).iterdir()) == ["epoch-000001.safetensors", "epoch-000002.safetensors"]

    capsys.readouterr()
    assert train.main([DS, method, "0", *fast(method)]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {ckpt_dir(method)}/epoch-000002.safetensors (epoch 2)" in err
    assert folder_bytes(model_dir(DS, method, 0)) == reference[method]
    assert not ckpt_dir(method).exists()


def test_a_run_stopped_on_the_plateau_resumes_to_the_same_stop(work, reference, capsys, run_stage):
    """Killed mid-training, or after the epoch the plateau test stopped it at (its folder written but
    not renamed, that epoch's checkpoint kept): the re-run stops at the same epoch, byte-identical,
    and never trains past it."""
    config = json.loads(reference["plateau"]["config.json"])
    stop = config["final_epoch"]
    assert config["convergence"]["stopped"] == "plateau" and stop < 40 and config["convergence"]["flag"] == "plateaued"
    assert run_stage("train", DS, "autoregressive", "0", *PLATEAU, fault="kill_after_epoch:5").returncode == -signal.SIGKILL
    assert train.main([DS, "autoregressive", "0", *PLATEAU]) == 0
    assert "(epoch 5)" in capsys.readouterr().err
    assert folder_bytes(model_dir(DS, "autoregressive", 0)) == reference["plateau"]

    shutil.rmtree(model_dir(DS, "autoregressive", 0))
    killed = run_stage("train", DS, "autoregressive", "0", *PLATEAU, fault="kill_before_rename:seed=0")
    assert killed.returncode == -signal.SIGKILL and (ckpt_dir("autoregressive") / f"epoch-{stop:06d}.safetensors").is_file()
    assert train.main([DS, "autoregressive", "0", *PLATEAU]) == 0
    assert f"(epoch {stop})" in capsys.readouterr().err
    assert folder_bytes(model_dir(DS, "autoregressive", 0)) == reference["plateau"]


@pytest.mark.parametrize(("method", "fault", "sig"), [("erm", "interrupt", signal.SIGINT), ("erm", "term", signal.SIGTERM),
                                                     ("diffusion", "term", signal.SIGTERM)])
def test_sigint_sigterm_write_a_checkpoint_and_exit_nonzero_saying_how_to_resume(work, reference, method, fault, sig, capsys, run_stage):
    # checkpoint_every=0: the only checkpoint is the one the stop request writes.
    stopped = run_stage("train", DS, method, "0", *fast(method), "train.checkpoint_every=0", fault=f"{fault}_after_epoch:2")
    assert stopped.returncode == 128 + sig
    last = stopped.output.strip().splitlines()[-1]
    assert last.startswith(f"train: stopped by {sig.name} after epoch 2/{EPOCHS}; checkpoint ")
    assert "run the same command (or `dvc repro`) again to resume" in last
    assert [p.name for p in ckpt_dir(method).iterdir()] == ["epoch-000002.safetensors"]
    assert not model_dir(DS, method, 0).exists()

    assert train.main([DS, method, "0", *fast(method), "train.checkpoint_every=0"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert folder_bytes(model_dir(DS, method, 0)) == reference[method]
    assert not ckpt_dir(method).exists()


def test_truncated_checkpoint_is_reported_in_one_line_and_the_previous_one_used(work, reference, capsys, run_stage):
    assert run_stage("train", DS, "erm", "0", *fast("erm"), fault="kill_after_epoch:3").returncode == -signal.SIGKILL
    newest = ckpt_dir("erm") / "epoch-000003.safetensors"
    newest.write_bytes(newest.read_bytes()[:300])

    assert train.main([DS, "erm", "0", *fast("erm")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [ln for ln in lines if "ignoring checkpoint" in ln] == [
        f"train: ignoring checkpoint {newest}: not a valid safetensors file (Error while deserializing header: invalid header length)"]
    assert any(f"resuming from {ckpt_dir('erm')}/epoch-000002.safetensors" in ln for ln in lines)
    assert folder_bytes(model_dir(DS, "erm", 0)) == reference["erm"]


class _Trap:
    """Unpickling this creates a file: proof that a checkpoint was (wrongly) unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_checkpoints_of_other_params_other_code_or_a_pickle_are_ignored_never_loaded(work, reference, capsys, monkeypatch, run_stage):
    assert run_stage("train", DS, "erm", "0", *fast("erm"), fault="kill_after_epoch:2").returncode == -signal.SIGKILL
    marker = work / "unpickled"
    (ckpt_dir("erm") / "epoch-000009.safetensors").write_bytes(pickle.dumps(_Trap(str(marker))))

    # Another code version (as if a file of stages/models had changed): every checkpoint is stale.
    real = checkpoint.code_hash
    with monkeypatch.context() as m:
        # another hash: its first hex digit changed (a fixed "0" is no change when the real hash starts with 0)
        m.setattr(checkpoint, "code_hash", lambda paths: ("1" if real(paths)[0] == "0" else "0") + real(paths)[1:])
        assert train.main([DS, "erm", "0", *fast("erm")]) == 0
    err = capsys.readouterr().err
    assert "epoch-000009.safetensors: not a valid safetensors file" in err
    assert err.count("made with another code version") == 2 and "resuming" not in err
    assert not marker.exists()
    assert folder_bytes(model_dir(DS, "erm", 0)) == reference["erm"]

    # Other params: the checkpoint of lr 0.02 is not resumed by a run with lr 0.01.
    assert run_stage("train", DS, "erm", "0", *fast("erm"), fault="kill_after_epoch:2").returncode == -signal.SIGKILL
    capsys.readouterr()
    assert train.main([DS, "erm", "0", *fast("erm"), "method.erm.lr=0.01"]) == 0
    err = capsys.readouterr().err
    assert "epoch-000002.safetensors: made with other params" in err and "resuming" not in err


def test_resume_false_starts_over(work, reference, capsys, run_stage):
    assert run_stage("train", DS, "erm", "0", *fast("erm"), fault="kill_after_epoch:2").returncode == -signal.SIGKILL
    assert train.main([DS, "erm", "0", *fast("erm"), "train.resume=false"]) == 0
    err = capsys.readouterr().err
    assert "train.resume=false: ignoring 2 checkpoint(s)" in err and "resuming" not in err
    assert folder_bytes(model_dir(DS, "erm", 0)) == reference["erm"]


def test_sigkill_mid_parquet_write_keeps_the_old_output_and_the_rerun_cleans_up(work, reference, run_stage):
    assert train.main([DS, "erm", "0", *fast("erm")]) == 0
    path = predictions_path(DS, "erm", 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"the previous predictions")
    # Killed after the new Parquet is complete in its temp file, before the rename.
    killed = run_stage("evaluate", DS, "erm", "0", *fast("erm"), fault=f"kill_before_rename:{path.name}")
    assert killed.returncode == -signal.SIGKILL
    assert path.read_bytes() == b"the previous predictions", "the previous output is untouched"
    [stray] = strays(work)
    assert stray.parent == path.parent and stray.name.startswith(f".{path.name}.") and stray.name.endswith(".tmp")

    # A first write, killed: no output at all, only the stray temp.
    path.unlink()
    assert run_stage("evaluate", DS, "erm", "0", *fast("erm"), fault=f"kill_before_rename:{path.name}").returncode == -signal.SIGKILL
    # That write swept the first killed writer's temp before making its own.
    assert not path.exists() and len(strays(work)) == 1 and strays(work) != [stray]

    assert run_stage("evaluate", DS, "erm", "0", *fast("erm")).returncode == 0
    assert strays(work) == [], "the next write of the output deletes the temps of killed writers"
    assert path.read_bytes() == reference["evaluate"]["predictions"]


def test_sigkill_mid_model_write_and_mid_evaluation_then_rerun_is_byte_identical(work, reference, run_stage):
    # The model folder is complete in its temp folder but not renamed: no model, a stray folder.
    killed = run_stage("train", DS, "erm", "0", *fast("erm"), fault="kill_before_rename:seed=0")
    assert killed.returncode == -signal.SIGKILL
    assert not model_dir(DS, "erm", 0).exists()
    assert [p.parent for p in strays(work)] == [model_dir(DS, "erm", 0).parent]
    resumed = run_stage("train", DS, "erm", "0", *fast("erm"))
    assert resumed.returncode == 0 and f"(epoch {EPOCHS})" in resumed.output
    assert folder_bytes(model_dir(DS, "erm", 0)) == reference["erm"] and strays(work) == []

    # Evaluate killed between its predictions and its metrics: metrics missing, then restored exactly.
    killed = run_stage("evaluate", DS, "erm", "0", *fast("erm"), fault=f"kill_before_rename:{metrics_path(DS, 'erm', 0).name}")
    assert killed.returncode == -signal.SIGKILL
    assert predictions_path(DS, "erm", 0).is_file() and not metrics_path(DS, "erm", 0).exists()
    assert len(strays(work)) == 1
    assert run_stage("evaluate", DS, "erm", "0", *fast("erm")).returncode == 0
    assert strays(work) == []
    assert predictions_path(DS, "erm", 0).read_bytes() == reference["evaluate"]["predictions"]
    assert metrics_path(DS, "erm", 0).read_bytes() == reference["evaluate"]["metrics"]
    for name, data in folder_bytes(plots_dir(DS, "erm", 0)).items():
        assert data == reference["evaluate"][f"plots/{name}"]
