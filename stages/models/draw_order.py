"""The scoring draws (t, ε) of a class-conditional denoising classifier, what sequential elimination fits on them, and the order it takes them in.

`draw_noise` makes the draws: t stratified over [1, T] (draw j in stratum `stratum_order(S)[j]`,
so any prefix of the draws is spread out), ε standard normal. `draw_values` scores a split on
them: v_s(y), the weighted denoising error the classifier scores by, for every class and draw.

Draw j always falls in the same stratum of t, and some strata separate the classes far better
than others (for the digits models, mean ÷ sd of the wrong-class margin runs from 0.83 at the
best stratum to 0.08 at the worst). Full scoring averages all S draws whatever their order, so
its decision does not depend on it; sequential elimination looks at the first draws first.

`difference_profile` (`stop_test: profile`, the default) fits, on unlabelled held-out inputs
(training passes its val split), the profile a_s of the paired differences to full scoring's
prediction over the draw positions, and an empirical-Bayes prior for the variance of what the
profile leaves (stages/models/diffusion_model.py, `profile_settled`). No labels: the test
mirrors full scoring's decision, so it fits the differences to full scoring's prediction.

`profile_order` (`draw_order: profile`, the default) takes the draws half by half — the first
half of the drawn order is every other stratum, spread over all of [1, T] — with the largest
profile values first within each half: the telling draws come early, and by the middle the draws
seen still span t, so the profile model is never stretched from one end of t to the other. On
the default run's models and 10-class digits (3 seeds each) it cut network evaluations a further
15–20 % at the same agreement (docs/results.md, "Scoring at a fraction of the cost"). The profile itself
ordered all the way (the top half of the strata first) was cheaper still but fell to 98.9 % on
one shifted test_ood split, so the halves stay.

`informative_order` (`draw_order: informative`) ranks the positions with labels, for each
position j over the examples and their wrong classes y,

    ratio_j = mean(v_j(y) − v_j(y_true)) / sd(v_j(y) − v_j(y_true)),

highest first (ties: the drawn order). With the `t_pooled` test, whose standard error treats the
draws seen so far as a sample of all S (which ordered draws are not), it fails under a shift: on
the default run's 2-class Gaussian shortcut model the order ranked on val, where the shortcut
holds, let sequential elimination agree with full scoring on only 96.1 % of the shifted test_ood
rows, where it does not (the drawn order: 99.2 %; 2,000 rows). An option for data without a
shift between val and test, not the default.

Deterministic: the draws come from a generator seeded with the model's `score_seed`, the
examples are the first `limit` of the split in their stored order; what the model stores is
rounded to 6 significant digits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def stratum_order(draws: int) -> np.ndarray:
    """Which stratum of [1, T] draw s falls in: a permutation of 0..S−1 in van der Corput
    order (bit reversal when S is a power of 2), so any prefix of the draws is spread out."""
    def radical_inverse(i: int) -> float:
        out, f = 0.0, 0.5
        while i:
            out += f * (i & 1)
            i >>= 1
            f /= 2
        return out

    vdc = np.array([radical_inverse(i) for i in range(draws)])
    return np.argsort(np.argsort(vdc, kind="stable"), kind="stable")


def draw_noise(
    n: int, draws: int, dim: int, steps: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, ε) for n examples: t int64 (n, S) stratified over [1, T], ε float32 (n, S, dim)."""
    order = torch.from_numpy(stratum_order(draws)).double()
    u = torch.rand(n, draws, generator=generator, dtype=torch.float64)
    t = (1 + torch.floor((order + u) * steps / draws)).long().clamp_(1, steps)
    eps = torch.randn(n, draws, dim, generator=generator)
    return t, eps



@torch.no_grad()
def draw_values(model: Any, x: np.ndarray, limit: int = 512) -> np.ndarray:
    """v_s(y) — the weighted denoising errors sequential elimination compares — of the first
    `limit` examples of `x`, every class and every one of `model`'s S scoring draws, in draw
    position order: float64 (n, K, S). The draws are the ones `model.score` makes."""
    x = np.asarray(x[:limit], dtype=np.float32)
    s, k = model.draws, model.n_classes
    device = model.sqrt_ab.device
    generator = torch.Generator().manual_seed(model.score_seed)
    chunk = max(1, model.score_rows // (k * s))
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(x), chunk):
            z = model.standardize(torch.from_numpy(x[i : i + chunk]).to(device))
            t, eps = draw_noise(len(z), s, model.in_dim, model.steps, generator)
            t, eps = t.to(device), eps.to(device)
            err = model.errors(z, t, eps, torch.arange(k, device=device).expand(len(z), k)).double()
            if model.weighting == "elbo":
                err = err * model.steps * model.elbo_w[t].unsqueeze(1)
            out.append(err.cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, k, s))


