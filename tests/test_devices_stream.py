"""The runtime section (device, precision, threads, determinism) and the streaming reader (stages/core/stream.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages import evaluate, train
from stages.core import runtime
from stages.core.artifacts import (
    metrics_path,
    model_dir,
    predictions_path,
    prepared_path,
    prepared_schema,
    read_prepared,
)
from stages.core.io import ArtifactError, numpy_to_fixed_list, read_json, write_parquet_stream
from stages.core.settings import RuntimeConfig
from stages.core.stream import PreparedFile, to_input
from stages.models import CONFIG, WEIGHTS
from stages.models.nets import Standardize
from tests.support import project_env

REPO = Path(__file__).resolve().parents[1]
DS = "tiny_images"
SHAPE = (3, 8, 8)
SIZES = {"train": 600, "val": 200, "test_id": 200, "test_ood": 200}


def write_images(root: Path, row_group: int = 64, seed: int = 0) -> Path:
    """A uint8 image dataset whose class brightens the top half and whose attribute (agreeing with the
    label 90 % of the time in training, 10 % in test_ood) brightens the left half; the splits are
    interleaved across row groups of `row_group` rows, as a real loader's shuffled file would be."""
    rng = np.random.default_rng(seed)
    split = np.concatenate([[s] * n for s, n in SIZES.items()])
    rng.shuffle(split)
    n = len(split)
    y = rng.integers(0, 2, n)
    rho = np.where(split == "test_ood", 0.1, 0.9)
    a = np.where(rng.random(n) < rho, y, 1 - y)
    img = rng.integers(0, 120, (n, *SHAPE)).astype(np.int64)
    img[:, :, :4, :] += 60 * y[:, None, None, None]
    img[:, :, :, :4] += 60 * a[:, None, None, None]
    x = np.clip(img, 0, 255).astype(np.uint8).reshape(n, -1)
    path = root / prepared_path(DS)
    with write_parquet_stream(path, prepared_schema(x.shape[1], "uint8"), row_group_size=row_group) as (out, meta):
        for i in range(0, n, 100):  # written in pieces, as a loader does
            out.write(pa.table({"id": np.arange(i, min(i + 100, n), dtype=np.int64), "split": split[i : i + 100],
                                "y": y[i : i + 100], "a": a[i : i + 100], "g": (2 * y + a)[i : i + 100],
                                "x": numpy_to_fixed_list(x[i : i + 100], pa.uint8())}))
        meta.update(dataset=DS, kind=DS, n_classes=2, n_attrs=2, shape=list(SHAPE), x_dtype="uint8")
    return path


