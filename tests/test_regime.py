"""The regime of a dataset: its separation metadata, the estimator, the regime knobs and the
paper_regime recipe (stages/evaluation/regime.py, docs/datasets.md "Separation")."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from stages.core.config import defaults
from stages.datasets import colored_digits, gaussian_shortcut
from stages.evaluation import regime
from stages.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"n_train": 200, "n_val": 100, "n_test_id": 100, "n_test_ood": 100}
MORE = "a likelihood (generative) classifier is expected to use the shortcut more than a discriminative one"
LESS = "a likelihood (generative) classifier is expected to use the shortcut less than a discriminative one"


def _train(columns: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = columns["split"] == "train"
    return columns["x"][m], columns["y"][m], columns["a"][m]


@pytest.mark.parametrize(
    "knobs",
    [{}, {"cue_dims": 3, "spurious_noise": 0.5, "sigma": 0.8}, {"spurious_scale": 0.25, "spurious_noise": 1.0, "cue_dims": 4}],
)
def test_gaussian_metadata_is_the_closed_form(knobs: dict[str, float]) -> None:
    cfg = defaults("dataset", "gaussian_shortcut", **SMALL, **knobs)
    _, meta = prepare("gaussian_shortcut", cfg)
    cue = 2 * cfg.spurious_scale * np.sqrt(cfg.cue_dims) / cfg.spurious_noise
    assert meta["separation"] == {"cue": pytest.approx(cue, abs=1e-4), "core": pytest.approx(2 / cfg.sigma, abs=1e-4)}
    assert meta["separation_source"] == "closed_form"
    # the default regime is the shortcut one: cue 10 against core 2
    if not knobs:
        assert meta["separation"] == {"cue": 10.0, "core": 2.0}


def test_estimator_recovers_the_gaussian_closed_form_on_a_large_sample() -> None:
    cfg = defaults("dataset", "gaussian_shortcut", n_train=40_000, cue_dims=2, spurious_noise=0.5, d_noise=6)
    columns, meta = gaussian_shortcut.generate(cfg)
    got = regime.estimate_separation(*_train(columns), n_attrs=2)
    for k in ("cue", "core"):
        assert got[k] == pytest.approx(meta["separation"][k], rel=0.03), (k, got, meta["separation"])


def test_streamed_estimate_equals_in_memory_and_subsampling_reweights() -> None:
    cfg = defaults("dataset", "gaussian_shortcut", n_train=6000, cue_dims=2, spurious_noise=0.5)
    x, y, a = _train(gaussian_shortcut.generate(cfg)[0])
    whole = regime.estimate_separation(x, y, a, 2)
    acc = regime.SeparationAccumulator(x.shape[1], 2, 2)
    for rows in np.array_split(np.arange(len(x)), 7):
        acc.add(x[rows], y[rows], a[rows])
    assert acc.result() == pytest.approx(whole, abs=2e-4)
    # a per-group cap: big groups are sampled and reweighted, small ones kept whole
    split = np.full(len(x), "train", dtype=object)
    keep, weights = regime.train_sample(split, y, a, 2, seed=0, per_group=500)
    g = y * 2 + a
    assert all(int(keep[g == gg].sum()) == min(500, int((g == gg).sum())) for gg in range(4))
    assert set(weights) == {0, 3} and weights[0] == pytest.approx((g == 0).sum() / 500)
    acc = regime.SeparationAccumulator(x.shape[1], 2, 2, weights)
    acc.add(x[keep], y[keep], a[keep])
    sampled = acc.result()
    for k in ("cue", "core"):
        assert sampled[k] == pytest.approx(gaussian_shortcut.separation(cfg)[k], rel=0.1)


def test_predicted_direction_and_exact_cues() -> None:
    assert regime.predicted_direction({"cue": 10.0, "core": 2.0}) == MORE
    assert regime.predicted_direction({"cue": 1.0, "core": 2.0}) == LESS
    assert "no prediction" in regime.predicted_direction({"cue": None, "core": 2.0})
    assert "no prediction" in regime.predicted_direction(None)
    exact = defaults("dataset", "gaussian_shortcut", spurious_noise=0.0)
    assert gaussian_shortcut.separation(exact)["cue"] == float("inf")
    assert regime.predicted_direction(gaussian_shortcut.separation(exact)) == MORE
    assert gaussian_shortcut.separation(dataclasses.replace(exact, spurious_scale=0.0))["cue"] == 0.0


def test_gaussian_knobs_place_cue_and_noise_and_keep_population_consistent() -> None:
    cfg = defaults("dataset", "gaussian_shortcut", cue_dims=3, d_noise=50, noise_std=2.0, noise_scaling="per_dim")
    y, a, x = gaussian_shortcut.sample_split(cfg, 20_000, 0.5, np.random.default_rng(0))
    assert x.shape == (20_000, 1 + 3 + 50)
    for attr in (0, 1):
        cue = x[a == attr, 1:4]
        assert np.allclose(cue.mean(axis=0), (2 * attr - 1) * cfg.spurious_scale, atol=0.02)
        assert np.allclose(cue.std(axis=0), cfg.spurious_noise, rtol=0.05)
    # per_dim: each noise dimension has variance noise_std²/d_noise, the total stays noise_std²
    assert np.var(x[:, 4:], axis=0).sum() == pytest.approx(cfg.noise_std**2, rel=0.05)
    none = dataclasses.replace(cfg, noise_scaling="none")
    assert np.allclose(gaussian_shortcut.group_std(none)[4:], 2.0)
    # population LDA at rho: the cue dimensions move together with a, so they covary within a class
    rho = 0.8
    y, a, x = gaussian_shortcut.sample_split(cfg, 40_000, rho, np.random.default_rng(1))
    means, cov, _ = gaussian_shortcut.population_lda(cfg, rho)
    for c in (0, 1):
        assert np.allclose(x[y == c].mean(axis=0), means[c], atol=0.03)
    pooled = sum(np.cov(x[y == c][:, :4].T) * (y == c).sum() for c in (0, 1)) / len(y)
    assert np.allclose(pooled, cov[:4, :4], atol=0.03)
    assert cov[1, 2] == pytest.approx(4 * rho * (1 - rho) * cfg.spurious_scale**2)


def test_gaussian_noise_dimensions_far_beyond_n() -> None:
    cfg = defaults("dataset", "gaussian_shortcut", d_noise=4000, n_train=200, n_val=50, n_test_id=50, n_test_ood=200)
    start = time.perf_counter()
    columns, meta = gaussian_shortcut.generate(cfg)
    assert time.perf_counter() - start < 5
    assert columns["x"].shape == (500, 4002) and columns["x"].dtype == np.float32  # 8 MB
    assert meta["shape"] == [4002] and meta["separation"] == {"cue": 10.0, "core": 2.0}


def test_colored_digits_knobs() -> None:
    images, digits = colored_digits.load_images()
    images, a = images[:200], (digits[:200] % 2).astype(np.int64)

    def render(form: str, **kw: float) -> np.ndarray:
        return colored_digits.render(images, a, form, 0.1, np.random.default_rng(0), **kw)

    for form in ("color", "background"):
        # the whole image is the colour / background form's own footprint: same bytes
        assert np.array_equal(render(form), render(form, cue_pixels=64))
        # no gap: the attribute leaves no trace (flipping it, same images)
        def flat(attr: np.ndarray, form: str = form) -> np.ndarray:
            return colored_digits.render(images, attr, form, 0.0, np.random.default_rng(0), cue_gap=0.0)

        assert np.array_equal(flat(a), flat(1 - a)) and not np.array_equal(render(form), render(form, cue_gap=0.5))
    # the cue outside the first k pixels (row-major) is the midpoint level, whatever a
    bg = colored_digits.render(images, a, "background", 0.0, np.random.default_rng(0), cue_pixels=16)
    blank = images.reshape(len(images), -1)[:, 16:] == 0
    assert np.allclose(bg[:, 2].reshape(len(images), -1)[:, 16:][blank], np.mean(colored_digits.BACKGROUND))
    # marker: k pixels per attribute, at the marker level cue_gap
    mk = colored_digits.render(images, a, "marker", 0.0, np.random.default_rng(0), cue_gap=0.5, cue_pixels=5)
    for attr in (0, 1):
        for row, col in colored_digits.MARKER_PIXELS[attr][:5]:
            assert np.all(mk[a == attr, :, row, col] == 0.5)
    # pixel noise reaches every value; 0 draws nothing (so the default data keeps its bytes)
    noisy = render("color", pixel_noise=0.05)
    assert not np.array_equal(noisy, render("color")) and noisy.min() >= 0 and noisy.max() <= 1


def test_weaker_cue_knobs_lower_the_estimated_cue_separation() -> None:
    base = defaults("dataset", "colored_digits", spurious="background")
    sep = {gap: prepare("colored_digits", dataclasses.replace(base, cue_gap=gap))[1]["separation"] for gap in (1.0, 0.5)}
    assert sep[1.0]["cue"] > sep[1.0]["core"]  # the default: the shortcut regime
    assert sep[0.5]["cue"] < sep[1.0]["cue"] and sep[0.5]["core"] == pytest.approx(sep[1.0]["core"], rel=0.1)
    assert prepare("colored_digits", base)[1]["separation_source"] == "train"


def test_paper_regime_recipe_puts_every_cue_below_its_core_and_defaults_above() -> None:
    recipe = OmegaConf.load(ROOT / "conf" / "experiment" / "paper_regime.yaml")
    assert list(recipe.run.datasets) == ["gaussian_shortcut", "colored_digits", "mnist1d_shortcut"]
    assert set(recipe.run.methods) == {"lda", "qda", "diffusion", "autoregressive", "erm", "groupdro"}
    for name in recipe.run.datasets:
        paper = prepare(name, defaults("dataset", name, **OmegaConf.to_container(recipe.dataset[name])))[1]["separation"]
        assert paper["cue"] < paper["core"], (name, paper)
        assert regime.predicted_direction(paper) == LESS
        default = prepare(name, defaults("dataset", name))[1]["separation"]
        assert default["cue"] > default["core"], (name, default)
    gauss = defaults("dataset", "gaussian_shortcut", **OmegaConf.to_container(recipe.dataset.gaussian_shortcut))
    assert gauss.d_noise > 4 * gauss.n_train  # nuisance dimensions far beyond the train rows
