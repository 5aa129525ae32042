"""Diffusion scoring at a fraction of the network evaluations: sequential elimination
(method.diffusion stop_se / stop_first / stop_every) against full scoring, and its exact count."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from stages.core.artifacts import Prepared
from stages.core.config import ConfigError, defaults
from stages.models.diffusion_model import DiffusionClassifier, train_diffusion
from stages.models.draw_order import difference_profile, draw_noise, profile_order
from stages.models.elimination import fit_scoring
from stages.models.training import split_data
from tests.test_generative import accuracy, blobs, diffusion_cfg


@pytest.fixture(autouse=True, scope="module")
def stage_threads() -> None:
    """Score under the runtime the stages set (setup_torch: its thread count), whatever ran
    before in this process: the sequential and full paths reduce in the same order there."""
    from stages.core.runtime import setup_torch

    setup_torch(0)


def tiny(k: int = 3, draws: int = 8, **scoring) -> DiffusionClassifier:
    """An untrained mlp classifier on 3-d inputs (random weights from seed 0)."""
    torch.manual_seed(0)
    model = DiffusionClassifier(3, k, [3], "mlp", 16, 1, 20, "cosine", "simple", draws, **scoring)
    model.standardize.fit(torch.randn(50, 3))
    return model.eval()


def same_weights(model: DiffusionClassifier, **scoring) -> DiffusionClassifier:
    other = DiffusionClassifier.from_arch({**model.arch(), **scoring})
    other.load_state_dict(model.state_dict())
    return other.eval()


X = np.random.default_rng(0).standard_normal((12, 3)).astype(np.float32)


def test_sequential_scoring_equals_full_scoring_when_its_threshold_is_off_or_never_clears():
    full = tiny()
    logits, loglik, rows = full.score(X)
    assert rows == len(X) * 3 * 8
    # Off (stop_se 0): the stored architecture and the scores are those of a model without the keys.
    off = same_weights(full, stop_se=0.0, stop_first=4)
    assert off.arch() == full.arch() and "stop_se" not in off.arch()
    assert off.score(X)[0].tobytes() == logits.tobytes()
    # On, but no class can ever be dropped: every class gets every draw, the same draws.
    never = same_weights(full, stop_se=1e30, stop_first=2, stop_every=3)
    seq_logits, seq_loglik, seq_rows = never.score(X)
    assert seq_rows == rows
    np.testing.assert_allclose(seq_logits, logits, rtol=1e-6)
    np.testing.assert_allclose(seq_loglik, loglik, rtol=1e-9)
    assert (seq_logits.argmax(1) == logits.argmax(1)).all()


def hand_count(model: DiffusionClassifier, x: np.ndarray, order: list[int] | None = None) -> tuple[int, np.ndarray]:
    """The rule of the module docstring, re-done by hand in numpy on the full error tensor of the
    same draws (taken in `order`, if given): (network evaluations, predictions)."""
    from scipy.stats import norm
    from scipy.stats import t as student_t

    k, s, first, every, se = model.n_classes, model.draws, model.stop_first, model.stop_every, model.stop_se
    gen = torch.Generator().manual_seed(model.score_seed)
    profile = np.asarray(model.stop_profile if model.stop_profile is not None else np.ones(s))
    with torch.no_grad():
        z = model.standardize(torch.from_numpy(x))
        t, eps = draw_noise(len(z), s, model.in_dim, model.steps, gen)
        if order is not None:
            t, eps = t[:, order], eps[:, order]
            profile = profile[order]
        err = model.errors(z, t, eps, torch.arange(k).expand(len(z), k)).double().numpy()
    rows, preds = 0, []
    for e in err:
        alive, hi = list(range(k)), first
        rows += k * first
        while True:
            means = [e[c, :hi].mean() for c in alive]
            leader = alive[int(np.argmin(means))]
            diffs = {c: e[c, :hi] - e[leader, :hi] for c in alive if c != leader}
            pooled = np.sqrt(np.mean([d.var(ddof=1) for d in diffs.values()]))
            kept = [leader]
            for c, d in diffs.items():
                if model.stop_test == "profile":  # predict the total over all S draws from the profile
                    seen, unseen = profile[:hi], profile[hi:].sum()
                    r = d @ seen / (seen @ seen)
                    s0, nu0 = model.stop_prior
                    var = (nu0 * s0 + ((d - r * seen) ** 2).sum()) / (nu0 + hi - 1)
                    q = student_t.ppf(norm.cdf(se), nu0 + hi - 1)
                    if not d.sum() + r * unseen > q * np.sqrt(var * ((s - hi) + unseen**2 / (seen @ seen))):
                        kept.append(c)
                    continue
                if model.stop_test == "z":  # k standard errors
                    q, sd = se, d.std(ddof=1)
                elif model.stop_test == "t":  # the t quantile of the one-sided level Φ(−k), own sd
                    q, sd = student_t.ppf(norm.cdf(se), hi - 1), d.std(ddof=1)
                else:  # t_pooled: the rivals' mean variance, their pooled degrees of freedom
                    q, sd = student_t.ppf(norm.cdf(se), len(diffs) * (hi - 1)), pooled
                if not d.mean() > q * sd * np.sqrt((1 - hi / s) / hi):
                    kept.append(c)
            kept.sort()
            alive = kept
            if len(alive) == 1 or hi >= s:
                break
            step = min(every, s - hi)
            rows += len(alive) * step
            hi += step
        preds.append(alive[int(np.argmin([e[c, :hi].mean() for c in alive]))])
    return rows, np.array(preds)


def fitted(model: DiffusionClassifier) -> dict[str, list[float]]:
    """`stop_test: profile`'s keys for `model`, fitted (without labels) on X itself."""
    profile, prior = difference_profile(model, X)
    return {"stop_profile": profile, "stop_prior": prior}


