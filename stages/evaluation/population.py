"""What LDA and logistic regression converge to on a population of Gaussian groups, and how
each of those rules does on every group: the regime's measure (stages/evaluation/regime.py)
and the phase diagram's population lines (stages/phase.py).

The model: two classes; each group g = (y, a) is Gaussian, x ~ N(μ_g, Σ), with one covariance Σ
shared by every group, and the training mixture puts probability π_g on it (π encodes the
label–attribute agreement ρ: at agreement ρ the agreeing groups carry ρ/2 each, the others
(1 − ρ)/2). Both classifiers are fitted to the training mixture with unlimited data:

- **LDA** models each class as one Gaussian: class mean m_c = Σ_{g∈c} π_g μ_g / π_c and the
  pooled within-*class* covariance W = Σ + Σ_g π_g (μ_g − m_c(g))(μ_g − m_c(g))ᵀ — the spread
  of the attribute inside a class counts as noise, which is how ρ enters what LDA weighs. Its
  rule is w = W⁻¹(m₁ − m₀), b = −½(m₁ + m₀)·w + log(π₁/π₀).
- **Logistic regression** is the linear rule (w, b) of least expected cross-entropy on the
  mixture (unregularised: the population is never separable), found by Newton's method.

Everything depends on the groups only through the squared Mahalanobis distances
D²_gh = (μ_g − μ_h)ᵀ Σ⁻¹ (μ_g − μ_h): both w lie in the span of Σ⁻¹(μ_g − μ₀) (a component
outside it moves no group mean and only adds variance to the score, which raises the expected
cross-entropy, a convex loss, and changes no LDA term), so the problem is solved exactly in the
(G − 1)-dimensional embedding of the groups (classical multidimensional scaling of D², Σ = I
there). A rule's accuracy on group g is then Φ(±(w·p_g + b)/‖w‖) (+ for class 1): the score
of a Gaussian group is Gaussian.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# E over z ~ N(μ, τ²) by the trapezoid rule on a uniform grid of μ + τu, u ∈ [−GRID_HALF_WIDTH,
# GRID_HALF_WIDTH] (the tails beyond hold < 1e-18), fine enough that the sigmoid's derivatives
# (width ~1 in z) get ≥ 1/GRID_STEP_Z points per unit of z: the rule is then accurate to far
# below NEWTON_TOL, and the objective and its derivatives stay consistent for the line search
# (Gauss–Hermite with a fixed node count is not, once τ is large).
GRID_HALF_WIDTH = 9.0
GRID_STEP_Z = 0.05
GRID_STEP_U = 0.1
NEWTON_TOL = 1e-10  # largest |gradient entry| at which the logistic regression is converged
MAX_NEWTON_STEPS = 100  # a smooth, strictly convex problem in ≤ G dimensions: ~10 steps


class Rule(NamedTuple):
    """A linear rule sign(w·p + b) in the groups' embedding, and its accuracy on each group."""

    weight: np.ndarray
    bias: float
    group_acc: np.ndarray  # (G,)


class PopulationRules(NamedTuple):
    """Population LDA (`gaussian`: one Gaussian per class) and logistic regression (`logistic`)
    on the same training mixture."""

    gaussian: Rule
    logistic: Rule

    def worst_group(self, present: np.ndarray | None = None) -> tuple[float, float]:
        """(LDA's, logistic regression's) worst accuracy over the groups `present` (default all)."""
        keep = np.ones(len(self.gaussian.group_acc), dtype=bool) if present is None else np.asarray(present, dtype=bool)
        return float(self.gaussian.group_acc[keep].min()), float(self.logistic.group_acc[keep].min())


def embed(d2: np.ndarray) -> np.ndarray:
    """Points p_g (G, G − 1) with ‖p_g − p_h‖² = d2[g, h] (classical scaling about group 0).

    Negative eigenvalues of the Gram matrix (a set of estimated distances no Euclidean
    configuration has) are clipped to 0: the nearest Euclidean configuration."""
    d2 = np.asarray(d2, dtype=np.float64)
    n = len(d2)
    gram = 0.5 * (d2[0, 1:, None] + d2[None, 0, 1:] - d2[1:, 1:])
    values, vectors = np.linalg.eigh((gram + gram.T) / 2)
    coords = vectors * np.sqrt(np.clip(values, 0.0, None))
    return np.vstack([np.zeros((1, n - 1)), coords])


