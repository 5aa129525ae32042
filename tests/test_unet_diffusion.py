"""The diffusion classifier with `denoiser: unet`: a class-conditional diffusers UNet2DModel built
from config, optionally started from a local safetensors file, trained and scored like the small
nets, through the train stage and through `dvc repro`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from stages import train
from stages.core.artifacts import Prepared, metrics_path, model_dir
from stages.core.config import ConfigError, defaults, load_params, method_config
from stages.core.io import ArtifactError, read_json
from stages.core.runtime import setup_torch
from stages.models import CONFIG, load_model, save_model
from stages.models.diffusion_model import build_classifier, noise_schedule, train_diffusion

ROOT = Path(__file__).resolve().parents[1]
# Two blocks of 8 and 16 channels, attention in the second (and so in the middle block).
TINY_UNET = dict(denoiser="unet", unet_channels=[8, 16], unet_layers_per_block=1, unet_attention=[False, True],
                 unet_norm_groups=4, steps=20, draws=4, select_draws=2, batch_size=32, lr=3e-3)


def images(n: int = 96, shape: tuple[int, int, int] = (3, 8, 8), seed: int = 0) -> Prepared:
    """Class 0 is bright in the top half, class 1 in the bottom half, plus noise; a random attribute."""
    rng = np.random.default_rng(seed)
    sizes = {"train": n, "val": n // 2, "test_id": n // 4, "test_ood": n // 4}
    split = np.concatenate([[s] * m for s, m in sizes.items()]).astype(object)
    y = rng.integers(0, 2, len(split))
    c, h, w = shape
    x = 0.3 * rng.standard_normal((len(split), c, h, w))
    for k in (0, 1):
        x[y == k, :, k * h // 2 : (k + 1) * h // 2] += 1.0
    a = rng.integers(0, 2, len(split))
    meta = {"dataset": "blocks", "n_classes": 2, "n_attrs": 2, "shape": list(shape)}
    return Prepared(np.arange(len(split)), split, y, a, y * 2 + a, x.reshape(len(split), -1).astype(np.float32), meta)


def unet_cfg(**kw):
    return defaults("method", "diffusion", **{**TINY_UNET, **kw})


def test_our_schedules_are_diffusers_ddpm_schedules():
    """alphas_cumprod of DDPMScheduler (linear ↔ linear, squaredcos_cap_v2 ↔ cosine) equal ours, in
    float32; so t (ours, 1..T) is diffusers' timestep t − 1 under the same ᾱ."""
    from diffusers import DDPMScheduler

    for steps in (50, 100, 1000):
        scale = 1000 / steps
        for ours, theirs in (("linear", "linear"), ("cosine", "squaredcos_cap_v2")):
            sched = DDPMScheduler(num_train_timesteps=steps, beta_schedule=theirs, beta_start=scale * 1e-4, beta_end=scale * 0.02)
            alpha_bar = torch.cumprod(1 - noise_schedule(ours, steps), 0)
            torch.testing.assert_close(sched.alphas_cumprod.double(), alpha_bar, rtol=0, atol=1e-6)
    # Below ~21 steps the stretched linear schedule's last β reaches 1 in diffusers; ours caps it at 0.999.
    assert noise_schedule("linear", 20)[-1] == pytest.approx(0.999)


def test_a_two_block_unet_trains_scores_round_trips_and_is_deterministic(tmp_path):
    prepared = images()
    cfg = unet_cfg(epochs=3, eval_every=3)
    model, result = train_diffusion(prepared, cfg, seed=0)
    logits = model.logits(prepared.x)
    assert logits.shape == (len(prepared.y), 2) and np.isfinite(logits).all()
    assert model.denoiser.unet.__class__.__name__ == "UNet2DModel"
    assert model.denoiser.unet.class_embedding.num_embeddings == 2  # no class dropout: no null class
    # it learns to denoise: the val objective (fixed draws) falls epoch by epoch
    rows = result.history.to_pylist()
    val = [r["objective"] for r in rows if r["split"] == "val"]
    assert len(val) == 3 and val[2] < val[1] < val[0], val
    # the folder holds the whole UNet and an arch that rebuilds it, no weights file needed
    folder = save_model(tmp_path / "m", model, {"method": "diffusion"}, result.history)
    loaded = load_model(folder)
    np.testing.assert_array_equal(loaded.logits(prepared.x), logits)
    assert loaded.arch() == model.arch()
    assert model.arch()["network"] == "diffusers.UNet2DModel" and model.arch()["unet_channels"] == [8, 16]
    cost = read_json(folder / CONFIG)["inference_cost"]
    assert cost["params"] == sum(t.numel() for t in model.state_dict().values())
    assert cost["forward_passes"] == 2 * 4 and cost["macs"] > 8 * 8 * 3 * 8 * 9 * cost["forward_passes"]
    # same seed, same bytes
    again, _ = train_diffusion(prepared, cfg, seed=0)
    for name, tensor in model.state_dict().items():
        other = again.state_dict()[name]
        assert tensor.dtype == other.dtype and tensor.numpy().tobytes() == other.numpy().tobytes(), name