@pytest.mark.parametrize("test", ["z", "t", "t_pooled", "profile"])
@pytest.mark.parametrize(("se", "first", "every"), [(1.0, 2, 1), (0.5, 3, 2)])
def test_the_evaluation_count_is_the_hand_count_and_what_the_denoiser_saw(se, first, every, test):
    model = same_weights(tiny(k=4), stop_se=se, stop_first=first, stop_every=every, stop_test=test, **fitted(tiny(k=4)))
    seen = []
    hook = model.denoiser.register_forward_hook(lambda mod, args, out: seen.append(len(args[0])))
    logits, _, rows = model.score(X)
    hook.remove()
    want_rows, want_preds = hand_count(model, X)
    assert rows == sum(seen) == want_rows < len(X) * 4 * 8
    assert (logits.argmax(1) == want_preds).all()


def test_a_threshold_every_class_clears_stops_after_the_first_draws():
    """stop_se ~ 0: after the first stop_first draws only the leader is left — n·K·stop_first evaluations,
    and the prediction is the class with the lowest mean error over those draws."""
    model = same_weights(tiny(k=5), stop_se=1e-12, stop_first=2)
    logits, _, rows = model.score(X)
    assert rows == len(X) * 5 * 2
    want_rows, want_preds = hand_count(model, X)  # its prediction: the lowest mean error over those draws
    assert want_rows == rows and (logits.argmax(1) == want_preds).all()
    # A dropped class's logit stays below the one left, so softmax still ranks the prediction first.
    top = np.sort(logits, axis=1)
    assert (top[:, -1] > top[:, -2]).all()


@pytest.fixture(scope="module")
def trained() -> tuple[DiffusionClassifier, Prepared]:
    """A trained 4-class model at 32 draws (its informative order ranked at the end of training)."""
    prepared = blobs(n_classes=4, n=400, seed=1)
    model, _ = train_diffusion(prepared, diffusion_cfg(draws=32, draw_order="informative"), seed=0)
    return model, prepared


def scoring(model: DiffusionClassifier, prepared: Prepared, **keys) -> DiffusionClassifier:
    """The same weights under conf/method/diffusion.yaml's sequential keys (`keys` over them),
    with what they store fitted on the val split as training fits it."""
    cfg = defaults("method", "diffusion", **keys)
    stop = {k: getattr(cfg, k) for k in ("stop_se", "stop_first", "stop_every", "stop_test")}
    fast = same_weights(model, draw_perm=None, stop_profile=None, stop_prior=None, **stop)
    fit_scoring(fast, cfg, split_data(prepared)["val"], "method.diffusion")
    return fast


