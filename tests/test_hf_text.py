"""transformers' text networks built from config: BERT for text_erm, GPT-2 for autoregressive.

Tiny sizes on CPU; weights and vocabularies are files the tests write (nothing downloads)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from stages import evaluate, prepare, train
from stages.core import io
from stages.core.artifacts import SPLITS, Prepared, model_dir, prepared_schema_for, read_prepared
from stages.core.config import ConfigError, defaults
from stages.core.io import ArtifactError, read_json
from stages.core.provenance import file_sha256
from stages.core.text import build_vocab
from stages.models import CONFIG, WEIGHTS, load_model, save_model
from stages.models.autoregressive_model import (
    AutoregressiveClassifier,
    ByteTokenizer,
    train_autoregressive,
)
from stages.models.text import BertTextClassifier, read_bert_vocab
from stages.models.text_erm import bert_classifier, train_text
from tests.support import repro_project

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: nothing here may reach a hub

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ["--params", str(ROOT / "params.yaml")]
BERT = {"encoder": "bert", "dim": 16, "heads": 2, "layers": 2, "intermediate": 32, "max_len": 16, "lr": 3e-3,
        "batch_size": 32, "selection": "val_avg"}
GPT2 = {"net": "gpt2", "d_model": 16, "heads": 2, "layers": 2, "ff": 32, "max_len": 24, "eval_every": 1}
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """The real shortcut_text generator's output, tiny, written and read back as a prepared file."""
    cfg = defaults("dataset", "shortcut_text", n_train=300, n_val=80, n_test_id=60, n_test_ood=60)
    path = tmp_path_factory.mktemp("prepared") / "shortcut_text.parquet"
    table, meta = prepare.prepare("shortcut_text", cfg)
    io.write_parquet(table, path, prepared_schema_for(meta), meta)
    return read_prepared(path)


def same_bytes(a: torch.nn.Module, b: torch.nn.Module, tmp_path: Path) -> bool:
    """Whether the two models' saved model.safetensors are byte-identical."""
    for name, model in (("a", a), ("b", b)):
        save_model(tmp_path / name, model, {}, None)
    return (tmp_path / "a" / WEIGHTS).read_bytes() == (tmp_path / "b" / WEIGHTS).read_bytes()


def accuracy(model: Any, p: Prepared) -> dict[str, float]:
    pred = model.logits(p.text).argmax(1)
    return {s: float(np.mean(pred[p.mask(s)] == p.y[p.mask(s)])) for s in SPLITS}


def write_vocab(path: Path, p: Prepared, cased: bool = False) -> list[str]:
    """A BERT vocab.txt: the special tokens, every train word and a WordPiece suffix."""
    words = build_vocab(p.text[p.mask("train")], 1000)
    tokens = [*SPECIALS, *words, "##s", *(["The"] if cased else [])]
    path.write_text("\n".join(tokens) + "\n")
    return tokens


