"""The model library: networks, LDA against its closed form, the training loop, save/load."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal, norm

from stages.core.config import defaults
from stages.core.io import ArtifactError, load_weights, save_weights
from stages.core.runtime import setup_torch
from stages.datasets import colored_digits
from stages.datasets import gaussian_shortcut as gaussian_shortcut_data
from stages.models import (
    CONFIG,
    HISTORY,
    WEIGHTS,
    atomic_dir,
    load_encoder,
    load_model,
    save_encoder,
    save_model,
)
from stages.models.groupdro import GroupDROLoss
from stages.models.lda_model import LDAClassifier, fit_lda
from stages.models.mlp import MLPClassifier
from stages.models.nets import DenoisingAutoencoder, MLPEncoder, Standardize
from stages.models.training import (
    FitOptions,
    SplitData,
    cross_entropy,
    distillation_loss,
    fit_classifier,
)

# ---- data built in the tests -------------------------------------------------------------


def gaussian_shortcut(n: int, rho: float, rng: np.random.Generator, *, sigma: float = 1.0, b: float = 1.0,
                      s: float = 0.2, d_noise: int = 2) -> SplitData:
    """Small unit-test data: core N(y±, σ²), spurious a±·B + N(0, s²) with a agreeing with y
    w.p. rho, N(0,1) noise dims. The shortcut tests below use the real generators instead."""
    y = rng.integers(0, 2, n)
    a = np.where(rng.random(n) < rho, y, 1 - y)
    ypm, apm = 2 * y - 1, 2 * a - 1
    x = np.column_stack([ypm + sigma * rng.standard_normal(n), apm * b + s * rng.standard_normal(n),
                         rng.standard_normal((n, d_noise))]).astype(np.float32)
    return SplitData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(y * 2 + a))


def gaussian_splits(seed: int = 0, n: int = 1000) -> dict[str, SplitData]:
    rng = np.random.default_rng(seed)
    return {
        "train": gaussian_shortcut(n, 0.95, rng),
        "val": gaussian_shortcut(n // 2, 0.95, rng),
        "test_id": gaussian_shortcut(n // 2, 0.95, rng),
        "test_ood": gaussian_shortcut(n // 2, 0.05, rng),
    }


def generated_splits(columns: dict[str, np.ndarray], n_attrs: int) -> dict[str, SplitData]:
    """A real generator's columns (stages.datasets) as SplitData per split."""
    g = columns["y"] * n_attrs + columns["a"]
    out = {}
    for name in ("train", "val", "test_id", "test_ood"):
        m = columns["split"] == name
        out[name] = SplitData(torch.from_numpy(np.ascontiguousarray(columns["x"][m], dtype=np.float32)),
                              torch.from_numpy(columns["y"][m].astype(np.int64)), torch.from_numpy(g[m].astype(np.int64)))
    return out


def mlp(splits: dict[str, SplitData], hidden: list[int]) -> MLPClassifier:
    train = splits["train"]
    in_dim = train.x.shape[1]
    return MLPClassifier(MLPEncoder(in_dim, hidden), 2, Standardize(in_dim).fit(train.x))


def fit(splits, loss, seed=0, epochs=5, selection="val_avg", hidden=(16,), lr=1e-2, batch_size=64):
    gen = setup_torch(seed)
    model = mlp(splits, list(hidden))
    result = fit_classifier(model, splits, loss, FitOptions(lr, epochs, batch_size, selection), gen)
    model.load_state_dict(result.state_dict)
    return model, result


# ---- networks --------------------------------------------------------------------------------


def test_standardize_keeps_constant_features_finite():
    x = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    st = Standardize(2).fit(x)
    assert torch.equal(st.std, torch.tensor([1.0, 1.0]))
    assert torch.isfinite(st(x)).all()


def test_logits_shape_dtype_and_bad_width():
    splits = gaussian_splits(n=64)
    model = mlp(splits, [8])
    out = model.logits(splits["val"].x.numpy(), batch_size=7)
    assert out.dtype == np.float32 and out.shape == (32, 2)
    np.testing.assert_allclose(out, model.logits(splits["val"].x.numpy()), rtol=1e-6, atol=1e-6)
    with pytest.raises(ArtifactError, match="shape"):
        model.logits(np.zeros((3, 5), np.float32))


# ---- learning --------------------------------------------------------------------------------


def test_erm_learns_easy_task():
    model, result = fit(gaussian_splits(), cross_entropy, epochs=5)
    assert result.selected_metrics["test_id"]["acc"] > 0.9
    logits = model.logits(gaussian_splits(seed=1)["test_id"].x.numpy())
    y = gaussian_splits(seed=1)["test_id"].y.numpy()
    assert (logits.argmax(1) == y).mean() > 0.9