def test_sequential_scoring_agrees_with_full_scoring_at_a_fraction_of_the_evaluations(trained):
    """A trained 4-class model: it learned (well above chance), and the default rule keeps its
    predictions at a fraction of full scoring's network evaluations — fewer than the previous
    default (t_pooled, k 2.5, drawn order) at no less agreement."""
    model, prepared = trained
    full_logits, _, full_rows = same_weights(model, stop_se=0.0).score(prepared.x)
    fast_logits, _, fast_rows = scoring(model, prepared).score(prepared.x)
    old_logits, _, old_rows = scoring(model, prepared, stop_se=2.5, stop_test="t_pooled", draw_order="strata").score(prepared.x)
    assert accuracy(full_logits, prepared, "test_id") > 0.8  # chance 0.25
    agree = (full_logits.argmax(1) == fast_logits.argmax(1)).mean()
    assert agree >= max(0.99, (full_logits.argmax(1) == old_logits.argmax(1)).mean())
    # measured: 0.30x at 100 % (profile, 2.75, profile order) vs 0.36x at 99.4 % (t_pooled, 2.5, drawn
    # order); a model this unsure of many examples (83 % accurate) leaves many close pairs to score to the end
    assert fast_rows < 0.9 * old_rows < 0.4 * full_rows


def test_the_profile_is_fitted_without_labels_stored_with_the_model_and_checked(trained):
    """difference_profile: one value per draw position (mean 1) and a positive variance prior, the
    same on every call and fitted on the inputs alone; training with the default keys stores them
    and the profile order (half by half, the largest profile value first in each half); a model
    missing them refuses the profile test rather than scoring some other way."""
    model, prepared = trained
    val = split_data(prepared)["val"]
    profile, prior = difference_profile(model, val.x)
    assert len(profile) == 32 and abs(np.mean(profile) - 1) < 1e-5 and min(prior) > 0
    assert (profile, prior) == difference_profile(model, np.asarray(val.x).copy())
    fast = scoring(model, prepared)
    assert (fast.stop_profile, fast.stop_prior) == (profile, prior)
    order = profile_order(profile)
    assert fast.draw_perm == order and sorted(order[:16]) == list(range(16)) and sorted(order[16:]) == list(range(16, 32))
    assert [profile[j] for j in order[:16]] == sorted(profile[:16], reverse=True)
    rebuilt = DiffusionClassifier.from_arch(fast.arch())
    assert (rebuilt.stop_profile, rebuilt.stop_prior, rebuilt.draw_perm) == (profile, prior, order)
    assert "stop_profile" not in same_weights(model, stop_se=0.0).arch()
    bare = same_weights(model, stop_se=2.75, stop_test="profile", draw_perm=None)
    with pytest.raises(ValueError, match="stop_profile"):
        bare.score(prepared.x[:5])
    assert bare.score(prepared.x[:5], full=True)[2] == 5 * 4 * 32  # selection scoring in training: every class
    with pytest.raises(ValueError, match="stop_profile must hold 32"):
        same_weights(model, stop_profile=profile[:-1], stop_prior=prior)
    with pytest.raises(ValueError, match="stop_prior"):
        same_weights(model, stop_profile=profile, stop_prior=[1.0, -2.0])


def test_a_profile_test_that_never_clears_is_full_scoring():
    full = tiny(k=4)
    logits, loglik, rows = full.score(X)
    never = same_weights(full, stop_se=1e30, stop_first=2, stop_test="profile", **fitted(full))
    seq_logits, seq_loglik, seq_rows = never.score(X)
    assert seq_rows == rows
    np.testing.assert_allclose(seq_logits, logits, rtol=1e-6)
    np.testing.assert_allclose(seq_loglik, loglik, rtol=1e-9)