def write_bert_weights(path: Path, vocab_size: int, positions: int) -> dict[str, torch.Tensor]:
    """A BertForSequenceClassification-shaped file (names under `bert.`, plus its own head, which
    is not ours) of a seeded random BERT of the test's sizes."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(123)
    ref = BertModel(BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=positions))
    tensors = {f"bert.{k}": v.contiguous() for k, v in ref.state_dict().items()}
    tensors["classifier.weight"] = torch.randn(7, 16)
    save_file(tensors, str(path))
    return tensors


# ---- BERT text_erm ----------------------------------------------------------------------------


def test_bert_text_erm_learns_is_deterministic_and_round_trips(text_data: Prepared, tmp_path: Path) -> None:
    """Fixed seed: well above chance on train and val; same seed, same bytes; load_model rebuilds it."""
    cfg = defaults("method", "text_erm", epochs=4, **BERT)
    model, result = train_text(text_data, cfg, seed=0)
    from transformers import BertModel

    assert isinstance(model, BertTextClassifier) and isinstance(model.bert, BertModel)
    assert model.bert.config.num_hidden_layers == 2 and model.bert.config.hidden_size == 16
    assert model.vocab == build_vocab(text_data.text[text_data.mask("train")], cfg.vocab_size)
    ids = model.encode(["great movie zzzunseen"])  # [CLS], the words (unknown = 1), padding
    cls = len(model.vocab) + 2
    assert ids[0, :4].tolist() == [cls, model.vocab.index("great") + 2, model.vocab.index("movie") + 2, 1]
    assert ids[0, 4:].eq(0).all()
    acc = accuracy(model, text_data)
    assert acc["train"] > 0.8 and acc["val"] > 0.8, acc  # chance is 0.5
    assert result.history.num_rows == cfg.epochs * len(SPLITS)
    again, _ = train_text(text_data, cfg, seed=0)
    assert same_bytes(model, again, tmp_path)
    save_model(tmp_path / "m", model, {"method": "text_erm"}, result.history)
    loaded = load_model(tmp_path / "m")
    assert isinstance(loaded, BertTextClassifier) and loaded.kind == "text" and loaded.input == "text"
    texts = [*text_data.text[:40], "", "NOT   great, indeed!"]
    assert np.array_equal(loaded.logits(texts), model.logits(texts))
    # Another batch size may round the last bit differently (GEMM kernels block by batch), not more.
    np.testing.assert_allclose(loaded.logits(texts, batch_size=7), model.logits(texts), rtol=1e-5, atol=1e-6)
    cost = read_json(tmp_path / "m" / CONFIG)["inference_cost"]
    assert cost["params"] == sum(t.numel() for t in model.state_dict().values()) and cost["macs"] > 0


def test_bert_weights_and_vocab_come_from_local_files(text_data: Prepared, tmp_path: Path) -> None:
    """BertTokenizerFast over the test's vocab.txt; every BERT tensor equal to the file's (its head
    ignored; its 40-row position table kept whole); a cased vocabulary is not lower-cased."""
    tokens = write_vocab(tmp_path / "vocab.txt", text_data)
    tensors = write_bert_weights(tmp_path / "bert.safetensors", len(tokens), positions=40)
    cfg = defaults("method", "text_erm", weights=str(tmp_path / "bert.safetensors"), vocab=str(tmp_path / "vocab.txt"), **BERT)
    model = bert_classifier(None, 2, cfg, "method.text_erm")
    assert model.tokenizer == "wordpiece" and model.lowercase and model.vocab == tokens and model.positions == 40
    for name, value in model.bert.state_dict().items():
        assert torch.equal(value, tensors[f"bert.{name}"]), name
    assert model.files == {
        "vocab": {"path": str(tmp_path / "vocab.txt"), "sha256": file_sha256(tmp_path / "vocab.txt")},
        "weights": {"path": str(tmp_path / "bert.safetensors"), "sha256": file_sha256(tmp_path / "bert.safetensors")},
    }
    ids = model.encode(["The movies were GREAT", ""])[:, :8].tolist()
    index = {t: i for i, t in enumerate(tokens)}
    assert ids[0][:4] == [index["[CLS]"], index["the"], index["movie"], index["##s"]]
    assert ids[1][:3] == [index["[CLS]"], index["[SEP]"], index["[PAD]"]]
    assert read_bert_vocab(tmp_path / "vocab.txt", "k") == (tokens, True)
    # a file without the pooler (e.g. BertForMaskedLM's) leaves it as initialised
    save_file({k: v for k, v in tensors.items() if ".pooler." not in k}, str(tmp_path / "nopool.safetensors"))
    fresh = bert_classifier(None, 2, dataclasses.replace(cfg, weights=str(tmp_path / "nopool.safetensors")), "k")
    assert torch.equal(fresh.bert.embeddings.word_embeddings.weight, tensors["bert.embeddings.word_embeddings.weight"])
    assert not torch.equal(fresh.bert.pooler.dense.weight, tensors["bert.pooler.dense.weight"])
    cased = write_vocab(tmp_path / "cased.txt", text_data, cased=True)
    assert read_bert_vocab(tmp_path / "cased.txt", "k") == (cased, False)


def test_train_and_evaluate_stages_record_the_files(text_data: Prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real train and evaluate stages with a BERT from a weights file: config.json says bert
    and holds each file's path and sha256; evaluate scores the text with the rebuilt model."""
    tokens = write_vocab(tmp_path / "vocab.txt", text_data)
    write_bert_weights(tmp_path / "bert.safetensors", len(tokens), positions=16)
    monkeypatch.chdir(tmp_path)
    small = [f"dataset.shortcut_text.{k}={n}" for k, n in (("n_train", 200), ("n_val", 60), ("n_test_id", 40), ("n_test_ood", 40))]
    assert prepare.main(["shortcut_text", *small, *PARAMS]) == 0
    overrides = [f"method.text_erm.{k}={v}" for k, v in BERT.items()] + [
        "method.text_erm.epochs=1", f"method.text_erm.weights={tmp_path / 'bert.safetensors'}",
        f"method.text_erm.vocab={tmp_path / 'vocab.txt'}"]
    assert train.main(["shortcut_text", "text_erm", "0", *overrides, *PARAMS]) == 0
    config = read_json(model_dir("shortcut_text", "text_erm", 0) / CONFIG)
    arch = config["architecture"]
    assert arch["encoder"] == "bert" and arch["tokenizer"] == "wordpiece" and arch["layers"] == 2
    assert arch["vocab_words"] == len(tokens) and "vocab" not in arch
    assert config["weights"] == {"path": str(tmp_path / "bert.safetensors"), "sha256": file_sha256(tmp_path / "bert.safetensors")}
    assert config["vocab"]["sha256"] == file_sha256(tmp_path / "vocab.txt")
    (tmp_path / "bert.safetensors").unlink()  # evaluate rebuilds the model from model.safetensors alone
    assert evaluate.main(["shortcut_text", "text_erm", "0", *overrides, *PARAMS]) == 0  # the params it was trained under


