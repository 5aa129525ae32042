"""text_erm, the discriminative text baseline: learning, save/load, the train/evaluate stages, bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from stages import distill, evaluate, prepare, train
from stages.core import io, registry
from stages.core.artifacts import (
    SPLITS,
    Prepared,
    metrics_path,
    model_dir,
    predictions_path,
    prepared_schema_for,
    read_prepared,
)
from stages.core.config import ConfigError, check_all, defaults, load_params
from stages.core.io import ArtifactError, load_weights, read_json, save_weights
from stages.core.text import build_vocab
from stages.models import CONFIG, WEIGHTS, load_model, save_model
from stages.models.text import TextClassifier
from stages.models.text_erm import train_text

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ["--params", str(ROOT / "params.yaml")]
SMALL_TEXT = defaults("dataset", "shortcut_text", n_train=800, n_val=200, n_test_id=200, n_test_ood=200)
FAST = defaults("method", "text_erm", epochs=12, max_len=12, dim=16, selection="val_avg")


def shortcut_text(path: Path, cfg: Any = SMALL_TEXT) -> Prepared:
    """The real shortcut_text generator's output, written and read back as a prepared file."""
    table, meta = prepare.prepare("shortcut_text", cfg)
    io.write_parquet(table, path, prepared_schema_for(meta), meta)
    return read_prepared(path)


def accuracy(model: torch.nn.Module, p: Prepared) -> dict[str, float]:
    pred = model.logits(p.text).argmax(1)
    return {s: float(np.mean(pred[p.mask(s)] == p.y[p.mask(s)])) for s in SPLITS}