def test_sequential_keys_are_checked_before_any_work():
    with pytest.raises(ConfigError, match=r"method\.diffusion\.stop_first"):
        defaults("method", "diffusion", stop_first=1)
    with pytest.raises(ConfigError, match=r"method\.diffusion\.stop_se"):
        defaults("method", "diffusion", stop_se=-1.0)
    with pytest.raises(ConfigError, match=r"method\.diffusion\.stop_test"):
        defaults("method", "diffusion", stop_test="wald")
    # The test is stored with the model; z (the rule before the key existed) leaves the arch as it was.
    assert same_weights(tiny(), stop_se=2.0, stop_test="t_pooled").arch()["stop_test"] == "t_pooled"
    assert "stop_test" not in same_weights(tiny(), stop_se=2.0, stop_test="z").arch()
    # prune_keep takes the place of sequential elimination; too few draws score every class on every draw.
    assert defaults("method", "diffusion", prune_keep=1).stop_se > 0
    pruned = same_weights(tiny(k=4), stop_se=3.0, prune_keep=2, prune_draws=2)
    assert pruned.score(X)[2] == len(X) * (4 * 2 + 2 * 6)
    assert same_weights(tiny(k=4, draws=3), stop_se=3.0, stop_first=3).score(X)[2] == len(X) * 4 * 3


def test_draw_order_changes_only_the_order_the_test_sees_the_draws_in():
    """`draw_perm` (draw_order: informative): the same S draws, so where no class is ever dropped
    the scores are full scoring's; where classes are dropped, the count is the hand count of the
    rule on the draws taken in that order; and the order is stored with the model."""
    full = tiny(k=4)
    logits, loglik, rows = full.score(X)
    backwards = list(range(7, -1, -1))
    never = same_weights(full, stop_se=1e30, stop_first=2, draw_perm=backwards)
    seq_logits, seq_loglik, seq_rows = never.score(X)
    assert seq_rows == rows
    np.testing.assert_allclose(seq_logits, logits, rtol=1e-6)
    np.testing.assert_allclose(seq_loglik, loglik, rtol=1e-9)
    assert DiffusionClassifier.from_arch(never.arch()).draw_perm == backwards
    assert "draw_perm" not in full.arch()  # strata order: the arch (and bytes on disk) as before
    dropping = same_weights(full, stop_se=1.0, stop_first=2, draw_perm=backwards)
    plain = same_weights(full, stop_se=1.0, stop_first=2)
    gen_rows, gen_preds = hand_count(plain, X, backwards)
    logits_d, _, rows_d = dropping.score(X)
    assert rows_d == gen_rows and (logits_d.argmax(1) == gen_preds).all()
    with pytest.raises(ValueError, match="permutation"):
        same_weights(full, draw_perm=[0, 0, 1, 2, 3, 4, 5, 6])


def test_informative_order_ranks_the_draws_on_labelled_data_deterministically(trained):
    """A trained 4-class model: the order is a permutation of the draws, the same on every call,
    stored by training with draw_order informative; the previous default test (t_pooled, 2.5) on it
    needs far fewer evaluations than on the drawn order, and agrees with full scoring less often."""
    from stages.models.draw_order import informative_order

    model, prepared = trained
    val = prepared.split == "val"
    order = informative_order(model, prepared.x[val], prepared.y[val])
    assert sorted(order) == list(range(32)) and order != list(range(32))
    assert model.draw_perm == order == informative_order(model, prepared.x[val], prepared.y[val])
    keys = {"stop_se": 2.5, "stop_first": 2, "stop_every": 1, "stop_test": "t_pooled"}
    full_logits, _, full_rows = same_weights(model, stop_se=0.0).score(prepared.x)
    ordered_logits, _, ordered_rows = same_weights(model, **keys).score(prepared.x)
    drawn_logits, _, drawn_rows = same_weights(model, draw_perm=None, **keys).score(prepared.x)
    agree = {name: float((full_logits.argmax(1) == lg.argmax(1)).mean()) for name, lg in (("ordered", ordered_logits), ("drawn", drawn_logits))}
    # Measured: 0.18x vs 0.36x full scoring's evaluations, at 97.8 % vs 99.4 % agreement: the
    # ordered test stops sooner and errs more often (its standard error treats the telling first
    # draws as a sample of all of them): a trade, not a free gain, so not the default.
    assert agree["ordered"] >= 0.95 and agree["drawn"] >= 0.98
    assert ordered_rows < 0.6 * drawn_rows < 0.6 * full_rows
    with pytest.raises(ConfigError, match=r"method\.diffusion\.draw_order"):
        defaults("method", "diffusion", draw_order="sorted")