def test_selection_picks_the_best_epoch_of_its_criterion():
    splits = gaussian_splits()
    for selection, split, metric in [("val_avg", "val", "acc"), ("val_worst_group", "val", "worst_group_acc"),
                                     ("oracle", "test_ood", "worst_group_acc")]:
        _, result = fit(splits, cross_entropy, epochs=4, selection=selection)
        hist = result.history.to_pylist()
        assert len(hist) == 4 * 4 and {r["epoch"] for r in hist} == {1, 2, 3, 4}
        scores = [r[metric] for r in hist if r["split"] == split]
        assert result.selected_epoch == int(np.argmax(scores)) + 1  # earliest best
        assert result.selected_metrics[split][metric] == max(scores)


def test_training_is_deterministic_given_the_seed():
    splits = gaussian_splits(n=300)
    m1, r1 = fit(splits, GroupDROLoss(4, 0.1), seed=3, epochs=2)
    m2, r2 = fit(splits, GroupDROLoss(4, 0.1), seed=3, epochs=2)
    m3, _ = fit(splits, GroupDROLoss(4, 0.1), seed=4, epochs=2)
    assert r1.history.equals(r2.history)
    for k, v in m1.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k])
    assert not torch.equal(m1.head.weight, m3.head.weight)


def test_groupdro_upweights_the_worst_group():
    loss = GroupDROLoss(n_groups=2, eta=1.0)
    logits = torch.tensor([[5.0, 0.0], [5.0, 0.0], [5.0, 0.0]])  # group 1 is misclassified
    batch = {"y": torch.tensor([0, 0, 1]), "g": torch.tensor([0, 0, 1])}
    value = loss(logits, batch)
    assert loss.q[1] > 0.9 > loss.q[0]
    per_group = torch.nn.functional.cross_entropy(logits, batch["y"], reduction="none")
    expected = loss.q[0] * per_group[:2].mean() + loss.q[1] * per_group[2]
    assert torch.isclose(value, expected)


def test_distillation_loss_vanishes_when_the_student_copies_the_teacher():
    logits = torch.randn(10, 3)
    batch = {"teacher": logits.clone(), "y": torch.randint(0, 3, (10,))}
    assert distillation_loss(2.0, 1.0)(logits, batch).abs() < 1e-6
    mixed = distillation_loss(2.0, 0.25)(logits, batch)
    assert torch.isclose(mixed, 0.75 * torch.nn.functional.cross_entropy(logits, batch["y"]), atol=1e-6)


def test_groupdro_beats_erm_on_worst_group_of_colored_digits():
    cfg = defaults("dataset", "colored_digits")  # the real generator at its defaults: colour cue, rho_train 0.95, reversed test_ood
    assert cfg.rho_train == 0.95
    columns, meta = colored_digits.generate(cfg)
    splits = generated_splits(columns, meta["n_attrs"])
    kw = dict(epochs=10, selection="val_worst_group", hidden=(64,), lr=1e-3, batch_size=64)
    _, erm = fit(splits, cross_entropy, **kw)
    _, dro = fit(splits, GroupDROLoss(4, 0.1), **kw)
    erm_wga = erm.selected_metrics["test_ood"]["worst_group_acc"]
    dro_wga = dro.selected_metrics["test_ood"]["worst_group_acc"]
    assert erm_wga < 0.2 and dro_wga > erm_wga + 0.3, (erm_wga, dro_wga)


# ---- LDA -------------------------------------------------------------------------------------


def group_accuracy(w: np.ndarray, bias: float, y_pm: int, mu_g: np.ndarray, cov_g: np.ndarray) -> float:
    """P(the rule sign(w·x + bias) is right) for x ~ N(mu_g, diag(cov_g)) of class y_pm."""
    return float(norm.cdf(y_pm * (w @ mu_g + bias) / math.sqrt(w @ (cov_g * w))))