def normal_grid(tau: float) -> tuple[np.ndarray, np.ndarray]:
    """(τu nodes, weights summing to 1) for E over N(0, τ²); τ = 0 is the single node 0."""
    if tau == 0.0:
        return np.zeros(1), np.ones(1)
    step = min(GRID_STEP_U, GRID_STEP_Z / tau)
    u = np.arange(-GRID_HALF_WIDTH, GRID_HALF_WIDTH + step / 2, step)
    weights = np.exp(-0.5 * u * u)
    return tau * u, weights / weights.sum()


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(-np.asarray(z, dtype=np.float64) / math.sqrt(2.0))


def group_accuracy(points: np.ndarray, y: np.ndarray, weight: np.ndarray, bias: float) -> np.ndarray:
    """Accuracy of sign(w·p + b) on each group N(p_g, I): Φ(±(w·p_g + b)/‖w‖), + for class 1."""
    sign = np.where(np.asarray(y) == 1, 1.0, -1.0)
    margin = sign * (points @ weight + bias)
    norm = float(np.linalg.norm(weight))
    if norm == 0.0:  # a constant rule: right on one class, wrong on the other (0.5 on a tie)
        return np.where(margin > 0, 1.0, np.where(margin < 0, 0.0, 0.5))
    return _normal_cdf(margin / norm)


def lda_rule(points: np.ndarray, y: np.ndarray, prob: np.ndarray) -> tuple[np.ndarray, float]:
    """(w, b) of LDA fitted to the mixture Σ_g prob_g N(p_g, I) with unlimited data."""
    y, prob = np.asarray(y), np.asarray(prob, dtype=np.float64) / float(np.sum(prob))
    means, priors = [], []
    within = np.eye(points.shape[1])
    for c in (0, 1):
        pc = float(prob[y == c].sum())
        m = (prob[y == c, None] * points[y == c]).sum(0) / pc
        dev = points[y == c] - m
        within += (prob[y == c, None] * dev).T @ dev
        means.append(m)
        priors.append(pc)
    w = np.linalg.solve(within, means[1] - means[0])
    return w, float(-0.5 * (means[1] + means[0]) @ w + math.log(priors[1] / priors[0]))