def test_a_val_split_too_small_to_fit_the_profile_test_is_refused_by_name():
    """One val example of a 2-class model is one (example, class) pair: the profile fitted on it is
    that pair, which leaves no residual to fit a variance prior from, and training says so, with
    the way out, rather than scoring some other way."""
    with pytest.raises(ValueError, match=r"stop_test profile: fitting its variance prior needs 2 .* gives 0 \(1 examples\)"):
        difference_profile(tiny(k=2), X[:1])
    with pytest.raises(ValueError, match="needs val examples, 2 classes and 2 draws, got 0 examples"):
        difference_profile(tiny(k=2), X[:0])
    # Training names the config section: a ConfigError, one line at the stage.
    model = same_weights(tiny(k=2), stop_se=2.75, stop_test="profile")
    with pytest.raises(ConfigError, match=r"params\.yaml: method\.diffusion: stop_test profile: fitting its variance prior"):
        fit_scoring(model, defaults("method", "diffusion"), types.SimpleNamespace(x=X[:1], y=np.zeros(1, dtype=np.int64)),
                    "method.diffusion")


def test_a_student_matches_full_scorings_logits_not_the_eliminated_ones(trained):
    """Sequential elimination agrees with full scoring on the argmax only: a dropped class's logit
    is a capped stand-in. A distilled student's targets are the teacher's `target_logits` — full
    scoring's for a diffusion teacher, the logits of any other kind — and distill asks for them
    on train and val, never for the eliminated logits."""
    from stages.core.settings import DistillConfig
    from stages.distill import distill
    from stages.models import target_logits

    model, prepared = trained
    fast = scoring(model, prepared)
    x = prepared.x[:100]
    full = same_weights(model, stop_se=0.0).score(x)[0]
    assert np.array_equal(target_logits(fast, x), full)
    eliminated = fast.logits(x)
    assert not np.array_equal(eliminated, full) and (eliminated.argmax(1) == full.argmax(1)).all()

    class Plain:  # a kind without target_logits: its logits
        def logits(self, x):
            return np.full((len(x), 4), 0.5, dtype=np.float32)

    assert np.array_equal(target_logits(Plain(), x), np.full((100, 4), 0.5, dtype=np.float32))

    class Spy:
        kind, n_classes = "diffusion", 4

        def __init__(self) -> None:
            self.rows: list[int] = []

        def logits(self, x):
            raise AssertionError("distill asked for the eliminated logits")

        def target_logits(self, x):
            self.rows.append(len(x))
            return fast.target_logits(x)

    spy = Spy()
    cfg = DistillConfig(hidden=[8], temperature=2.0, alpha=0.5, lr=1e-2, epochs=1, batch_size=64, selection="val_avg")
    distill(prepared, spy, cfg, seed=0)
    assert spy.rows == [int((prepared.split == "train").sum()), int((prepared.split == "val").sum())]


def test_evaluate_records_the_scoring_cost_of_each_test_split_apart(trained):
    """evaluate's `cost.scoring`: per test split, the evaluations per example of the model's own
    scoring over the split's first rows, against full scoring's K·S — the same count `score`
    gives; full scoring's ratio is 1; a model whose cost does not depend on the example has none."""
    from stages.evaluate import scoring_cost

    model, prepared = trained
    fast = scoring(model, prepared)
    samples = {s: prepared.subset(s).x[:50] for s in ("test_id", "test_ood")}
    got = scoring_cost(fast, samples)
    assert set(got) == {"test_id", "test_ood"}
    for split, x in samples.items():
        rows = fast.score(x)[2]
        assert got[split]["evaluations_per_example"] == rows / 50 and got[split]["full_per_example"] == 4 * 32
        assert got[split]["ratio"] == pytest.approx(rows / 50 / 128) and got[split]["ratio"] < 1
    full = scoring_cost(same_weights(model, stop_se=0.0), samples)
    assert {s: v["ratio"] for s, v in full.items()} == {"test_id": 1.0, "test_ood": 1.0}
    assert scoring_cost(torch.nn.Linear(2, 2), samples) is None
