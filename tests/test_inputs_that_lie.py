"""Issue 17, "inputs that lie": what the bad-inputs table (tests/test_bad_inputs.py) cannot show.

- `dvc exp run -S <bad value>` is refused while DVC composes params.yaml (our Hydra plugin's
  resolver validates the composed config), before params.yaml is written or any stage runs —
  so no output is deleted. The real `dvc exp run`, in a throw-away git + DVC copy.
- A divergence stops at the first non-finite loss or weight, and leaves no checkpoint to
  resume into it (`fit_loop`), even after checkpoints were written.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.workspace import copy_project
from stages.core.checkpoint import Checkpointer
from stages.models.training import FitOptions, NonFiniteLoss, SplitData, evaluate_splits, fit_loop
from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]


def sh(*cmd: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(), text=True, capture_output=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def digest(root: Path) -> dict[str, str]:
    files = [root / "params.yaml", *sorted(p for p in (root / "data").rglob("*") if p.is_file())]
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_dvc_exp_run_with_an_invalid_value_is_refused_before_params_yaml_or_any_output_changes(tmp_path):
    copy_project(ROOT, tmp_path)
    model = tmp_path / "data" / "models" / "gaussian_shortcut" / "erm" / "seed=0"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"the last good weights")
    sh("git", "init", "-q", cwd=tmp_path)
    sh("git", "add", "-A", cwd=tmp_path)
    sh("git", "commit", "-qm", "init", cwd=tmp_path)
    before = digest(tmp_path)

    proc = sh("dvc", "exp", "run", "-S", "method.erm.lr=abc", cwd=tmp_path, check=False)

    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "method.erm.lr: Value 'abc'" in out and "params.yaml is not written and no stage runs" in out, out
    assert "Running stage" not in out, out
    assert digest(tmp_path) == before  # params.yaml and the model folder keep their bytes
    assert sh("git", "status", "--porcelain", "--", "params.yaml", cwd=tmp_path).stdout == ""


# ---- non-finite training ------------------------------------------------------------------------


def tiny_problem() -> tuple[torch.nn.Module, dict[str, SplitData]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    y = (x[:, 0] > 0).long()
    splits = {name: SplitData(x=x, y=y, g=y.clone()) for name in ("train", "val")}
    return torch.nn.Linear(3, 2), splits


def run(model: torch.nn.Module, splits: dict[str, SplitData], step, checkpoint: Checkpointer | None = None):  # noqa: ANN001, ANN201
    """fit_loop over 5 epochs of 4 batches (64 rows, batch 16)."""
    opts = FitOptions(lr=0.01, epochs=5, batch_size=16, selection="val_avg")
    return fit_loop(model, splits, splits["train"].tensors(), step, lambda: evaluate_splits(model, splits), opts,
                    torch.Generator().manual_seed(0), checkpoint=checkpoint)


def test_a_nan_after_two_checkpoints_stops_at_once_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, splits = tiny_problem()
    calls = []

    def step(batch):  # noqa: ANN001, ANN202
        calls.append(1)
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        return loss * float("nan") if len(calls) == 2 * 4 + 2 else loss  # epoch 3, batch 2 (4 batches an epoch)

    saved = []
    checkpoint = Checkpointer(stage="train@t-erm-0", fingerprint={"config": "c", "inputs": "i", "code": "k"}, every=1,
                              log=lambda text: None)
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda epoch, *a: saved.append(epoch) or save(epoch, *a))
    with pytest.raises(NonFiniteLoss) as info:
        run(model, splits, step, checkpoint)
    assert (info.value.epoch, info.value.batch, info.value.what) == (3, 2, "loss")
    assert saved == [1, 2]  # the epochs before it were checkpointed ...
    assert not checkpoint.folder.exists()  # ... and nothing is left to resume into the divergence
    assert len(calls) == 10  # stopped at the first NaN, not after the remaining epochs
    info.value.where, info.value.key, info.value.lr = "train@t-erm-0", "method.erm.lr", 0.01
    assert str(info.value) == (
        "train@t-erm-0: non-finite loss (nan) at epoch 3, batch 2; training diverged: lower method.erm.lr (now 0.01) "
        "and run again (no output was written and this run's checkpoints were deleted)"
    )


def test_weights_that_turn_non_finite_on_an_epochs_last_step_stop_before_they_are_scored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, splits = tiny_problem()
    calls, scored = [], []

    def step(batch):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 4:  # the last batch of epoch 1: a finite loss, a NaN gradient
            model.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    opts = FitOptions(lr=0.01, epochs=5, batch_size=16, selection="val_avg")
    with pytest.raises(NonFiniteLoss) as info:
        fit_loop(model, splits, splits["train"].tensors(), step, lambda: scored.append(1) or evaluate_splits(model, splits),
                 opts, torch.Generator().manual_seed(0))
    assert (info.value.epoch, info.value.batch, info.value.what) == (1, 4, "weights")
    assert not scored  # NaN weights are never scored, selected or checkpointed
    assert "non-finite weights (nan) at epoch 1, batch 4" in str(info.value)
