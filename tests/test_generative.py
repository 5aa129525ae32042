"""Generative classifiers: qda, diffusion, autoregressive — learning, scoring rules, save/load, config."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from stages import evaluate, train
from stages.core.artifacts import Prepared, model_dir, predictions_path, read_prepared
from stages.core.config import ConfigError, defaults, load_params, method_config
from stages.core.io import read_json
from stages.core.runtime import setup_torch
from stages.models import CONFIG, WEIGHTS, load_model, save_model
from stages.models.autoregressive_model import (
    AutoregressiveClassifier,
    ByteTokenizer,
    QuantileTokenizer,
    train_autoregressive,
)
from stages.models.diffusion_model import DiffusionClassifier, train_diffusion
from stages.models.draw_order import draw_noise, stratum_order
from stages.models.qda_model import fit_qda

ROOT = Path(__file__).resolve().parents[1]


def blobs(n_classes: int = 2, n: int = 300, dim: int = 4, sep: float = 2.5, seed: int = 0) -> Prepared:
    """Gaussian blobs, class k centred at sep·e_(k mod dim) (and −sep for k >= dim); a random attribute."""
    rng = np.random.default_rng(seed)
    sizes = {"train": n, "val": n // 2, "test_id": n // 2, "test_ood": n // 2}
    split = np.concatenate([[s] * m for s, m in sizes.items()]).astype(object)
    total = len(split)
    y = rng.integers(0, n_classes, total)
    centres = np.zeros((n_classes, dim))
    for k in range(n_classes):
        centres[k, k % dim] = sep if k < dim else -sep
    x = (centres[y] + rng.standard_normal((total, dim))).astype(np.float32)
    a = rng.integers(0, 2, total)
    meta = {"dataset": "blobs", "n_classes": n_classes, "n_attrs": 2, "shape": [dim]}
    return Prepared(np.arange(total), split, y, a, y * 2 + a, x, meta)


def diffusion_cfg(**kw) -> types.SimpleNamespace:
    base = dict(denoiser="auto", width=32, channels=4, depth=1, steps=50, schedule="cosine", weighting="simple",
                draws=16, prune_draws=4, prune_keep=0, score_seed=0, score_rows=4096, class_dropout=0.0,
                select_draws=4, lr=3e-3, weight_decay=0.0, epochs=15, batch_size=64, selection="val_avg", eval_every=5)
    return types.SimpleNamespace(**{**base, **kw})


def accuracy(logits: np.ndarray, prepared: Prepared, split: str) -> float:
    m = prepared.mask(split)
    return float((logits[m].argmax(1) == prepared.y[m]).mean())


@pytest.fixture(scope="module")
def four_class_diffusion() -> tuple[DiffusionClassifier, Prepared]:
    prepared = blobs(n_classes=4, n=400, seed=1)
    model, _ = train_diffusion(prepared, diffusion_cfg(), seed=0)
    return model, prepared


# ---- learning -----------------------------------------------------------------------------


def test_diffusion_learns_four_classes(four_class_diffusion):
    model, prepared = four_class_diffusion
    logits = model.logits(prepared.x)
    assert accuracy(logits, prepared, "test_id") > 0.8  # chance is 0.25
    ll = model.log_likelihood(prepared.x)
    assert ll.shape == (len(prepared.x),) and np.isfinite(ll).all()


def test_diffusion_conv_denoiser_learns_images():
    prepared = blobs(n_classes=2, n=200, dim=12, sep=4.0, seed=2)
    prepared.meta["shape"] = [3, 2, 2]
    model, result = train_diffusion(prepared, diffusion_cfg(epochs=20, channels=16, eval_every=10), seed=0)
    assert model.denoiser_kind == "conv" and result.selected_epoch in (10, 20)
    assert accuracy(model.logits(prepared.x), prepared, "test_id") > 0.8


def test_conv_diffusion_stopped_mid_training_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, capsys):
    """SIGTERM after epoch 2 (unscored: eval_every=3) writes a checkpoint of channels-last conv
    weights, their AdamW state and the generator the loss draws t, ε and class dropout from;
    the re-run resumes from it and ends with the weights and history of a run never stopped."""
    from stages.core.checkpoint import Checkpointer
    from stages.core.io import StageInterrupted

    monkeypatch.chdir(tmp_path)
    prepared = blobs(n_classes=2, n=100, dim=12, sep=4.0, seed=2)
    prepared.meta["shape"] = [3, 2, 2]
    cfg = diffusion_cfg(epochs=4, eval_every=3, channels=4, steps=20, draws=4, select_draws=2, class_dropout=0.2)
    whole, full = train_diffusion(prepared, cfg, seed=0)
    ckpt = Checkpointer("train@blobs-diffusion-0", {"config": "c", "inputs": "i", "code": "k"}, every=0)
    monkeypatch.setenv("SHIFTLAB_FAULT", "term_after_epoch:2")
    with pytest.raises(StageInterrupted, match="stopped by SIGTERM after epoch 2/4"):
        train_diffusion(prepared, cfg, seed=0, checkpoint=ckpt)
    assert [p.name for p in ckpt.files()] == ["epoch-000002.safetensors"]

    monkeypatch.delenv("SHIFTLAB_FAULT")
    capsys.readouterr()
    resumed, result = train_diffusion(prepared, cfg, seed=0, checkpoint=ckpt)
    assert "resuming from scratch/checkpoints/train@blobs-diffusion-0/epoch-000002.safetensors (epoch 2)" in capsys.readouterr().err
    assert resumed.denoiser_kind == "conv" and result.selected_epoch == full.selected_epoch
    assert result.history.equals(full.history)
    # Scored (the splits selection reads: val, test_ood) at epochs 3 and 4; the selected weights
    # on every split once; the objective on train and val every epoch.
    rows = full.history.to_pylist()
    assert [(r["epoch"], r["split"]) for r in rows if r["acc"] is not None] == [(e, s) for e in (3, 4) for s in ("val", "test_ood")]
    assert set(full.selected_metrics) == {"train", "val", "test_id", "test_ood"}
    picked = next(r for r in rows if r["epoch"] == full.selected_epoch and r["split"] == "val")
    assert full.selected_metrics["val"]["acc"] == picked["acc"]
    assert [(r["epoch"], r["split"]) for r in rows if r["objective"] is not None] == [(e, s) for e in (1, 2, 3, 4) for s in ("train", "val")]
    expected = whole.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in resumed.state_dict().items())


def test_autoregressive_learns_and_scores_all_classes_in_one_model():
    prepared = blobs(n_classes=2, n=300, dim=6, seed=3)
    cfg = types.SimpleNamespace(bins=8, bin_edges="quantile", d_model=16, layers=1, heads=2, ff=32, lr=1e-2,
                                weight_decay=0.0, epochs=6, batch_size=64, selection="val_avg", eval_every=3)
    model, result = train_autoregressive(prepared, cfg, seed=0)
    logits = model.logits(prepared.x)
    assert accuracy(logits, prepared, "test_id") > 0.8
    # Exact likelihood of the tokens: log p(x̃) = logsumexp_y log p(x̃, y) <= 0 for a discrete model.
    ll = model.log_likelihood(prepared.x)
    assert np.all(ll <= 0) and np.allclose(ll, np.logaddexp(logits[:, 0].astype(np.float64), logits[:, 1]), atol=1e-3)
    assert [r["epoch"] for r in result.history.to_pylist() if r["split"] == "val" and r["acc"] is not None] == [3, 6]
    assert [r["epoch"] for r in result.history.to_pylist() if r["split"] == "val" and r["objective"] is not None] == [1, 2, 3, 4, 5, 6]


def test_autoregressive_takes_text_through_the_byte_tokenizer():
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("ab" if k else "cd"), rng.integers(3, 9))) for k in (0, 1) for _ in range(40)]
    y = torch.tensor([0] * 40 + [1] * 40)
    setup_torch(0)
    model = AutoregressiveClassifier(0 + 1, 2, ByteTokenizer(10), d_model=16, layers=1, heads=2, ff=32)
    tokens, mask = model.tokenizer.encode(texts)
    assert mask.sum(1).tolist() == [len(t) + 1 for t in texts]  # bytes + end token
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        loss = -model.sequence_log_prob(tokens, mask, y).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    logits = model.logits(np.array(["abba", "dcdc", "baab", "ccd"], dtype=object))
    assert logits.argmax(1).tolist() == [1, 0, 1, 0]


def test_autoregressive_learns_shortcut_text_from_bytes_and_round_trips(tmp_path):
    """input=auto on a text dataset: the byte-level model trains and scores on `text`; the saved
    model records tokenizer and max_len, and declares input == "text" for evaluate."""
    from stages.core import io
    from stages.core.artifacts import prepared_schema_for
    from stages.prepare import prepare

    table, meta = prepare("shortcut_text", defaults("dataset", "shortcut_text", n_train=800, n_val=60, n_test_id=100, n_test_ood=60))
    io.write_parquet(table, tmp_path / "t.parquet", prepared_schema_for(meta), meta)
    prepared = read_prepared(tmp_path / "t.parquet")
    assert prepared.text is not None
    cfg = types.SimpleNamespace(bins=8, bin_edges="quantile", d_model=32, layers=1, heads=2, ff=64, lr=1e-2,
                                weight_decay=0.0, epochs=30, batch_size=32, selection="val_avg", eval_every=30,
                                input="auto", max_len=40)
    model, _ = train_autoregressive(prepared, cfg, seed=0)
    assert model.input == "text" and isinstance(model.tokenizer, ByteTokenizer)
    logits = model.logits(prepared.text)
    assert accuracy(logits, prepared, "test_id") > 0.8  # chance is 0.5
    save_model(tmp_path / "m", model, {}, None)
    loaded = load_model(tmp_path / "m")
    assert loaded.arch()["tokenizer"] == "bytes" and loaded.arch()["max_len"] == 40 and loaded.input == "text"
    assert np.array_equal(loaded.logits(prepared.text), logits)
    with pytest.raises(ValueError, match="input=text"):
        train_autoregressive(blobs(), types.SimpleNamespace(**{**vars(cfg), "input": "text"}), seed=0)


def test_qda_matches_sklearn_and_learns():
    from sklearn.discriminant_analysis import QuadraticDiscriminantAnalysis

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, (60, 3)), rng.normal(1, 2, (40, 3)) @ np.diag([1, 0.5, 2])])
    y = np.array([0] * 60 + [1] * 40)
    model = fit_qda(x, y, 2, shrinkage=0.0)
    ref = QuadraticDiscriminantAnalysis(store_covariance=True).fit(x, y)
    joint = model.logits(x).astype(np.float64)
    log_post = joint - np.logaddexp(joint[:, 0], joint[:, 1])[:, None]
    np.testing.assert_allclose(log_post, ref.predict_log_proba(x), atol=1e-4)
    np.testing.assert_allclose(model.covariances.numpy(), np.stack(ref.covariance_), rtol=1e-10)
    # log p(x) is the mixture density; a shrunk fit still separates the classes.
    assert np.allclose(model.log_likelihood(x), np.logaddexp(joint[:, 0], joint[:, 1]), atol=1e-4)
    assert (fit_qda(x, y, 2, shrinkage=0.2).logits(x).argmax(1) == y).mean() > 0.7


# ---- diffusion scoring rules ----------------------------------------------------------------


def test_timesteps_are_stratified_and_prefixes_spread():
    assert sorted(stratum_order(8)) == list(range(8)) and list(stratum_order(8)[:2]) == [0, 4]
    t, eps = draw_noise(50, 8, 3, 96, torch.Generator().manual_seed(0))
    assert t.shape == (50, 8) and eps.shape == (50, 8, 3)
    strata = (t - 1) * 8 // 96  # each draw lands in its own eighth of [1, T]
    assert (strata == torch.from_numpy(stratum_order(8))).all()
    assert int(t.min()) >= 1 and int(t.max()) <= 96


def test_draws_are_shared_by_every_class_in_one_forward(four_class_diffusion):
    model, prepared = four_class_diffusion
    seen = []
    hook = model.denoiser.register_forward_hook(lambda m, args, out: seen.append([a.clone() for a in args]))
    try:
        model.score(prepared.x[:10], draws=6)
    finally:
        hook.remove()
    assert len(seen) == 1  # 10 examples × 4 classes × 6 draws: one batched forward
    x_rows, t_rows, y_rows = seen[0]
    x_rows, t_rows, y_rows = x_rows.view(10, 4, 6, -1), t_rows.view(10, 4, 6), y_rows.view(10, 4, 6)
    for k in range(1, 4):  # every class sees exactly the same noisy inputs and timesteps
        assert torch.equal(x_rows[:, k], x_rows[:, 0]) and torch.equal(t_rows[:, k], t_rows[:, 0])
    assert (y_rows == torch.arange(4)[None, :, None]).all()


@pytest.mark.parametrize("weighting", ["simple", "elbo"])
def test_batched_scores_equal_an_unbatched_reference_loop(four_class_diffusion, weighting):
    model, prepared = four_class_diffusion
    model.weighting = weighting
    try:
        z = model.standardize(torch.from_numpy(prepared.x[:5].copy()))
        t, eps = draw_noise(5, 6, model.in_dim, model.steps, torch.Generator().manual_seed(3))
        with torch.no_grad():
            batched, elbo, rows = model.score_draws(z, t, eps)
            ref = np.zeros((5, 4))
            for i in range(5):
                for y in range(4):
                    terms = []
                    for s in range(6):
                        ti = t[i, s]
                        z_t = model.sqrt_ab[ti] * z[i] + model.sqrt_1m_ab[ti] * eps[i, s]
                        e = float(((model.denoiser(z_t[None], ti[None], torch.tensor([y])) - eps[i, s]) ** 2).sum())
                        w = model.steps * float(model.elbo_w[ti]) if weighting == "elbo" else 1.0
                        terms.append(w * e)
                    # The log prior joins a log-likelihood bound (elbo) only; see the next test.
                    ref[i, y] = -np.mean(terms) + (float(model.log_priors[y]) if weighting == "elbo" else 0.0)
    finally:
        model.weighting = "simple"
    assert rows == 5 * 4 * 6
    np.testing.assert_allclose(batched.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_simple_weighting_scores_without_the_prior_and_elbo_with_it():
    # Strongly imbalanced training priors: with `simple` the logits must be exactly the
    # −mean unweighted error (no log π term, which is not on its scale); with `elbo`, the
    # ELBO estimate plus log π (Bayes' rule on a log-likelihood bound).
    torch.manual_seed(0)
    model = DiffusionClassifier(4, 3, width=8, depth=1, steps=20, weighting="simple", draws=6).eval()
    priors = torch.log(torch.tensor([0.9, 0.08, 0.02], dtype=torch.float64))
    model.log_priors.copy_(priors)
    z = torch.randn(7, 4)
    t, eps = draw_noise(7, 6, 4, 20, torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = model.errors(z, t, eps, torch.arange(3).expand(7, 3)).double()
        logits, elbo, _ = model.score_draws(z, t, eps)
        assert torch.equal(logits, (-err.mean(-1)).float())
        # Pruning ranks and scores by the same prior-free score.
        pruned = DiffusionClassifier.from_arch({**model.arch(), "prune_keep": 1, "prune_draws": 2})
        pruned.load_state_dict(model.state_dict())
        p_logits, _, _ = pruned.eval().score_draws(z, t, eps)
        kept = p_logits.argmax(1, keepdim=True)
        assert torch.equal(p_logits.gather(1, kept), logits.gather(1, kept))
        model.weighting = "elbo"
        e_logits, e_elbo, _ = model.score_draws(z, t, eps)
    assert torch.equal(e_elbo, elbo)  # the ELBO part does not depend on the weighting
    assert torch.equal(e_logits, (elbo + priors).float())
    assert torch.equal(model.score_prior(), priors)


def test_pruning_matches_full_scoring_at_fewer_evaluations(four_class_diffusion):
    model, prepared = four_class_diffusion
    full_logits, full_ll, full_rows = model.score(prepared.x)
    arch = {**model.arch(), "prune_keep": 2, "prune_draws": 4}
    pruned_model = DiffusionClassifier.from_arch(arch)
    pruned_model.load_state_dict(model.state_dict())
    pruned_logits, _, pruned_rows = pruned_model.score(prepared.x)
    assert pruned_rows == len(prepared.x) * (4 * 4 + 2 * 12) < full_rows == len(prepared.x) * 4 * 16
    full_pred, pruned_pred = full_logits.argmax(1), pruned_logits.argmax(1)
    assert (full_pred == pruned_pred).mean() >= 0.9  # 4 overlapping blobs; the benchmark measures real data
    # The kept classes see the same draws as full scoring, so their scores are identical; a pruned
    # class can never win.
    kept = np.argsort(-pruned_logits, axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.take_along_axis(pruned_logits, kept, 1), np.take_along_axis(full_logits, kept, 1))
    survived = (kept == full_pred[:, None]).any(1)
    assert survived.mean() >= 0.9 and (pruned_pred[survived] == full_pred[survived]).all()


def test_scores_do_not_depend_on_batch_size_or_global_rng(four_class_diffusion):
    model, prepared = four_class_diffusion
    a = model.logits(prepared.x[:64], batch_size=7)
    torch.manual_seed(123)
    model._cache = None
    b = model.logits(prepared.x[:64], batch_size=4096)
    np.testing.assert_array_equal(a, b)


def test_generative_models_round_trip_through_safetensors(tmp_path, four_class_diffusion):
    model, prepared = four_class_diffusion
    ar = AutoregressiveClassifier(4, 4, QuantileTokenizer(4, 5, "uniform").fit(torch.from_numpy(prepared.x)), 8, 1, 2, 8)
    qda = fit_qda(prepared.x, prepared.y, 4, 0.1)
    for m in (model, ar, qda):
        folder = save_model(tmp_path / m.kind, m, {"method": m.kind}, None)
        loaded = load_model(folder)
        assert loaded.kind == m.kind
        np.testing.assert_array_equal(loaded.logits(prepared.x[:20]), m.logits(prepared.x[:20]))
        np.testing.assert_array_equal(loaded.log_likelihood(prepared.x[:20]), m.log_likelihood(prepared.x[:20]))
        assert read_json(folder / CONFIG)["inference_cost"]["macs"] > 0


# ---- config and the train stage ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("method.diffusion.steps=0", "method.diffusion.steps"),
        ("method.diffusion.draws=0", "method.diffusion.draws"),
        ("method.diffusion.weighting=vlb", "method.diffusion.weighting"),
        ("method.diffusion.prune_draws=32", None),  # fine while pruning is off
        ("method.autoregressive.bins=1", "method.autoregressive.bins"),
        ("method.autoregressive.heads=3", "method.autoregressive.heads"),
        ("method.qda.shrinkage=2", "method.qda.shrinkage"),
    ],
)
def test_bad_generative_config_names_the_key(override, key):
    params = load_params(ROOT / "params.yaml", [override])
    name = override.split(".")[1]
    if key is None:
        method_config(params, name)
        return
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        method_config(params, name)


def test_pruning_more_classes_than_the_data_has_fails_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    params = ["--params", str(ROOT / "params.yaml")]
    from stages import prepare
    small = [f"dataset.gaussian_shortcut.{k}=200" for k in ("n_train", "n_val", "n_test_id", "n_test_ood")]
    assert prepare.main(["gaussian_shortcut", *small, *params]) == 0
    capsys.readouterr()
    called = []
    monkeypatch.setattr("stages.models.diffusion_model.train_diffusion", lambda *a, **k: called.append(1))
    assert train.main(["gaussian_shortcut", "diffusion", "0", "method.diffusion.prune_keep=2", *params]) == 2
    err = capsys.readouterr().err
    assert "method.diffusion.prune_keep" in err and "n_classes (2)" in err and not called
    cfg = defaults("method", "diffusion", prune_keep=1)
    cfg.check_data("method.diffusion", 2)  # keeping 1 of 2 is allowed


def test_train_and_evaluate_stages_run_the_generative_methods(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = ["--params", str(ROOT / "params.yaml")]
    from stages import prepare
    small = [f"dataset.gaussian_shortcut.{k}=200" for k in ("n_train", "n_val", "n_test_id", "n_test_ood")]
    assert prepare.main(["gaussian_shortcut", *small, *params]) == 0
    tiny = {
        "diffusion": ["method.diffusion.epochs=40", "method.diffusion.eval_every=20", "method.diffusion.batch_size=32",
                      "method.diffusion.draws=4", "method.diffusion.select_draws=2"],
        "autoregressive": ["method.autoregressive.epochs=4", "method.autoregressive.eval_every=2",
                           "method.autoregressive.batch_size=32", "method.autoregressive.bins=8"],
        "qda": [],
    }
    for method, overrides in tiny.items():
        assert train.main(["gaussian_shortcut", method, "0", *overrides, *params]) == 0
        folder = model_dir("gaussian_shortcut", method, 0)
        config = read_json(folder / CONFIG)
        assert config["architecture"]["kind"] == method and (folder / WEIGHTS).is_file()
        assert config["reads_splits"] == (["train"] if method == "qda" else ["train", "val"])
        if method != "qda":
            assert config["selection"] == "val_worst_group" and config["selected_epoch"] >= 1
            assert set(config["selections"]) == {"val_avg", "val_worst_group", "oracle"}
        assert evaluate.main(["gaussian_shortcut", method, "0", *overrides, *params]) == 0  # the params it was trained under
        assert predictions_path("gaussian_shortcut", method, 0).is_file()
        assert config["metrics"]["test_id"]["acc"] > 0.7  # chance 0.5; the shortcut alone gives 0.95
    assert read_prepared("data/prepared/gaussian_shortcut.parquet").n_classes == 2


def test_stages_train_evaluate_and_distill_a_byte_level_autoregressive_model(tmp_path, monkeypatch):
    """On shortcut_text, input=auto trains on `text`; evaluate and distill pass the model text."""
    monkeypatch.chdir(tmp_path)
    params = ["--params", str(ROOT / "params.yaml")]
    from stages import distill, prepare
    small = [f"dataset.shortcut_text.{k}={n}" for k, n in (("n_train", 200), ("n_val", 60), ("n_test_id", 60), ("n_test_ood", 60))]
    assert prepare.main(["shortcut_text", *small, *params]) == 0
    tiny = ["method.autoregressive.epochs=2", "method.autoregressive.eval_every=2", "method.autoregressive.batch_size=64",
            "method.autoregressive.max_len=48"]
    assert train.main(["shortcut_text", "autoregressive", "0", *tiny, *params]) == 0
    folder = model_dir("shortcut_text", "autoregressive", 0)
    arch = read_json(folder / CONFIG)["architecture"]
    assert arch["tokenizer"] == "bytes" and arch["max_len"] == 48
    assert load_model(folder).input == "text"
    assert evaluate.main(["shortcut_text", "autoregressive", "0", *tiny, *params]) == 0
    assert predictions_path("shortcut_text", "autoregressive", 0).is_file()
    assert distill.main(["shortcut_text", "autoregressive", "0", "distill.epochs=1", *tiny, *params]) == 0
