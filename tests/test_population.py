"""The population rules of the regime measure (stages/evaluation/population.py): LDA and logistic
regression fitted to unlimited data from Gaussian groups, computed from the groups' distances
alone, agree with scikit-learn fitted to a very large sample in the groups' own coordinates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.evaluation import population


def _groups(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Four groups (y, a) in 5 dimensions with a correlated shared covariance: means, cov, y, prob.
    The attribute moves the mean along a direction that is not orthogonal to the label's."""
    rng = np.random.default_rng(seed)
    core, cue = rng.normal(size=5), 2.5 * rng.normal(size=5)
    means = np.stack([(2 * y - 1) * core / 2 + (2 * a - 1) * cue / 2 for y in (0, 1) for a in (0, 1)])
    root = rng.normal(size=(5, 5))
    cov = root @ root.T / 5 + 0.3 * np.eye(5)
    rho = 0.9
    prob = np.array([rho, 1 - rho, 1 - rho, rho]) / 2  # (0,0), (0,1), (1,0), (1,1): a agrees with y w.p. rho
    return means, cov, np.array([0, 0, 1, 1]), prob


def _sample(means: np.ndarray, cov: np.ndarray, prob: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = rng.choice(len(prob), size=n, p=prob)
    x = means[g] + rng.standard_normal((n, means.shape[1])) @ np.linalg.cholesky(cov).T
    return x, g


def _accuracy(w: np.ndarray, b: float, means: np.ndarray, cov: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact accuracy of sign(w·x + b) on each Gaussian group, in its own coordinates."""
    sd = math.sqrt(float(w @ cov @ w))
    return np.array([0.5 * math.erfc(-(1 if c == 1 else -1) * (float(m @ w) + b) / sd / math.sqrt(2)) for m, c in zip(means, y, strict=True)])


@pytest.mark.parametrize("seed", [0, 1])
def test_population_rules_are_the_large_sample_fits(seed: int) -> None:
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression

    means, cov, y, prob = _groups(seed)
    rules = population.population_rules(population.mahalanobis_d2(means, cov), y, prob)
    x, g = _sample(means, cov, prob, 400_000, seed + 10)
    lr = LogisticRegression(C=1e6, tol=1e-10, max_iter=10_000).fit(x, y[g])
    lda = LinearDiscriminantAnalysis(solver="lsqr").fit(x, y[g])
    # With 400k rows each fit is within ~0.005 of its population rule on every group.
    np.testing.assert_allclose(rules.logistic.group_acc, _accuracy(lr.coef_[0], lr.intercept_[0], means, cov, y), atol=0.005)
    np.testing.assert_allclose(rules.gaussian.group_acc, _accuracy(lda.coef_[0], lda.intercept_[0], means, cov, y), atol=0.005)
    # the two differ: LDA fits each class's two-peaked mixture as one Gaussian
    assert np.abs(rules.gaussian.group_acc - rules.logistic.group_acc).max() > 0.02


def test_embedding_reproduces_the_distances_and_rules_do_not_depend_on_coordinates() -> None:
    means, cov, y, prob = _groups(3)
    d2 = population.mahalanobis_d2(means, cov)
    points = population.embed(d2)
    np.testing.assert_allclose(((points[:, None] - points[None]) ** 2).sum(-1), d2, atol=1e-9)
    # the same groups rotated, shifted and padded with independent dimensions: same answer
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    wide = np.hstack([means, np.zeros((4, 3))]) @ q.T + rng.normal(size=8)
    wide_cov = q @ np.block([[cov, np.zeros((5, 3))], [np.zeros((3, 5)), np.diag([0.1, 4.0, 9.0])]]) @ q.T
    a = population.population_rules(d2, y, prob)
    b = population.population_rules(population.mahalanobis_d2(wide, wide_cov), y, prob)
    np.testing.assert_allclose(a.gaussian.group_acc, b.gaussian.group_acc, atol=1e-9)
    np.testing.assert_allclose(a.logistic.group_acc, b.logistic.group_acc, atol=1e-8)
    with pytest.raises(ValueError, match="both classes"):
        population.population_rules(d2, np.zeros(4, dtype=int), prob)


def test_solve_sparse_is_the_dense_solve() -> None:
    rng = np.random.default_rng(4)
    block = rng.normal(size=(3, 3))
    cov = np.diag(rng.uniform(0.5, 2.0, size=9))
    cov[2:5, 2:5] = block @ block.T + np.eye(3)
    rhs = rng.normal(size=(9, 4))
    np.testing.assert_allclose(population.solve_sparse(cov, rhs), np.linalg.solve(cov, rhs), rtol=1e-10)
    np.testing.assert_allclose(population.solve_sparse(cov, rhs[:, 0]), np.linalg.solve(cov, rhs[:, 0]), rtol=1e-10)