def test_lda_matches_closed_form_population_worst_group_accuracy():
    # The real generator: 100k train examples at rho 0.95, and a test_ood split at rho 0.5 so
    # that all four groups are equally large (every group's accuracy is measured precisely).
    cfg = defaults("dataset", "gaussian_shortcut", spurious_noise=0.5, d_noise=3, n_train=100_000, n_val=8,
                   n_test_id=8, n_test_ood=200_000, rho_train=0.95, rho_ood=0.5)
    columns, meta = gaussian_shortcut_data.generate(cfg)
    splits = generated_splits(columns, meta["n_attrs"])
    train, test = splits["train"], splits["test_ood"]
    model = fit_lda(train.x.numpy(), train.y.numpy(), 2, shrinkage=0.0)

    # Population LDA at rho_train (closed form, stages.datasets.gaussian_shortcut.population_lda):
    # μ_y = (y±, (2ρ−1)·y±·B, 0…), shared covariance diag(σ², s² + 4ρ(1−ρ)B², 1, …), equal priors.
    means_pop, cov_pop, priors_pop = gaussian_shortcut_data.population_lda(cfg)
    np.testing.assert_allclose(model.means.numpy(), means_pop, atol=0.02)
    np.testing.assert_allclose(model.covariance.numpy(), cov_pop, atol=0.02)
    np.testing.assert_allclose(np.exp(model.log_priors.numpy()), priors_pop, atol=0.005)
    # Its rule: logit₁ − logit₀ = w·x + bias, w = Σ⁻¹(μ₁ − μ₀), bias 0 (equal priors, μ₀ = −μ₁).
    w_pop = np.linalg.solve(cov_pop, means_pop[1] - means_pop[0])
    bias_pop = -0.5 * (means_pop[1] + means_pop[0]) @ w_pop + math.log(priors_pop[1] / priors_pop[0])
    # The fitted model's own linear rule.
    means, cov, log_pi = model.means.numpy(), model.covariance.numpy(), model.log_priors.numpy()
    w_fit = np.linalg.solve(cov, means[1] - means[0])
    bias_fit = -0.5 * (means[1] + means[0]) @ w_fit + log_pi[1] - log_pi[0]

    correct = model.logits(test.x.numpy()).argmax(1) == test.y.numpy()
    accs, population = {}, {}
    for grp in gaussian_shortcut_data.population_groups(cfg, rho=cfg.rho_ood):
        g = grp.y * 2 + grp.a
        group_var = np.diag(grp.cov)  # within a group the spurious sign is fixed
        y_pm = 2 * grp.y - 1
        population[g] = group_accuracy(w_pop, bias_pop, y_pm, grp.mean, group_var)
        fitted = group_accuracy(w_fit, bias_fit, y_pm, grp.mean, group_var)
        in_g = test.g.numpy() == g
        accs[g] = correct[in_g].mean()
        se = math.sqrt(fitted * (1 - fitted) / in_g.sum())
        # Test sampling error only: the fitted rule's exact accuracy vs its observed accuracy.
        # 3.5 SE per group keeps the family-wise false-alarm rate over 4 groups near 0.2 %.
        assert abs(accs[g] - fitted) < 3.5 * se, (g, accs[g], fitted, se)
        # Estimation error of the rule from 100k examples (sd ≈ 0.004 for the minority groups).
        assert abs(fitted - population[g]) < 0.012, (g, fitted, population[g])
    assert sorted(accs) == [0, 1, 2, 3]
    assert abs(min(accs.values()) - min(population.values())) < 0.015
    assert min(population.values()) < 0.3 and max(population.values()) > 0.95  # the shortcut bites


def test_lda_logits_are_the_joint_log_density():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((200, 3)) + np.array([0.0, 1.0, 2.0])
    y = (rng.random(200) < 0.3).astype(np.int64)
    x[y == 1] += 1.5
    model = fit_lda(x, y, 2, shrinkage=0.2)
    cov, means, log_pi = model.covariance.numpy(), model.means.numpy(), model.log_priors.numpy()
    expected = np.stack([multivariate_normal(means[k], cov).logpdf(x[:5]) + log_pi[k] for k in range(2)], 1)
    np.testing.assert_allclose(model.logits(x[:5].astype(np.float32)), expected, rtol=1e-5)
    np.testing.assert_allclose(np.exp(log_pi), [np.mean(y == 0), np.mean(y == 1)])


def test_lda_rejects_singular_covariance_and_missing_classes():
    x = np.column_stack([np.random.default_rng(0).standard_normal(50), np.zeros(50)])
    y = np.arange(50) % 2
    with pytest.raises(ValueError, match="shrinkage"):
        fit_lda(x, y, 2, shrinkage=0.0)
    assert fit_lda(x, y, 2, shrinkage=0.1).logits(x.astype(np.float32)).shape == (50, 2)
    with pytest.raises(ValueError, match=r"\[2\]"):
        fit_lda(x, y, 3, shrinkage=0.1)


# ---- save / load -----------------------------------------------------------------------------