def test_bad_weights_and_vocab_are_one_line_errors_naming_the_file(text_data: Prepared, tmp_path: Path) -> None:
    tokens = write_vocab(tmp_path / "vocab.txt", text_data)
    vocab = str(tmp_path / "vocab.txt")

    def build(weights: Path, vocab: str = vocab) -> None:
        bert_classifier(None, 2, defaults("method", "text_erm", weights=str(weights), vocab=vocab, **BERT), "method.x")

    cases = {
        "missing.safetensors": r"missing\.safetensors: weights file not found \(method\.x\.weights\)",
        "garbage.safetensors": r"garbage\.safetensors: not a valid safetensors file \(method\.x\.weights\)",
        "other_vocab.safetensors": r"other_vocab\.safetensors: tensor 'bert\.embeddings\.word_embeddings\.weight' is \(9, 16\)",
    }
    (tmp_path / "garbage.safetensors").write_bytes(b"not safetensors at all")
    write_bert_weights(tmp_path / "other_vocab.safetensors", 9, positions=16)
    for name, message in cases.items():
        with pytest.raises(ArtifactError, match=message) as e:
            build(tmp_path / name)
        assert "\n" not in str(e.value)
    write_bert_weights(tmp_path / "ok.safetensors", len(tokens), positions=16)
    with pytest.raises(ArtifactError, match=r"nope\.txt: vocabulary file not found \(method\.x\.vocab\)"):
        build(tmp_path / "ok.safetensors", str(tmp_path / "nope.txt"))
    (tmp_path / "bad.txt").write_text("a\nb\n")
    with pytest.raises(ArtifactError, match=r"bad\.txt: not a BERT vocab\.txt \(method\.x\.vocab\): it lacks"):
        build(tmp_path / "ok.safetensors", str(tmp_path / "bad.txt"))
    # weights without their vocabulary: refused by the config check, naming both keys
    with pytest.raises(ConfigError, match=r"method\.text_erm\.weights: .*set vocab") as e:
        defaults("method", "text_erm", weights=str(tmp_path / "ok.safetensors"), **BERT)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"method\.text_erm\.vocab: only encoder=bert reads it"):
        defaults("method", "text_erm", vocab=vocab)


