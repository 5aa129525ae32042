"""timm image backbones for the MLP-trained discriminative methods (stages/models/backbone.py):
weights from a local safetensors file, one-line errors for bad files and configs, learning and
determinism, and erm with a resnet18 trained and evaluated through the real `dvc repro`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import timm
import torch
from safetensors.torch import save_file

from stages.core import artifacts, provenance, registry
from stages.core.artifacts import Prepared
from stages.core.config import defaults
from stages.core.io import ArtifactError, numpy_to_fixed_list, read_parquet, write_parquet
from stages.core.schema import ConfigError
from stages.models import CONFIG, WEIGHTS, load_model, save_model
from stages.models.backbone import TimmClassifier, head_prefixes
from stages.models.discriminative import build_classifier
from stages.models.training import Trained, TrainJob
from tests.support import repro_project

SPLIT_SIZES = {"train": 64, "val": 32, "test_id": 32, "test_ood": 32}


def toy(shape: tuple[int, ...] = (3, 32, 32), seed: int = 0) -> Prepared:
    """Easy images: a bright 8×8 square in channel 0 (y = 0) or channel 1 (y = 1) over uniform
    noise; the attribute a is an independent coin, so every split has every group."""
    rng = np.random.default_rng(seed)
    split = np.concatenate([np.full(n, s, dtype=object) for s, n in SPLIT_SIZES.items()])
    n = len(split)
    y = rng.integers(0, 2, n)
    a = rng.integers(0, 2, n)
    x = rng.uniform(0.0, 0.3, (n, *shape)).astype(np.float32)
    if len(shape) == 3:
        for i in range(n):
            x[i, y[i], 4:12, 4:12] += 0.6
    meta = {"dataset": "toy", "n_classes": 2, "n_attrs": 2, "shape": list(shape)}
    return Prepared(np.arange(n, dtype=np.int64), split, y, a, y * 2 + a, x.reshape(n, -1), meta)


def write_prepared(prepared: Prepared, path: Path, x_dtype: str = "float32") -> Path:
    """`prepared` as a prepared Parquet (uint8: pixels rounded to 1/255, as the image datasets store them)."""
    x = np.round(prepared.x * 255).astype(np.uint8) if x_dtype == "uint8" else prepared.x
    table = pa.table({"id": prepared.id, "split": list(prepared.split), "y": prepared.y, "a": prepared.a, "g": prepared.g,
                      "x": numpy_to_fixed_list(x, pa.uint8() if x_dtype == "uint8" else None)})
    return write_parquet(table, path, artifacts.prepared_schema(x.shape[1], x_dtype), {**prepared.meta, "x_dtype": x_dtype})


def job(prepared: Prepared, seed: int = 0, **overrides: object) -> TrainJob:
    """erm (conf/'s values, then `overrides`) on `prepared`, no checkpoints."""
    return TrainJob("toy", "erm", seed, defaults("method", "erm", **overrides), prepared, checkpoint_every=0, resume=False)


def train(j: TrainJob) -> Trained:
    return registry.method("erm").train(j)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_state(net: torch.nn.Module, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A timm resnet18 state_dict as an ImageNet checkpoint has it (1000-class head `fc`), fresh."""
    torch.manual_seed(123)
    return save_state(timm.create_model("resnet18", pretrained=False), tmp_path_factory.mktemp("weights") / "resnet18.safetensors")


# ---- weights from a local file ---------------------------------------------------------------


def test_resnet18_loads_every_tensor_but_the_head_from_the_file_and_records_its_sha256(resnet18_file, tmp_path):
    prepared = toy()
    j = job(prepared, backbone="resnet18", weights=str(resnet18_file), epochs=1, batch_size=16)
    model, added = build_classifier(j)
    assert isinstance(model, TimmClassifier)
    from safetensors.torch import load_file

    stored = load_file(str(resnet18_file))
    own = model.net.state_dict()
    body = [k for k in stored if not k.startswith("fc.")]
    assert len(body) > 100 and all(torch.equal(own[k], stored[k]) for k in body)
    assert own["fc.weight"].shape == (2, 512) and stored["fc.weight"].shape == (1000, 512)  # the head: fresh, 2 classes
    # inputs normalised as the weights expect (timm's pretrained_cfg: ImageNet's), not by the data
    assert torch.allclose(model.normalize.mean, torch.tensor([0.485, 0.456, 0.406]))
    assert torch.allclose(model.normalize.std, torch.tensor([0.229, 0.224, 0.225]))
    assert added["weights"] == {"path": str(resnet18_file), "sha256": sha256(resnet18_file)}
    # the global pool is a plain mean (AdaptiveAvgPool2d's backward raises on CUDA when deterministic)
    assert not any(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in model.modules())

    # one epoch through the shared loop, saved and rebuilt from model.safetensors alone
    trained = train(j)
    folder = save_model(tmp_path / "model", trained.model, trained.record, trained.history)
    config = json.loads((folder / CONFIG).read_text())
    assert config["weights"]["sha256"] == sha256(resnet18_file)
    assert config["architecture"] == {"kind": "backbone", "library": "timm", "name": "resnet18", "shape": [3, 32, 32],
                                      "in_dim": 3072, "n_classes": 2}
    cost = config["inference_cost"]
    assert cost["params"] == sum(t.numel() for t in trained.model.state_dict().values())
    assert 30e6 < cost["macs"] < 45e6  # resnet18: 1.8 GMACs at 224 px, × (32/224)²
    loaded = load_model(folder)
    assert isinstance(loaded, TimmClassifier)
    x = prepared.subset("test_ood").x
    assert np.array_equal(loaded.logits(x), trained.model.logits(x))


def test_a_missing_pickled_or_foreign_weights_file_is_one_line_naming_it(resnet18_file, tmp_path):
    torch.manual_seed(0)
    pickled = tmp_path / "pickled.safetensors"
    torch.save(timm.create_model("resnet18").state_dict(), pickled)
    cases = {
        tmp_path / "missing.safetensors": "not found",
        pickled: "not a valid safetensors file",
        # a tensor of another shape: the first conv of a one-channel resnet18
        save_state(timm.create_model("resnet18", in_chans=1), tmp_path / "gray.safetensors"): "conv1.weight",
        # every tensor of a resnet18 and more: a resnet34's file
        save_state(timm.create_model("resnet34"), tmp_path / "resnet34.safetensors"): "tensor(s) it lacks",
    }
    prepared = toy()
    for path, why in cases.items():
        with pytest.raises(ArtifactError) as e:
            build_classifier(job(prepared, backbone="resnet18", weights=str(path)))
        msg = str(e.value)
        assert str(path) in msg and "method.erm.weights" in msg and why in msg and "\n" not in msg, msg


def test_a_vit_is_built_for_the_datasets_image_size_and_rebuilt_from_its_arch():
    prepared = toy()
    torch.manual_seed(0)
    vit = TimmClassifier("vit_tiny_patch16_224", [3, 32, 32], 2)  # a fixed-size model: img_size=(32, 32)
    assert vit.net.patch_embed.img_size == (32, 32)
    again = TimmClassifier.from_arch(vit.arch())
    again.load_state_dict(vit.state_dict())
    x = prepared.subset("val").x
    assert vit.logits(x).shape == (len(x), 2) and np.array_equal(again.logits(x), vit.logits(x))
    with pytest.raises(ValueError, match="model name the installed timm knows"):
        TimmClassifier.from_arch({**vit.arch(), "name": "vit_nope"})


# ---- config errors ---------------------------------------------------------------------------


def test_a_timm_backbone_on_a_dataset_that_is_not_images_stops_before_training():
    vectors = toy(shape=(40,))
    with pytest.raises(ConfigError, match=r"^params\.yaml: method\.erm\.backbone: the timm model 'resnet18' needs an image dataset .* has shape \[40\]"):
        train(job(vectors, backbone="resnet18"))


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        ({"backbone": "resnet81"}, "backbone", "close matches: ['resnet18'"),
        ({"weights": "w.safetensors"}, "weights", "only a timm backbone loads weights"),
        ({"backbone": "resnet18", "init": "pretrained"}, "init", "cannot use"),
    ],
)
def test_backbone_config_errors_name_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as e:
        defaults("method", "erm", **overrides)
    assert str(e.value).startswith(f"params.yaml: method.erm.{key}: ") and says in str(e.value)


def test_last_layer_retraining_on_a_timm_model_refits_its_head_on_the_pooled_features(tmp_path, monkeypatch):
    """DFR with `features` naming a timm-backed method: embeddings are the network's pooled features
    (what its classifier head reads), and the DFR model is that network with the refitted head."""
    from stages.models.dfr import fit_head

    monkeypatch.chdir(tmp_path)
    prepared = toy()
    path = write_prepared(prepared, artifacts.prepared_path("toy"))
    cfg = defaults("method", "erm", backbone="resnet18")
    made = provenance.record(dataset="toy", model="erm", kind="erm", seed=0, stage="train@toy-erm-0", config=cfg, inputs=[path])
    torch.manual_seed(0)
    base = TimmClassifier("resnet18", [3, 32, 32], 2)
    save_model(artifacts.model_dir("toy", "erm", 0), base, {}, None, provenance=made, final=base.state_dict())  # DFR reads the last epoch
    model, metrics, _, summary = fit_head(prepared, defaults("method", "dfr", n_refits=2), "toy", 0, "method.dfr", "dfr")
    assert model.kind == "backbone" and set(metrics) == set(artifacts.SPLITS)
    val = prepared.subset("val").x
    z = model.embed(val)
    assert z.shape == (len(val), base.net.num_features)
    head = model.net.get_classifier()
    expected = z @ head.weight.detach().numpy().T + head.bias.detach().numpy()
    assert np.allclose(model.logits(val), expected, atol=1e-4)  # the refitted head on the pooled features
    saved = load_model(artifacts.model_dir("toy", "erm", 0))
    skip = head_prefixes(model.net)
    body = {k: v for k, v in model.state_dict().items() if not k.startswith(tuple("net." + p for p in skip))}
    assert body and all(torch.equal(v, saved.state_dict()[k]) for k, v in body.items())  # the network itself is frozen
    assert summary["features_from"].endswith("final.safetensors")  # base: final, the last epoch


# ---- learning and determinism ----------------------------------------------------------------


def test_a_resnet18_learns_the_toy_and_the_same_seed_gives_the_same_bytes(tmp_path):
    prepared = toy()
    runs = []
    for k in range(2):
        trained = train(job(prepared, backbone="resnet18", epochs=2, batch_size=16, selection="val_avg"))
        runs.append(save_model(tmp_path / f"run{k}", trained.model, trained.record, trained.history) / WEIGHTS)
    # random initialisation: inputs normalised by the train split's own channel statistics
    train_x = prepared.subset("train").x.reshape(-1, 3, 32 * 32)
    assert np.allclose(trained.model.normalize.mean.numpy(), train_x.mean(axis=(0, 2)), atol=1e-5)
    assert trained.record["backbone"]["normalization"] == "train split, per channel" and "weights" not in trained.record
    assert trained.metrics["train"]["acc"] >= 0.9 and trained.metrics["test_ood"]["acc"] >= 0.9, trained.metrics
    assert runs[0].read_bytes() == runs[1].read_bytes()


def test_the_train_statistics_are_the_same_read_in_memory_or_streamed(tmp_path):
    from stages.core.stream import PreparedFile
    from stages.models.backbone import build

    path = write_prepared(toy(), tmp_path / "toy.parquet", x_dtype="uint8")
    memory = artifacts.read_prepared(path)
    in_memory, _ = build(memory, "resnet18", None, "method.erm")
    streamed, _ = build(PreparedFile.open(path), "resnet18", None, "method.erm")
    pixels = memory.subset("train").x.reshape(-1, 3, 32 * 32).astype(np.float64)
    assert np.allclose(in_memory.normalize.std.numpy(), pixels.std(axis=(0, 2)), atol=1e-6)
    assert torch.allclose(in_memory.normalize.mean, streamed.normalize.mean, atol=1e-7)
    assert torch.allclose(in_memory.normalize.std, streamed.normalize.std, atol=1e-7)


# ---- end to end: erm with a resnet18 through `dvc repro` ----------------------------------------


@pytest.mark.slow
def test_erm_with_a_resnet18_from_a_weights_file_trains_and_evaluates_through_dvc_repro(resnet18_file, tmp_path):
    project = tmp_path / "project"
    overrides = [
        "run.datasets=[colored_digits]", "run.methods=[erm]", "run.teachers=[]", "run.models=[erm]",
        "method.erm.backbone=resnet18", f"method.erm.weights={resnet18_file}",
        "method.erm.epochs=1", "method.erm.batch_size=64",
        "train.checkpoint_every=0", "evaluate.bootstrap_resamples=0",  # no 180 MB checkpoint, no bootstrap: time
        "runtime.threads=0",  # as the real-data recipes run a ResNet: every core, oneDNN's convolutions (37 s of CPU, not 52)
    ]
    log = repro_project(project, overrides, "evaluate@colored_digits-erm-0")
    assert "'train@colored_digits-erm-0'" in log and "'evaluate@colored_digits-erm-0'" in log
    folder = project / artifacts.model_dir("colored_digits", "erm", 0)
    config = json.loads((folder / CONFIG).read_text())
    # colored_digits: 3×8×8 images; the whole network is in model.safetensors
    assert config["architecture"] == {"kind": "backbone", "library": "timm", "name": "resnet18", "shape": [3, 8, 8],
                                      "in_dim": 192, "n_classes": 2}
    assert config["weights"] == {"path": str(resnet18_file), "sha256": sha256(resnet18_file)}
    assert config["config"]["backbone"] == "resnet18"
    # one epoch learns the task in distribution (and, being ERM, the colour shortcut with it)
    assert config["metrics"]["train"]["acc"] > 0.8
    metrics = json.loads((project / artifacts.metrics_path("colored_digits", "erm", 0)).read_text())
    assert metrics["test_id_acc"] > 0.8 and metrics["test_ood_acc"] < metrics["test_id_acc"]
    # evaluate's predictions are the rebuilt network's logits (no weights file needed to load it)
    prepared = artifacts.read_prepared(project / artifacts.prepared_path("colored_digits"))
    predictions = read_parquet(project / artifacts.predictions_path("colored_digits", "erm", 0), artifacts.predictions_schema(2))
    ids = predictions.column("id").to_numpy()
    logits = np.stack(predictions.column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
    row = {int(i): k for k, i in enumerate(prepared.id)}
    model = load_model(folder)
    assert len(ids) == len(prepared.id)
    assert np.allclose(logits, model.logits(prepared.x[[row[int(i)] for i in ids]]), atol=1e-5)