def saved_mlp(tmp_path: Path) -> tuple[Path, MLPClassifier, np.ndarray]:
    splits = gaussian_splits(n=200)
    model, result = fit(splits, cross_entropy, epochs=2, hidden=(8, 4))
    folder = tmp_path / "models" / "mlp" / "seed=0"
    save_model(folder, model, {"method": "erm", "selected_epoch": result.selected_epoch}, result.history)
    return folder, model, splits["test_id"].x.numpy()


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    folder, model, x = saved_mlp(tmp_path)
    assert {p.name for p in folder.iterdir()} == {WEIGHTS, CONFIG, HISTORY}
    loaded = load_model(folder)
    assert loaded.kind == "mlp" and loaded.n_classes == 2
    np.testing.assert_array_equal(loaded.logits(x), model.logits(x))

    rng = np.random.default_rng(0)
    xl = rng.standard_normal((100, 4))
    lda = fit_lda(xl, np.arange(100) % 2, 2, shrinkage=0.1)
    save_model(tmp_path / "lda", lda, {"method": "lda"}, None)
    loaded_lda = load_model(tmp_path / "lda")
    assert loaded_lda.kind == "lda" and loaded_lda.means.dtype == torch.float64
    np.testing.assert_array_equal(loaded_lda.logits(xl.astype(np.float32)), lda.logits(xl.astype(np.float32)))
    assert not (tmp_path / "lda" / HISTORY).exists()


def test_load_rejects_a_truncated_file(tmp_path):
    folder, _, _ = saved_mlp(tmp_path)
    path = folder / WEIGHTS
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ArtifactError, match=str(path)):
        load_model(folder)


class _Bomb:
    """Unpickling this writes a marker file: proof that a pickle was executed."""

    marker: Path

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled!"))


def test_load_never_unpickles(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    bomb = _Bomb()
    bomb.marker = tmp_path / "marker"
    (folder / WEIGHTS).write_bytes(pickle.dumps(bomb))
    torch.save({"w": torch.zeros(2)}, folder / "other.pt")  # a torch pickle is no better
    with pytest.raises(ArtifactError, match=str(folder / WEIGHTS)):
        load_model(folder)
    assert not bomb.marker.exists()
    (folder / WEIGHTS).write_bytes((folder / "other.pt").read_bytes())
    with pytest.raises(ArtifactError, match=str(folder / WEIGHTS)):
        load_model(folder)


def test_load_rejects_weights_of_another_architecture(tmp_path):
    folder, model, _ = saved_mlp(tmp_path)
    path = folder / WEIGHTS
    tensors, meta = load_weights(path)
    save_weights(tensors, path, {**meta, "hidden": [8, 5]})  # declared shape differs from the tensors
    with pytest.raises(ArtifactError, match=rf"{path}.*encoder.net.2.weight"):
        load_model(folder)
    save_weights(tensors, path, {**meta, "hidden": [8]})  # one layer fewer: extra tensors
    with pytest.raises(ArtifactError, match=rf"{path}.*unexpected"):
        load_model(folder)
    save_weights({k: v.double() for k, v in tensors.items()}, path, meta)  # right shapes, wrong dtype
    with pytest.raises(ArtifactError, match=rf"{path}.*float64"):
        load_model(folder)
    save_weights(tensors, path, {**meta, "kind": "resnet"})
    with pytest.raises(ArtifactError, match=rf"{path}.*unknown model kind"):
        load_model(folder)
    save_weights(tensors, path, {**meta, "in_dim": "4"})
    with pytest.raises(ArtifactError, match=rf"{path}.*in_dim"):
        load_model(folder)
    with pytest.raises(ArtifactError, match="not found"):
        load_model(tmp_path / "nowhere")


def test_a_failed_save_leaves_the_previous_folder_intact(tmp_path):
    folder, _, _ = saved_mlp(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ValueError):
        save_model(folder, LDAClassifier(3, 2), {"bad": float("nan")}, None)  # JSON rejects NaN
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folders left
    with atomic_dir(folder) as tmp:
        (tmp / "new").write_text("x")
    assert [p.name for p in folder.iterdir()] == ["new"]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_encoder_round_trip(tmp_path):
    dae = DenoisingAutoencoder(6, [5, 3])
    dae.standardize.fit(torch.randn(20, 6) * 3 + 1)
    save_encoder(tmp_path / "enc.safetensors", dae)
    standardize, encoder = load_encoder(tmp_path / "enc.safetensors")
    assert encoder.hidden == [5, 3] and encoder.in_dim == 6
    x = torch.randn(4, 6)
    assert torch.equal(encoder(standardize(x)), dae.encoder(dae.standardize(x)))
    tensors, _ = load_weights(tmp_path / "enc.safetensors")
    assert not any(k.startswith("decoder") for k in tensors)
