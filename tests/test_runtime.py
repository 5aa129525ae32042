"""What a person reads: progress off a terminal as plain lines, and a stage started by the wrong
Python stopping with one line (stages/__init__.py) instead of a traceback."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.core import runtime
from stages.core.runtime import progress, setup_torch
from stages.models.mlp import MLPClassifier
from stages.models.nets import MLPEncoder, Standardize
from stages.models.training import FitOptions, SplitData, cross_entropy, fit_classifier

REPO = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def stderr(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> pytest.CaptureFixture[str]:
    """stderr as a pipe or a log file would be (not a terminal: pytest's capture), progress not silenced."""
    monkeypatch.delenv("SHIFTLAB_QUIET", raising=False)
    return capsys


def _splits(seed: int = 0, n: int = 200) -> dict[str, SplitData]:
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("train", "val", "test_id", "test_ood"):
        y = rng.integers(0, 2, n)
        a = np.where(rng.random(n) < 0.9, y, 1 - y)
        x = np.column_stack([2 * y - 1 + rng.standard_normal(n), 2 * a - 1 + 0.2 * rng.standard_normal(n)]).astype(np.float32)
        out[name] = SplitData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(y * 2 + a))
    return out


def test_training_off_a_terminal_prints_one_plain_line_per_epoch(stderr: pytest.CaptureFixture[str]) -> None:
    splits = _splits()
    model = MLPClassifier(MLPEncoder(2, [8]), 2, Standardize(2).fit(splits["train"].x))
    fit_classifier(model, splits, cross_entropy, FitOptions(1e-2, 3, 64), setup_torch(0), desc="train erm")
    text = stderr.readouterr().err
    assert not sys.stderr.isatty()
    assert "\r" not in text and "|" not in text  # no bar fragments
    lines = text.splitlines()
    assert len(lines) == 3, text
    for i, line in enumerate(lines, 1):
        # the figures are the loop's set_postfix_str of that epoch
        assert re.fullmatch(rf"train erm: epoch {i}/3, .*val acc \d\.\d{{3}}, worst-group \d\.\d{{3}}.* \[\d+\.\d s\]", line), line


def test_plain_lines_show_a_figure_with_its_step_and_throttle_fine_steps(stderr: pytest.CaptureFixture[str]) -> None:
    bar = progress(range(3), desc="fit", total=3, unit="epoch")
    for epoch in bar:
        if epoch != 1:  # an unscored epoch: no stale figures repeated
            bar.set_postfix_str(f"val acc 0.{epoch}00", refresh=False)
    for _ in progress(iter(range(50)), desc="decode", unit="block"):  # fast steps, no total: the last only
        pass
    lines = [re.sub(r" \[.*\]$", "", x) for x in stderr.readouterr().err.splitlines()]
    assert lines == ["fit: epoch 1/3, val acc 0.000", "fit: epoch 2/3", "fit: epoch 3/3, val acc 0.200", "decode: block 50"]


def test_a_terminal_gets_a_bar_and_quiet_means_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqdm import tqdm

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.delenv("SHIFTLAB_QUIET", raising=False)
    bar = progress(range(2), desc="train", total=2, unit="epoch")
    assert isinstance(bar, tqdm)
    list(bar)
    assert "\r" in term.getvalue() and "epoch" in term.getvalue()

    monkeypatch.setenv("SHIFTLAB_QUIET", "1")
    for stream in (Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = progress(range(2), desc="train", total=2, unit="epoch")
        assert list(bar) == [0, 1]
        bar.set_postfix_str("val acc 1.000")
        assert stream.getvalue() == ""
    assert runtime.PLAIN_EVERY_S > 0


def _python_without_the_project() -> str | None:
    """A Python that lacks the project's packages: the one the venv was made from, or the system's."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pyarrow') is not None)"
    for exe in (Path(sys.base_prefix) / "bin" / "python3", Path("/usr/bin/python3")):
        if exe.is_file() and subprocess.run([str(exe), "-c", check], capture_output=True).returncode == 0:
            return str(exe)
    return None


def test_a_stage_started_by_another_python_stops_with_one_line() -> None:
    exe = _python_without_the_project()
    if exe is None:
        pytest.skip("no Python without pyarrow on this machine")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run([exe, "-m", "stages.train", "gaussian_shortcut", "erm", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pyarrow" in lines[0] and ".venv/bin/python" in lines[0] and "source .venv/bin/activate" in lines[0]