def test_the_unet_classifier_learns_an_easy_image_task():
    prepared = images(n=256)
    model, _ = train_diffusion(prepared, unet_cfg(epochs=10, eval_every=10, draws=8), seed=0)
    m = prepared.mask("test_id")
    assert (model.logits(prepared.x[m]).argmax(1) == prepared.y[m]).mean() >= 0.9  # chance 0.5


def test_unet_pads_images_its_downsampling_does_not_divide():
    prepared = images(n=32, shape=(1, 6, 6))
    setup_torch(0)
    # Untrained, so scored on every draw (stop_se 0): the default test needs what training fits on val.
    model = build_classifier(prepared, unet_cfg(unet_channels=[8, 8, 8], unet_attention=[False, False, False],
                                                class_dropout=0.1, stop_se=0.0))
    assert model.denoiser.pad == (2, 2)  # 6 -> 8, divisible by 2^(3 - 1)
    assert model.denoiser.unet.class_embedding.num_embeddings == 3  # the null class
    logits = model.logits(prepared.x)
    assert logits.shape == (len(prepared.y), 2) and np.isfinite(logits).all()


def _unet_file(path: Path, cfg, class_embedding: bool = True) -> dict[str, torch.Tensor]:
    """A state_dict of the UNet `cfg` describes (random values), written with safetensors."""
    setup_torch(1)
    unet = build_classifier(images(n=8), cfg).denoiser.unet
    g = torch.Generator().manual_seed(7)
    state = {k: torch.randn(v.shape, generator=g) for k, v in unet.state_dict().items()
             if class_embedding or not k.startswith("class_embedding.")}
    save_file(state, str(path))
    return state


def test_weights_load_from_a_local_safetensors_file(tmp_path):
    cfg = unet_cfg()
    state = _unet_file(tmp_path / "unet.safetensors", cfg)
    setup_torch(0)
    model = build_classifier(images(n=8), unet_cfg(weights=str(tmp_path / "unet.safetensors")), "method.d")
    loaded = model.denoiser.unet.state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    sha = hashlib.sha256((tmp_path / "unet.safetensors").read_bytes()).hexdigest()
    assert model.init_weights == {"path": str(tmp_path / "unet.safetensors"), "sha256": sha}

    # an unconditional UNet (no class embedding): the rest loads, the class embedding starts at 0
    state = _unet_file(tmp_path / "uncond.safetensors", cfg, class_embedding=False)
    model = build_classifier(images(n=8), unet_cfg(weights=str(tmp_path / "uncond.safetensors")), "method.d")
    torch.testing.assert_close(model.denoiser.unet.conv_in.weight, state["conv_in.weight"], rtol=0, atol=0)
    assert not model.denoiser.unet.class_embedding.weight.any()
    assert model.init_weights["fresh"] == ["class_embedding.weight"]