def informative_order(model: Any, x: np.ndarray, y: np.ndarray, limit: int = 512, values: np.ndarray | None = None) -> list[int]:
    """The draw positions 0..S-1 of `model` (a DiffusionClassifier), most class-separating first,
    measured on the labelled examples (`x`, `y`; the first `limit`; `values`: their `draw_values`,
    if already scored)."""
    if len(x) == 0:
        raise ValueError("draw_order informative: no labelled examples to rank the draws on (empty val split)")
    v = draw_values(model, x, limit) if values is None else values
    y = np.asarray(y[:limit], dtype=np.int64)
    rows = np.arange(len(v))
    d = v - v[rows, y][:, None]  # (n, K, S)
    wrong = np.ones(d.shape[:2], dtype=bool)
    wrong[rows, y] = False
    m = d[wrong]  # (n·(K−1), S)
    sd = m.std(0)
    ratio = np.divide(m.mean(0), sd, out=np.zeros(model.draws), where=sd > 0)
    return [int(j) for j in np.argsort(-ratio, kind="stable")]


def difference_profile(
    model: Any, x: np.ndarray, limit: int = 512, values: np.ndarray | None = None
) -> tuple[list[float], list[float]]:
    """`stop_test: profile`'s model of the paired differences, fitted on unlabelled examples (the
    first `limit` of `x`; training passes its val split; `values`: their `draw_values`, if
    already scored): (profile, prior).

    Without labels: for every example, its differences d_s(y) = v_s(y) − v_s(ŷ) to full
    scoring's prediction ŷ over all S draws, for every other class y — what sequential
    elimination tests against its leader. `profile` a_s: their mean at each draw position,
    scaled to mean 1 (some timestep strata carry far more of the class difference than others;
    d_s(y) ≈ r(y)·a_s + noise). `prior` [s0², ν0]: the distribution of the noise's variance over
    the (example, class) pairs — the residual variance of that fit over all S draws — as a scaled
    inverse-χ² (s0², ν0 degrees of freedom), fitted by moments of log variance as limma's
    `fitFDist` does (Smyth 2004, "Linear models and empirical Bayes methods for assessing
    differential expression"); ν0 = 1e6 stands for infinity. Six significant digits, so the
    stored model reads the same everywhere."""
    from scipy.optimize import brentq
    from scipy.special import digamma, polygamma

    v = draw_values(model, x, limit) if values is None else values
    n, k, s = v.shape
    if n == 0 or k < 2 or s < 2:
        raise ValueError(f"stop_test profile: fitting the difference profile needs val examples, 2 classes and 2 draws, "
                         f"got {n} examples, {k} classes, {s} draws")
    rows = np.arange(n)
    pred = v.mean(-1).argmin(1)
    other = np.ones((n, k), dtype=bool)
    other[rows, pred] = False
    d = (v - v[rows, pred][:, None])[other]  # (n·(K−1), S)
    a = d.mean(0)
    if not a.mean() > 0:  # no class difference on these examples at all: a flat profile
        a = np.ones(s)
    a = a / a.mean()
    r = d @ a / (a @ a)
    s2 = np.square(d - r[:, None] * a).sum(1) / (s - 1)
    s2 = s2[s2 > 0]
    if len(s2) < 2:
        raise ValueError(f"stop_test profile: fitting its variance prior needs 2 (example, class) pairs whose differences "
                         f"vary over the draws, the val split gives {len(s2)} ({n} examples); use a larger val split "
                         "or stop_test t_pooled")
    dof = s - 1
    e = np.log(s2) - digamma(dof / 2) + np.log(dof / 2)
    spread = e.var(ddof=1) - float(polygamma(1, dof / 2))
    top = PRIOR_DOF_CAP / 2  # trigamma(ν0 / 2) = spread, solved for ν0 up to the cap
    nu0 = 2 * brentq(lambda h: float(polygamma(1, h)) - spread, 1e-8, top) if spread > float(polygamma(1, top)) else PRIOR_DOF_CAP
    s0 = math.exp(e.mean() + digamma(nu0 / 2) - math.log(nu0 / 2)) if nu0 < PRIOR_DOF_CAP else math.exp(e.mean())
    return [significant(float(x)) for x in a], [significant(s0), significant(nu0)]


PRIOR_DOF_CAP = 1e6  # stop_test profile: the prior's degrees of freedom stand for infinity from here


def significant(x: float, digits: int = 6) -> float:
    """`x` rounded to `digits` significant digits (what the model stores)."""
    return float(f"{x:.{digits - 1}e}")


def profile_order(profile: list[float]) -> list[int]:
    """`draw_order: profile`: the draw positions half by half — the first ⌈S/2⌉ (in van der
    Corput order every other stratum, so spread over all of [1, T]), then the rest — and within
    each half the largest profile value a_s first (ties: the drawn order). The first draws are the
    telling ones, and after half of them the draws seen are still spread over t."""
    a = np.asarray(profile, dtype=np.float64)
    half = (len(a) + 1) // 2
    first = np.argsort(-a[:half], kind="stable")
    rest = half + np.argsort(-a[half:], kind="stable")
    return [int(j) for j in np.concatenate([first, rest])]
