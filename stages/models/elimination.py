"""Sequential elimination of classes per example: how a class-conditional denoising classifier (stages/models/diffusion_model.py) scores at a fraction of full scoring's network evaluations.

With `stop_se` k > 0 (`prune_keep` > 0 takes its place), per example: every
class is scored on the first `stop_first` draws, then rounds of `stop_every` more draws go to
the classes still in. After each round, with d_s(y) = v_s(y) − v_s(ℓ) the paired per-draw
differences to the leader ℓ (lowest mean over the draws so far; v_s = e_s, or T·w(t_s)·e_s
with `elbo`) over the m draws so far, a class y ≠ ℓ is dropped once the test settles that its
total difference over all S draws, D(y) = Σ_s d_s(y), is above 0 — what full scoring decides,
which adaptive scoring must agree with — at the one-sided level Φ(−k). Shared draws make the
paired differences far less variable than either error. `stop_test` is the test:

- `profile` (the default; `profile_settled`): the differences carry a known shape over the
  timestep strata — some strata separate classes far better than others — so d_s(y) is
  modelled as r(y)·a_s + noise, with a_s the profile of the differences to full scoring's
  prediction on val (fitted without labels at the end of training and stored with the model,
  draw_order.difference_profile). D is predicted as Σ_seen d + r̂·Σ_unseen a, with the
  prediction's variance from the residuals (a model-based finite-population estimate: no
  sampling of the draws is assumed), the residual variance moderated by an empirical-Bayes
  prior fitted on the same val examples (Smyth 2004's limma, `stop_prior`), and the Student-t
  quantile at the moderated degrees of freedom. The profile takes out the between-strata
  spread that makes a plain standard error large; the prior steadies the variance after 2 or
  3 draws.
- `t_pooled` (the default before `profile`): mean_s d_s(y) > q · sd · √((1 − m/S) / m) — the
  mean difference against the standard error of the mean over all S draws given these m (a
  finite-population correction), sd pooled over the example's rivals still in, q the t
  quantile at the pooled rivals·(m − 1) degrees of freedom; `t` keeps each class's own sd with
  m − 1 degrees of freedom; `z` (the first rule, what a stored model without the key uses)
  takes q = k with the class's own sd — after 2 or 3 draws that sd is too uncertain for a
  normal quantile: on one of the default run's 2-class models `z` (k 3, 3 draws) agreed with
  full scoring on 98.3 % of the shifted test_ood rows.

An example stops when one class is left, or at S draws. Classes never dropped get exactly their
full-scoring scores; a dropped class keeps its score over the draws it had, capped below every
class left, so the prediction is always a class left. Network evaluations are counted per
(example, class, draw) actually run (`score`'s third value). This is a sequential test in the
spirit of Li et al.'s `eval_prob_adaptive` rounds (which keep a fixed top-k per round, as
`prune_keep` does): a per-example, per-class stop instead of fixed keep counts; only the stored
`draws` scoring uses it, `select_draws` scoring during training scores every class. With
`draw_perm` the test takes the same S draws in another order; the draws, and so full scoring's
decision, are unchanged: `draw_order: profile` (the default) takes the first half of the draws
(spread over all of t) and then the second, each with its largest profile values first;
`informative` ranks them with val's labels (stages/models/draw_order.py). Measured on the
default run's models and 10-class digits, at 3 seeds each: docs/results.md, "Scoring at a
fraction of the cost" (`python -m benchmarks.bench_scoring`).

`SequentialElimination` holds the rule as methods of the classifier (it needs its denoiser, noise
schedule and stored keys); `fit_scoring` fits at the end of training what the rule stores with
the model.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from stages.core.schema import ConfigError
from stages.models.draw_order import (
    difference_profile,
    draw_values,
    informative_order,
    profile_order,
)


class SequentialElimination:
    """The sequential-elimination scoring of a `DiffusionClassifier` (mixed into it)."""

    # What the classifier provides (stages/models/diffusion_model.py).
    n_classes: int
    draws: int
    steps: int
    weighting: str
    stop_se: float
    stop_first: int
    stop_every: int
    stop_test: str
    stop_profile: list[float] | None
    stop_prior: list[float] | None
    draw_perm: list[int] | None
    elbo_w: torch.Tensor
    denoiser: torch.nn.Module
    _t_quantiles: np.ndarray | None
    _profile_q: dict[float, float]
    # and its noisy_inputs(z, t, ε) and score_prior() methods.

    def score_sequential(self, z: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`score_draws` with sequential elimination (`stop_se` k > 0; the module docstring)."""
        n, k, s, d = len(z), self.n_classes, t.shape[1], z.shape[1]
        device = z.device
        profile = None
        if self.stop_test == "profile":
            if self.stop_profile is None or self.stop_prior is None:
                raise ValueError("stop_test 'profile' needs the model's stop_profile and stop_prior "
                                 "(fitted on val at the end of training: draw_order.difference_profile)")
            profile = torch.tensor(self.stop_profile, dtype=torch.float64, device=device)
        if self.draw_perm is not None:  # `draw_order` informative or profile: the most telling draws first
            perm = torch.tensor(self.draw_perm, device=device)
            t, eps = t[:, perm], eps[:, perm]
            profile = profile[perm] if profile is not None else None
        w = self.steps * self.elbo_w[t] if self.weighting == "elbo" else torch.ones_like(t, dtype=torch.float64)
        err = torch.zeros(n, k, s, dtype=torch.float32, device=device)
        used = torch.zeros(n, k, dtype=torch.long, device=device)  # draws each (example, class) has been scored on
        alive = torch.ones(n, k, dtype=torch.bool, device=device)
        classes = torch.arange(k, device=device)
        rows, lo = 0, 0
        while lo < s:
            hi = min(s, self.stop_first if lo == 0 else lo + self.stop_every)
            live = alive & (alive.sum(1, keepdim=True) > 1) if lo else alive
            ex, cls = live.nonzero(as_tuple=True)  # row-major: example, then class (deterministic)
            if not len(ex):
                break
            r = hi - lo
            tt, ee = t[ex, lo:hi], eps[ex, lo:hi]
            z_t = self.noisy_inputs(z[ex], tt, ee)
            eps_hat = self.denoiser(z_t.reshape(-1, d), tt.reshape(-1), cls.repeat_interleave(r)).view(len(ex), r, d)
            err[ex, cls, lo:hi] = (eps_hat - ee).square_().sum(-1)
            used[ex, cls] = hi
            rows += len(ex) * r
            # The test: paired differences of the weighted errors to the leader over the draws so far.
            v = err[:, :, :hi].double() * w[:, None, :hi]
            mean = v.mean(-1).masked_fill(~alive, math.inf)
            leader = mean.argmin(1)
            diff = v - v[torch.arange(n, device=device), leader].unsqueeze(1)
            # The test settles full scoring's decision (the total over all S draws), which is what
            # adaptive scoring must agree with.
            rival = live & (classes != leader[:, None])
            if profile is not None:
                drop = rival & self.profile_settled(diff, profile)
            else:
                sd, q = self.stop_threshold(diff.std(-1), rival, hi)
                drop = rival & (diff.mean(-1) > q * sd * math.sqrt((1 - hi / s) / hi))
            alive &= ~drop
            lo = hi
        mask = torch.arange(s, device=device) < used.unsqueeze(-1)  # (n, k, s): the draws each class used
        count = used.clamp(min=1).double()
        score = -(err.double() * w[:, None, :] * mask).sum(-1) / count
        elbo = -self.steps * (err.double() * self.elbo_w[t].unsqueeze(1) * mask).sum(-1) / count
        prior = self.score_prior()
        logits = (score + prior).float()
        # An eliminated class keeps its score over the draws it had, capped below every class left.
        left = logits.masked_fill(~alive, math.inf).min(1).values
        cap = torch.nextafter(left, torch.tensor(-math.inf, device=device))
        logits = torch.where(alive, logits, torch.minimum(logits, cap[:, None]))
        return logits, elbo, rows

    def profile_settled(self, diff: torch.Tensor, profile: torch.Tensor) -> torch.Tensor:
        """`stop_test: profile` after m of the S draws: is each class's full-scoring total difference
        to the leader, D = Σ_s d_s over all S draws, above 0 at the one-sided level Φ(−stop_se)?
        `diff` (n, K, m): the paired differences seen; `profile` (S,): a_s in the order the draws
        are taken. The model d_s = r·a_s + e_s, e_s with variance σ²: r̂ = Σ d a / Σ a² over the m
        seen; the prediction of D is Σ_seen d + r̂·A, A = Σ_unseen a_s, with variance
        σ²·((S − m) + A² / Σ_seen a²) (the unseen noise plus r̂'s error). σ² is the empirical-Bayes
        moderated variance (ν0·s0² + (m − 1)·s²) / (ν0 + m − 1), s² the residual variance of the
        fit, and the quantile is Student-t's at ν0 + m − 1 degrees of freedom (`stop_prior`; Smyth
        2004). At m = S, A = 0 and the test is D > 0: full scoring's own decision."""
        m, s = diff.shape[-1], len(profile)
        seen, unseen = profile[:m], float(profile[m:].sum())
        saa = float(seen.square().sum())
        r = (diff * seen).sum(-1) / saa
        total = diff.sum(-1) + r * unseen
        s2 = (diff - r.unsqueeze(-1) * seen).square_().sum(-1) / max(m - 1, 1)
        s0, nu0 = self.stop_prior  # type: ignore[misc]
        s2 = (nu0 * s0 + (m - 1) * s2) / (nu0 + m - 1)
        se = (s2 * ((s - m) + unseen**2 / saa)).sqrt_()
        return total > self.profile_quantile(nu0 + m - 1) * se

    def profile_quantile(self, dof: float) -> float:
        """The Student-t quantile of the one-sided level Φ(−stop_se) at `dof` degrees of freedom."""
        if dof not in self._profile_q:
            from scipy.stats import norm
            from scipy.stats import t as student_t

            self._profile_q[dof] = float(student_t.ppf(norm.cdf(self.stop_se), dof))
        return self._profile_q[dof]

    def stop_threshold(self, sd: torch.Tensor, rival: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        """(sd, multiplier) of sequential elimination's test after m draws, per `stop_test`, from
        each class's sample sd of its paired differences to the leader `sd` (n, K) and the classes
        tested `rival` (n, K): z: the class's own sd, multiplier `stop_se`; t: the class's own sd,
        the Student-t quantile (m − 1 degrees of freedom) of the one-sided level Φ(−stop_se);
        t_pooled: the root mean variance over the example's rivals, the t quantile at their pooled
        (rivals · (m − 1)) degrees of freedom."""
        if self.stop_test == "z":
            return sd, self.stop_se
        if self.stop_test == "t_pooled":
            count = rival.sum(1, keepdim=True).clamp(min=1)
            sd = ((sd.square() * rival).sum(1, keepdim=True) / count).sqrt()
            dof = count * (m - 1)
        else:
            dof = torch.full_like(sd, m - 1, dtype=torch.long)
        top = (self.n_classes - 1) * (self.draws - 1)
        if self._t_quantiles is None or len(self._t_quantiles) <= top:
            from scipy.stats import norm
            from scipy.stats import t as student_t

            level = norm.cdf(self.stop_se)
            self._t_quantiles = np.concatenate([[np.inf], student_t.ppf(level, np.arange(1, top + 1))])
        q = torch.from_numpy(self._t_quantiles).to(sd.device)[dof.long().clamp(max=top)]
        return sd, q


def fit_scoring(model: SequentialElimination, cfg: Any, val: Any, key: str) -> None:
    """What sequential elimination stores with a trained model, fitted on the `val` split
    (stages/models/draw_order.py): `stop_test: profile`'s difference profile and variance prior,
    without labels; the draw order of `draw_order` profile (from that profile) or informative
    (ranked with val's labels). A val split it cannot fit on is a ConfigError naming `key`."""
    order = getattr(cfg, "draw_order", "strata")
    profile = bool(model.stop_se) and (model.stop_test == "profile" or order == "profile")
    # Both fits read the same scoring of val: score it once.
    values = draw_values(model, val.x) if profile and order == "informative" else None
    if profile:
        try:
            model.stop_profile, model.stop_prior = difference_profile(model, val.x, values=values)
        except ValueError as e:
            raise ConfigError(f"params.yaml: {key}: {e}") from None
    if order == "profile" and model.stop_profile is not None:
        model.draw_perm = profile_order(model.stop_profile)
    elif order == "informative":
        model.draw_perm = informative_order(model, val.x, val.y, values=values)