# ---- GPT-2 autoregressive ---------------------------------------------------------------------


def test_gpt2_autoregressive_trains_scores_and_round_trips(text_data: Prepared, tmp_path: Path) -> None:
    """One epoch; the class score is log π_y + Σ_j log p(byte_j | bytes_<j, y) from GPT-2's
    next-token distribution with the class embedding first; same seed, same bytes; load_model
    rebuilds it."""
    from transformers import GPT2LMHeadModel

    cfg = defaults("method", "autoregressive", epochs=1, **GPT2)
    model, result = train_autoregressive(text_data, cfg, seed=0)
    assert isinstance(model.gpt2, GPT2LMHeadModel) and model.gpt2.config.n_layer == 2 and model.input == "text"
    assert model.arch()["net"] == "gpt2" and not hasattr(model, "blocks")
    texts = list(text_data.text[:12])
    scores = model.logits(texts)
    assert scores.shape == (12, 2) and np.isfinite(scores).all() and (model.log_likelihood(texts) < 0).all()
    tokens, mask = model.tokenizer.encode(texts[:1])
    with torch.no_grad():
        for y in (0, 1):
            inputs = torch.cat([model.class_embedding(torch.tensor([y]))[:, None], model.gpt2.transformer.wte(tokens[:, :-1])], 1)
            logp = torch.log_softmax(model.gpt2(inputs_embeds=inputs).logits, -1)[0]
            by_hand = float(logp[torch.arange(tokens.shape[1]), tokens[0]][mask[0]].sum()) + float(model.log_priors[y])
            assert scores[0, y] == pytest.approx(by_hand, rel=1e-5)
    again, _ = train_autoregressive(text_data, cfg, seed=0)
    assert same_bytes(model, again, tmp_path)
    save_model(tmp_path / "m", model, {"method": "autoregressive"}, result.history)
    loaded = load_model(tmp_path / "m")
    assert isinstance(loaded, AutoregressiveClassifier) and loaded.net == "gpt2"
    assert np.array_equal(loaded.logits(texts), model.logits(texts))
    # the shiftlab net's metadata is as before (no net key), so older files load unchanged
    shiftlab, _ = train_autoregressive(text_data, dataclasses.replace(cfg, net="shiftlab", d_model=8), seed=0)
    assert "net" not in shiftlab.arch() and hasattr(shiftlab, "blocks")