def test_a_missing_or_wrong_weights_file_is_one_line_naming_it(tmp_path):
    prepared = images(n=8)
    bad = {
        "missing": tmp_path / "nope.safetensors",
        "not safetensors": tmp_path / "junk.safetensors",
        "another architecture": tmp_path / "wide.safetensors",
    }
    bad["not safetensors"].write_bytes(b"\x00not a safetensors file")
    _unet_file(bad["another architecture"], unet_cfg(unet_channels=[16, 32]))
    for why, path in bad.items():
        with pytest.raises(ArtifactError) as e:
            build_classifier(prepared, unet_cfg(weights=str(path)), "method.diffusion")
        msg = str(e.value)
        assert str(path) in msg and "method.diffusion.weights" in msg and "\n" not in msg, (why, msg)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("method.diffusion.weights=w.safetensors", "method.diffusion.weights"),  # needs denoiser=unet
        ("method.diffusion.unet_attention=[true]", "method.diffusion.unet_attention"),  # one per block
        ("method.diffusion.unet_norm_groups=3", "method.diffusion.unet_norm_groups"),
        ("method.diffusion.unet_channels=[]", "method.diffusion.unet_channels"),
    ],
)
def test_bad_unet_config_names_the_key(override, key):
    params = load_params(ROOT / "params.yaml", [override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        method_config(params, "diffusion")


def test_unet_on_vector_data_is_a_config_error_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    params = ["--params", str(ROOT / "params.yaml")]
    from stages import prepare
    small = [f"dataset.gaussian_shortcut.{k}=50" for k in ("n_train", "n_val", "n_test_id", "n_test_ood")]
    assert prepare.main(["gaussian_shortcut", *small, *params]) == 0
    capsys.readouterr()
    called = []
    monkeypatch.setattr("stages.models.diffusion_model.train_diffusion", lambda *a, **k: called.append(1))
    assert train.main(["gaussian_shortcut", "diffusion", "0", "method.diffusion.denoiser=unet", *params]) == 2
    err = capsys.readouterr().err.strip()
    assert "method.diffusion.denoiser" in err and "(C, H, W)" in err and len(err.splitlines()) == 1 and not called
    assert not model_dir("gaussian_shortcut", "diffusion", 0).exists()


# ---- end to end through `dvc repro` ------------------------------------------------------------

UNET_RUN = [
    "run.datasets=[colored_digits]",
    "run.methods=[diffusion]",
    "run.teachers=[]",
    "run.models=[diffusion]",
    "method.diffusion.denoiser=unet",
    "method.diffusion.unet_channels=[8,16]",
    "method.diffusion.unet_attention=[false,true]",
    "method.diffusion.unet_norm_groups=4",
    "method.diffusion.epochs=1",
    "method.diffusion.eval_every=1",
    "method.diffusion.steps=20",
    "method.diffusion.draws=2",
    "method.diffusion.select_draws=1",
    "method.diffusion.weights=weights/unet.safetensors",
    "runtime.threads=0",  # as the real-data recipes run a UNet: every core, oneDNN's convolutions (32 s of CPU, not 39)
]


@pytest.mark.slow
def test_unet_diffusion_trains_and_evaluates_through_dvc_repro(tmp_path: Path) -> None:
    from tests.support import repro_project

    # An unconditional UNet of the configured shape (3×8×8 colored_digits), as a published DDPM
    # checkpoint would be: the train stage starts from it and adds the class embedding.
    (tmp_path / "weights").mkdir()
    _unet_file(tmp_path / "weights" / "unet.safetensors", unet_cfg(), class_embedding=False)
    log = repro_project(tmp_path, UNET_RUN, "evaluate@colored_digits-diffusion-0")
    assert "'train@colored_digits-diffusion-0'" in log and "'evaluate@colored_digits-diffusion-0'" in log
    folder = tmp_path / model_dir("colored_digits", "diffusion", 0)
    config = read_json(folder / CONFIG)
    arch = config["architecture"]
    assert arch["denoiser"] == "unet" and arch["network"] == "diffusers.UNet2DModel" and arch["shape"] == [3, 8, 8]
    sha = hashlib.sha256((tmp_path / "weights" / "unet.safetensors").read_bytes()).hexdigest()
    assert config["weights"] == {"path": "weights/unet.safetensors", "sha256": sha, "fresh": ["class_embedding.weight"]}
    assert config["provenance"]["inputs"]["weights/unet.safetensors"] == sha  # and the stage's DVC deps name it
    assert config["inference_cost"]["macs"] > 0 and config["inference_cost"]["forward_passes"] == 2 * 2
    metrics = read_json(tmp_path / metrics_path("colored_digits", "diffusion", 0))
    assert all(0 <= metrics["splits"][s]["acc"] <= 1 for s in ("test_id", "test_ood"))