def test_text_erm_learns_shortcut_text_with_a_train_only_vocabulary(tmp_path: Path) -> None:
    """Fixed seed: well above chance on val, and (order-blind bag of words) leans on the marker word."""
    p = shortcut_text(tmp_path / "t.parquet")
    first_val = int(np.flatnonzero(p.mask("val"))[0])
    p.text[first_val] = p.text[first_val] + " zzzonlyinval"  # a word no train sentence has
    model, result = train_text(p, FAST, seed=0)
    assert model.vocab == build_vocab(p.text[p.mask("train")], FAST.vocab_size)
    assert "zzzonlyinval" not in model.vocab and {"not", "anyway", "indeed"} <= set(model.vocab)
    acc = accuracy(model, p)
    assert acc["val"] > 0.9 and acc["test_id"] > 0.9  # chance 0.5; the marker alone gives 0.95
    assert acc["test_ood"] < acc["test_id"] - 0.1  # the marker flips in test_ood
    # the selected epoch's recorded metrics are the returned model's
    assert result.selected_metrics["val"]["acc"] == pytest.approx(acc["val"])
    assert 1 <= result.selected_epoch <= FAST.epochs
    assert result.history.num_rows == FAST.epochs * len(SPLITS)
    again, _ = train_text(p, FAST, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_text_erm_reads_only_the_splits_it_declares(tmp_path: Path) -> None:
    """Garbage text and labels in test_id/test_ood leave the weights bit-identical (train-only vocabulary)."""
    cfg = dataclasses.replace(FAST, epochs=3)
    assert cfg.reads_splits() == ("train", "val")
    p = shortcut_text(tmp_path / "t.parquet", defaults("dataset", "shortcut_text", n_train=200, n_val=60, n_test_id=60, n_test_ood=60))
    clean, _ = train_text(p, cfg, seed=0)
    rng = np.random.default_rng(5)
    unread = np.isin(p.split, ["test_id", "test_ood"])
    text, y = p.text.copy(), p.y.copy()
    text[unread] = [" ".join(rng.choice(["zz", "not", "qq", "great"], 6)) for _ in range(unread.sum())]
    y[unread] = rng.integers(0, 2, unread.sum())
    poisoned, _ = train_text(dataclasses.replace(p, text=text, y=y, g=y * 2 + p.a), cfg, seed=0)
    assert poisoned.vocab == clean.vocab
    assert all(torch.equal(a, b) for a, b in zip(clean.state_dict().values(), poisoned.state_dict().values(), strict=True))


def test_text_model_round_trips_through_safetensors(tmp_path: Path) -> None:
    """load_model rebuilds vocabulary and architecture from model.safetensors alone: identical logits."""
    p = shortcut_text(tmp_path / "t.parquet", defaults("dataset", "shortcut_text", n_train=200, n_val=60, n_test_id=60, n_test_ood=60))
    model, result = train_text(p, dataclasses.replace(FAST, epochs=2, hidden=[8]), seed=1)
    save_model(tmp_path / "m", model, {"method": "text_erm"}, result.history)
    loaded = load_model(tmp_path / "m")
    assert "text" in registry.model_kinds() and isinstance(loaded, TextClassifier)
    assert loaded.kind == "text" and loaded.input == "text" and loaded.vocab == model.vocab
    texts = [*p.text, "", "words the model never saw", "NOT   great, indeed!"]
    assert np.array_equal(loaded.logits(texts), model.logits(texts))
    # Another batch size may round the last bit differently (the CPU's GEMM kernels block by
    # batch: seen on AVX-512 machines), not more.
    np.testing.assert_allclose(loaded.logits(texts, batch_size=7), model.logits(texts), rtol=1e-6, atol=1e-7)
    out = loaded.logits(texts)
    assert out.dtype == np.float32 and out.shape == (len(texts), 2) and np.isfinite(out).all()
    with torch.no_grad():  # no tokens: the mean embedding is the zero vector
        empty = loaded.head(loaded.encoder(torch.zeros(1, 16)))[0]
    assert out[len(p.text)].tolist() == empty.tolist()
    cost = read_json(tmp_path / "m" / CONFIG)["inference_cost"]
    assert cost == {"params": sum(t.numel() for t in model.state_dict().values()), "macs": 16 * 8 + 8 * 2,
                    "forward_passes": 1}
    # metadata that does not describe a text model is an ArtifactError naming the file
    tensors, meta = load_weights(tmp_path / "m" / WEIGHTS)
    save_weights(tensors, tmp_path / "bad" / WEIGHTS, meta={**meta, "vocab": "not a list"})
    with pytest.raises(ArtifactError, match=r"bad/model.safetensors: metadata does not describe a text model"):
        load_model(tmp_path / "bad")
    save_weights(tensors, tmp_path / "short" / WEIGHTS, meta={**meta, "vocab": meta["vocab"][:-1]})
    with pytest.raises(ArtifactError, match=r"short/model.safetensors: tensor 'embed.weight'"):
        load_model(tmp_path / "short")


def test_train_evaluate_and_distill_stages_on_a_text_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real stage functions on a tiny prepared shortcut_text: evaluate feeds the model `text`."""
    monkeypatch.chdir(tmp_path)
    small = [f"dataset.shortcut_text.{k}={n}" for k, n in (("n_train", 300), ("n_val", 100), ("n_test_id", 100), ("n_test_ood", 100))]
    assert prepare.main(["shortcut_text", *small, *PARAMS]) == 0
    tiny = ["method.text_erm.epochs=6", "method.text_erm.max_len=12", "method.text_erm.selection=val_avg"]
    assert train.main(["shortcut_text", "text_erm", "0", *tiny, *PARAMS]) == 0
    folder = model_dir("shortcut_text", "text_erm", 0)
    config = read_json(folder / CONFIG)
    assert config["config"]["kind"] == "text_erm" and config["reads_splits"] == ["train", "val"]
    assert config["architecture"]["kind"] == "text" and config["architecture"]["max_len"] == 12
    assert config["architecture"]["vocab_words"] == len(load_model(folder).vocab)
    assert config["selection"] == "val_avg" and set(config["selections"]) == {"val_avg", "val_worst_group", "oracle"}
    assert config["metrics"]["val"]["acc"] > 0.8
    assert not (tmp_path / "scratch" / "checkpoints" / "train@shortcut_text-text_erm-0").exists()  # cleared
    assert evaluate.main(["shortcut_text", "text_erm", "0", *tiny, *PARAMS]) == 0
    metrics = read_json(metrics_path("shortcut_text", "text_erm", 0))
    assert metrics["model_config"]["kind"] == "text_erm" and metrics["cost"]["parameters"] > 0
    predictions = pq.read_table(predictions_path("shortcut_text", "text_erm", 0))
    p = read_prepared(tmp_path / "data" / "prepared" / "shortcut_text.parquet")
    assert np.array_equal(predictions.column("pred").to_numpy(), load_model(folder).logits(p.text).argmax(1))
    assert metrics["splits"]["val"]["acc"] == pytest.approx(config["metrics"]["val"]["acc"])
    # a text teacher's soft labels train the (bag-of-words x) student
    assert distill.main(["shortcut_text", "text_erm", "0", "distill.epochs=1", *tiny, *PARAMS]) == 0


def test_text_erm_on_a_dataset_without_text_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before any training (train stage), and already in `stages.core.config check` for a non-text dataset kind."""
    monkeypatch.chdir(tmp_path)
    small = [f"dataset.gaussian_shortcut.{k}={n}" for k, n in (("n_train", 40), ("n_val", 20), ("n_test_id", 20), ("n_test_ood", 20))]
    assert prepare.main(["gaussian_shortcut", *small, *PARAMS]) == 0
    capsys.readouterr()
    assert train.main(["gaussian_shortcut", "text_erm", "0", *PARAMS]) == 2
    err = capsys.readouterr().err
    assert "method.text_erm" in err and "'gaussian_shortcut'" in err and "text" in err
    assert not model_dir("gaussian_shortcut", "text_erm", 0).exists()
    assert not (tmp_path / "scratch").exists()  # stopped before the training loop started
    params = load_params(ROOT / "params.yaml", ["run.methods=[erm,text_erm]", "run.teachers=[]", "run.models=[erm,text_erm]"])
    with pytest.raises(ConfigError, match=r"method.text_erm .*dataset 'gaussian_shortcut'"):
        check_all(params)
    text_only = load_params(ROOT / "params.yaml", ["run.datasets=[shortcut_text]", "run.methods=[erm,text_erm]",
                                                   "run.teachers=[]", "run.models=[erm,text_erm]"])
    assert check_all(text_only).methods == ["erm", "text_erm"]


def test_text_erm_training_stopped_mid_run_resumes_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """text_erm checkpoints like erm: SIGINT after epoch 2 writes one; the rerun resumes and matches a clean run."""
    monkeypatch.chdir(tmp_path)
    small = [f"dataset.shortcut_text.{k}={n}" for k, n in (("n_train", 200), ("n_val", 60), ("n_test_id", 60), ("n_test_ood", 60))]
    assert prepare.main(["shortcut_text", *small, *PARAMS]) == 0
    args = ["shortcut_text", "text_erm", "0", "method.text_erm.epochs=4", "method.text_erm.max_len=12"]
    folder = model_dir("shortcut_text", "text_erm", 0)
    assert train.main([*args, "train.resume=false", *PARAMS]) == 0
    clean = {name: (folder / name).read_bytes() for name in (WEIGHTS, "history.parquet")}
    monkeypatch.setenv("SHIFTLAB_FAULT", "interrupt_after_epoch:2")
    capsys.readouterr()
    assert train.main([*args, *PARAMS]) == 130
    assert "stopped by SIGINT after epoch 2/4" in capsys.readouterr().err
    monkeypatch.delenv("SHIFTLAB_FAULT")
    assert train.main([*args, *PARAMS]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert {name: (folder / name).read_bytes() for name in clean} == clean