def lr_rule(points: np.ndarray, y: np.ndarray, prob: np.ndarray) -> tuple[np.ndarray, float]:
    """(w, b) minimising Σ_g prob_g E_{x~N(p_g, I)} CE(w·x + b, y_g), by damped Newton steps.

    With z = w·x + b ~ N(μ_g = w·p_g + b, ‖w‖²) and f(z) = log(1 + e^{−s z}) (s = ±1 for class
    1/0), Stein's identity turns every expectation over x into one over z, computed by
    quadrature (`normal_grid`): ∇_w = E f′ p + E f″ w, ∇_b = E f′;
    ∇²_ww = E f″ (p pᵀ + I) + E f‴ (p wᵀ + w pᵀ) + E f⁗ w wᵀ, ∇²_wb = E f″ p + E f‴ w, ∇²_bb = E f″.
    ValueError if it has not converged after MAX_NEWTON_STEPS."""
    y, prob = np.asarray(y), np.asarray(prob, dtype=np.float64) / float(np.sum(prob))
    s = np.where(y == 1, 1.0, -1.0)
    k = points.shape[1]
    theta = np.zeros(k + 1)
    ext = np.hstack([points, np.ones((len(points), 1))])

    def moments(th: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        w, b = th[:k], th[k]
        nodes, weights = normal_grid(float(np.linalg.norm(w)))
        z = (points @ w + b)[:, None] + nodes[None, :]  # (G, nodes)
        sz = s[:, None] * z
        loss = np.logaddexp(0.0, -sz)
        sig = 0.5 * (1.0 + np.tanh(z / 2))  # σ(z), stable
        f1 = -s[:, None] * (0.5 * (1.0 + np.tanh(-sz / 2)))  # d/dz log(1 + e^{−sz}) = −s σ(−sz)
        q = sig * (1 - sig)
        f3, f4 = q * (1 - 2 * sig), q * (1 - 6 * q)
        e = [(m * weights).sum(1) for m in (loss, f1, q, f3, f4)]
        return float(prob @ e[0]), e[1], e[2], e[3], e[4]

    def grad_hess(th: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = th[:k]
        _, e1, e2, e3, e4 = moments(th)
        wz = np.r_[w, 0.0]
        grad = (prob * e1) @ ext + np.r_[(prob * e2).sum() * w, 0.0]
        hess = (ext * (prob * e2)[:, None]).T @ ext
        hess[:k, :k] += (prob * e2).sum() * np.eye(k)
        cross = (ext * (prob * e3)[:, None]).sum(0)  # Σ π E f‴ (p, 1)
        hess += np.outer(cross, wz) + np.outer(wz, cross)
        hess += (prob * e4).sum() * np.outer(wz, wz)
        return grad, hess

    value = moments(theta)[0]
    for _ in range(MAX_NEWTON_STEPS):
        grad, hess = grad_hess(theta)
        if np.abs(grad).max() < NEWTON_TOL:
            return theta[:k].copy(), float(theta[k])
        step = np.linalg.solve(hess, grad)
        decrease = float(grad @ step)
        if decrease < 1e-14 * max(1.0, abs(value)):  # below rounding: no line search can see it
            theta, value = theta - step, moments(theta - step)[0]
            continue
        t = 1.0
        while True:
            new = moments(theta - t * step)[0]
            if new <= value - 1e-4 * t * decrease or t < 1e-12:
                break
            t *= 0.5
        theta, value = theta - t * step, new
    raise ValueError(f"population logistic regression did not converge in {MAX_NEWTON_STEPS} Newton steps")


def population_rules(d2: np.ndarray, y: np.ndarray, prob: np.ndarray) -> PopulationRules:
    """Population LDA and logistic regression for groups at squared Mahalanobis distances `d2`
    (G, G), of classes `y` (0/1) and training probabilities `prob`; each rule's accuracy on
    every group."""
    y = np.asarray(y)
    if set(np.unique(y).tolist()) != {0, 1}:
        raise ValueError(f"the population rules need groups of both classes 0 and 1, got {np.unique(y).tolist()}")
    points = embed(d2)
    gaussian, logistic = lda_rule(points, y, prob), lr_rule(points, y, prob)
    return PopulationRules(
        Rule(*gaussian, group_accuracy(points, y, *gaussian)), Rule(*logistic, group_accuracy(points, y, *logistic))
    )


def mahalanobis_d2(means: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """(G, G) squared Mahalanobis distances between the rows of `means` under `cov`."""
    means = np.asarray(means, dtype=np.float64)
    diff = means[:, None, :] - means[None, :, :]
    flat = diff.reshape(-1, means.shape[1])
    solved = solve_sparse(np.asarray(cov, dtype=np.float64), flat.T).T
    return np.einsum("ij,ij->i", flat, solved).reshape(len(means), len(means))


def solve_sparse(cov: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """cov⁻¹ rhs (rhs (d,) or (d, k)), solving densely only among the dimensions correlated with
    another: the others (a toy's noise dimensions) are divided by their variance, so thousands
    of them cost O(d²), not O(d³). A dimension of variance 0 with rhs 0 (a constant one) gets 0."""
    diag = np.diag(cov).copy()
    coupled = np.abs(cov - np.diag(diag)).sum(1) > 0
    rhs = np.asarray(rhs, dtype=np.float64)
    scale = diag if rhs.ndim == 1 else diag[:, None]
    free = ((diag != 0) & ~coupled) if rhs.ndim == 1 else ((diag != 0) & ~coupled)[:, None]
    w = np.divide(rhs, scale, out=np.zeros_like(rhs), where=np.broadcast_to(free, rhs.shape))
    if coupled.any():
        w[coupled] = np.linalg.solve(cov[np.ix_(coupled, coupled)], rhs[coupled])
    return w