def test_gpt2_weights_load_where_they_fit(text_data: Prepared, tmp_path: Path) -> None:
    """Blocks and final norm from the file; a GPT-2 BPE embedding that does not index our bytes is
    skipped; a longer position table is kept whole; an unfitting block or a missing file is an
    error naming the file and the key."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(7)
    ref = GPT2Model(GPT2Config(vocab_size=50, n_positions=40, n_embd=16, n_layer=2, n_head=2, n_inner=32))
    file = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(file, str(tmp_path / "gpt2.safetensors"))
    cfg = defaults("method", "autoregressive", epochs=1, weights=str(tmp_path / "gpt2.safetensors"), **GPT2)
    model = AutoregressiveClassifier(46, 2, ByteTokenizer(24), 16, 2, 2, 32, net="gpt2", positions=40)
    digest = model.load_gpt2(tmp_path / "gpt2.safetensors", "method.x.weights")
    assert digest == file_sha256(tmp_path / "gpt2.safetensors")
    body = model.gpt2.transformer.state_dict()
    for name in body:
        assert torch.equal(body[name], file[name]) == (name != "wte.weight"), name  # 50 BPE ids vs 257 bytes
    trained, _ = train_autoregressive(text_data, cfg, seed=0, key="method.x")
    assert trained.files["weights"]["sha256"] == digest and trained.positions == 40
    # a file whose embedding indexes our 257 byte tokens: loaded, and the output head tied to it as GPT-2's
    torch.manual_seed(8)
    bytes_ref = GPT2Model(GPT2Config(vocab_size=257, n_positions=24, n_embd=16, n_layer=2, n_head=2, n_inner=32))
    save_file({k: v.contiguous() for k, v in bytes_ref.state_dict().items()}, str(tmp_path / "bytes.safetensors"))
    model.load_gpt2(tmp_path / "bytes.safetensors", "method.x.weights")
    assert torch.equal(model.gpt2.transformer.wte.weight, bytes_ref.wte.weight)
    assert torch.equal(model.gpt2.lm_head.weight, bytes_ref.wte.weight)
    # a block of another width, or no file at all
    wide = GPT2Model(GPT2Config(vocab_size=257, n_positions=24, n_embd=32, n_layer=2, n_head=2, n_inner=32))
    save_file({k: v.contiguous() for k, v in wide.state_dict().items()}, str(tmp_path / "wide.safetensors"))
    with pytest.raises(ArtifactError, match=r"wide\.safetensors: tensor 'h\.0\.ln_1\.weight' is \(32,\).*method\.x\.weights"):
        train_autoregressive(text_data, dataclasses.replace(cfg, weights=str(tmp_path / "wide.safetensors")), 0, key="method.x")
    with pytest.raises(ArtifactError, match=r"none\.safetensors: weights file not found \(method\.x\.weights\)"):
        train_autoregressive(text_data, dataclasses.replace(cfg, weights=str(tmp_path / "none.safetensors")), 0, key="method.x")
    with pytest.raises(ConfigError, match=r"method\.autoregressive\.weights: only net=gpt2"):
        defaults("method", "autoregressive", weights=str(tmp_path / "gpt2.safetensors"))


# ---- end to end through `dvc repro` ----------------------------------------------------------


@pytest.mark.slow
def test_shortcut_text_with_bert_and_gpt2_runs_end_to_end_through_dvc_repro(tmp_path: Path) -> None:
    """The shortcut_text recipe's text models (as tests/test_builtin_datasets.py TEXT) with the
    transformers networks: train and evaluate succeed and config.json names the architecture."""
    overrides = [
        "experiment=shortcut_text",
        "run.methods=[text_erm,autoregressive]",
        "run.teachers=[]",
        "run.models=[text_erm,autoregressive]",
        "dataset.shortcut_text.n_train=300",  # the sizes of TEXT there: validate wants >= 3 per group
        "dataset.shortcut_text.n_val=100",
        "dataset.shortcut_text.n_test_id=100",
        "dataset.shortcut_text.n_test_ood=200",
        "method.text_erm.epochs=1",
        *(f"method.text_erm.{k}={v}" for k, v in BERT.items()),
        "method.autoregressive.epochs=1",
        *(f"method.autoregressive.{k}={v}" for k, v in GPT2.items()),
    ]
    targets = [f"evaluate@shortcut_text-{m}-0" for m in ("text_erm", "autoregressive")]
    log = repro_project(tmp_path, overrides, *targets)
    for stage in ("train", "evaluate"):
        for m in ("text_erm", "autoregressive"):
            assert f"'{stage}@shortcut_text-{m}-0'" in log
    bert = read_json(tmp_path / model_dir("shortcut_text", "text_erm", 0) / CONFIG)["architecture"]
    gpt2 = read_json(tmp_path / model_dir("shortcut_text", "autoregressive", 0) / CONFIG)["architecture"]
    assert (bert["kind"], bert["encoder"], bert["layers"]) == ("text", "bert", 2)
    assert (gpt2["kind"], gpt2["net"], gpt2["layers"]) == ("autoregressive", "gpt2", 2)