@pytest.fixture
def images(tmp_path, monkeypatch):
    """tmp_path as the repo root: params.yaml copied in, the uint8 image file written."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    write_images(tmp_path)
    yield tmp_path
    runtime.use(runtime.DEFAULT)  # a stage run in-process leaves its runtime behind


FAST = ["method.erm.epochs=3", "method.erm.hidden=[16]", "method.erm.batch_size=64"]


# ---- the runtime section ------------------------------------------------------------------------


def test_cuda_on_a_machine_without_it_is_one_line_before_any_work(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for one without it")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")  # and no data at all: nothing is read first
    proc = subprocess.run([sys.executable, "-m", "stages.train", DS, "erm", "0", "runtime.device=cuda"], cwd=tmp_path,
                          env={**project_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "runtime.device=cuda: this machine has no CUDA device" in lines[0] and "runtime.device=cpu" in lines[0]
    assert not (tmp_path / "data").exists() and not (tmp_path / "scratch").exists()


def test_make_check_refuses_cuda_where_there_is_none(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for one without it")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    proc = subprocess.run([sys.executable, "-m", "stages.core.config", "check", "runtime.device=cuda"], cwd=tmp_path,
                          env={**project_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "runtime.device=cuda" in proc.stderr


def test_auto_takes_the_cpu_without_cuda_and_threads_zero_takes_every_core():
    cfg = RuntimeConfig(device="auto", precision="fp32", threads=0, deterministic=True, stream=False,
                        shuffle_buffer=64, workers=0)
    rt = runtime.resolve(cfg)
    assert rt.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert rt.threads == runtime.available_cores() >= 1


@pytest.mark.parametrize(("override", "key"), [
    ("runtime.device=tpu", "runtime.device"), ("runtime.device=cuda:x", "runtime.device"),
    ("runtime.precision=fp8", "runtime.precision"), ("runtime.threads=-1", "runtime.threads"),
    ("runtime.shuffle_buffer=0", "runtime.shuffle_buffer"),
])
def test_bad_runtime_values_name_the_key(images, capsys, override, key):
    assert train.main([DS, "erm", "0", override]) == 2
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1, err


def test_config_json_records_the_runtime_and_the_default_is_deterministic(images):
    assert train.main([DS, "erm", "0", *FAST]) == 0
    first = (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes()
    record = read_json(model_dir(DS, "erm", 0) / CONFIG)["runtime"]
    assert record["device"] == "cpu" and record["precision"] == "fp32" and record["threads"] == 1
    assert record["deterministic"] is True and record["stream"] is False and record["torch"] == torch.__version__
    assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    shutil.rmtree(model_dir(DS, "erm", 0))
    assert train.main([DS, "erm", "0", *FAST]) == 0
    assert (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes() == first


def test_bf16_autocast_really_runs_in_bf16_and_still_learns(images):
    assert train.main([DS, "erm", "0", *FAST]) == 0
    fp32 = read_json(model_dir(DS, "erm", 0) / CONFIG)
    fp32_weights = (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes()
    assert train.main([DS, "erm", "0", *FAST, "runtime.precision=bf16", "runtime.threads=2"]) == 0
    bf16 = read_json(model_dir(DS, "erm", 0) / CONFIG)
    assert bf16["runtime"]["precision"] == "bf16" and bf16["runtime"]["threads"] == 2
    assert (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes() != fp32_weights  # autocast changed the arithmetic
    assert bf16["metrics"]["val"]["acc"] > 0.75 and abs(bf16["metrics"]["val"]["acc"] - fp32["metrics"]["val"]["acc"]) < 0.05


# ---- streaming ----------------------------------------------------------------------------------


def test_stream_epochs_visit_every_row_once_in_a_seeded_order(tmp_path):
    f = PreparedFile.open(write_images(tmp_path))
    assert f.n_row_groups == 1200 // 64 + 1 and f.n_groups == 4
    train_split = f.splits(["train"])["train"]

    def order(seed: int, workers: int, buffer: int = 150) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        batches = list(train_split.epoch(32, g, shuffle_buffer=buffer, workers=workers))
        assert all(len(b["index"]) == 32 for b in batches[:-1]) and 0 < len(batches[-1]["index"]) <= 32
        for b in batches:  # every tensor of a batch is the same rows
            assert torch.equal(b["y"], train_split.y[b["index"]]) and b["x"].dtype == torch.uint8
        return torch.cat([b["index"] for b in batches]).tolist()

    first = order(0, workers=2)
    assert sorted(first) == list(range(SIZES["train"]))  # each row exactly once
    assert order(0, workers=0) == first  # decoding threads never change the order
    assert order(1, workers=2) != first and order(0, workers=1, buffer=10_000) != first
    assert first != sorted(first)


def test_streamed_inputs_equal_the_in_memory_reader_and_standardise_alike(tmp_path):
    path = write_images(tmp_path)
    f, whole = PreparedFile.open(path), read_prepared(path)
    for name, split in f.splits(["train", "test_ood"]).items():
        streamed = torch.cat([to_input(x) for x in split.x_batches(50, workers=1)])
        assert torch.equal(streamed, torch.from_numpy(whole.subset(name).x))  # uint8 / 255, bit for bit
    train_split = f.splits(["train"])["train"]
    s = Standardize(int(np.prod(SHAPE))).fit_batches(to_input(x) for x in train_split.x_batches(37))
    ref = Standardize(int(np.prod(SHAPE))).fit(torch.from_numpy(whole.subset("train").x))
    assert torch.allclose(s.mean, ref.mean, atol=1e-6) and torch.allclose(s.std, ref.std, atol=1e-6)


def test_erm_trains_from_the_stream_deterministically_and_learns(images):
    args = [DS, "erm", "0", *FAST, "runtime.stream=true", "runtime.shuffle_buffer=200"]
    assert train.main(args) == 0
    config = read_json(model_dir(DS, "erm", 0) / CONFIG)
    assert config["runtime"]["stream"] is True
    assert config["metrics"]["val"]["acc"] > 0.75  # the class is visible: streamed training learns it
    first = (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes()
    shutil.rmtree(model_dir(DS, "erm", 0))
    assert train.main([*args, "runtime.workers=0"]) == 0
    assert (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes() == first


def test_a_method_that_cannot_stream_reads_the_file_whole_and_says_so(images):
    assert train.main([DS, "lda", "0", "runtime.stream=true"]) == 0
    assert read_json(model_dir(DS, "lda", 0) / CONFIG)["runtime"]["stream"] is False  # what it actually did
    assert train.main([DS, "erm", "0", *FAST, "runtime.stream=true"]) == 0
    assert read_json(model_dir(DS, "erm", 0) / CONFIG)["runtime"]["stream"] is True
    with pytest.raises(ArtifactError, match=r"reads the whole `x` column into memory, which runtime.stream=true does not do"):
        _ = PreparedFile.open(prepared_path(DS)).x  # the guard a method that claims to stream would hit


def test_a_corrupt_value_in_a_streamed_float_file_names_row_and_id(tmp_path):
    path = tmp_path / "f.parquet"
    x = np.zeros((10, 4), dtype=np.float32)
    x[7, 2] = np.nan
    with write_parquet_stream(path, prepared_schema(4), row_group_size=4) as (out, meta):
        out.write(pa.table({"id": np.arange(100, 110), "split": ["train"] * 10, "y": np.zeros(10, np.int64),
                            "a": np.zeros(10, np.int64), "g": np.zeros(10, np.int64), "x": numpy_to_fixed_list(x)}))
        meta.update(dataset="f", n_classes=2, n_attrs=2, shape=[4])
    split = PreparedFile.open(path).splits(["train"])["train"]
    with pytest.raises(ArtifactError, match=r"NaN or inf values, first at row 7 \(id 107\)"):
        list(split.x_batches(3, workers=1))


def test_evaluate_streamed_writes_the_same_bytes_as_in_memory(images):
    assert train.main([DS, "erm", "0", *FAST, "runtime.stream=true"]) == 0
    outputs = (predictions_path(DS, "erm", 0), metrics_path(DS, "erm", 0))
    assert evaluate.main([DS, "erm", "0", *FAST, "evaluate.batch_size=96"]) == 0
    in_memory = [p.read_bytes() for p in outputs]
    assert evaluate.main([DS, "erm", "0", *FAST, "evaluate.batch_size=96", "runtime.stream=true"]) == 0
    assert [p.read_bytes() for p in outputs] == in_memory


# ---- the optimiser of the published ResNet-50 recipes --------------------------------------------


def test_sgd_trains_learns_and_resumes_byte_identically(images):
    sgd = [*FAST, "method.erm.epochs=4", "method.erm.optimizer=sgd", "method.erm.lr=0.05", "method.erm.weight_decay=0.0001"]
    assert train.main([DS, "erm", "0", *sgd]) == 0
    config = read_json(model_dir(DS, "erm", 0) / CONFIG)
    assert config["config"]["optimizer"] == "sgd" and config["metrics"]["val"]["acc"] > 0.75
    whole = (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes()
    shutil.rmtree(model_dir(DS, "erm", 0))
    env = {**project_env(), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "stages.train", DS, "erm", "0", *sgd]
    stopped = subprocess.run(cmd, cwd=images, env={**env, "SHIFTLAB_FAULT": "interrupt_after_epoch:2"},
                             capture_output=True, text=True, timeout=300)
    assert stopped.returncode != 0 and "resume" in stopped.stderr and not model_dir(DS, "erm", 0).exists()
    resumed = subprocess.run(cmd, cwd=images, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert (model_dir(DS, "erm", 0) / WEIGHTS).read_bytes() == whole  # SGD's momentum buffers were checkpointed
