"""`lda`: linear discriminant analysis — a generative classifier in closed form.

p(x | y) = N(x | μ_y, Σ) with one covariance Σ shared by all classes and p(y) = π_y, fitted
on the train split by maximum likelihood (Σ pooled within classes, with the unbiased n − K
denominator), then shrunk towards `shrink_target` (λ = `shrinkage`; stages/models/gaussian.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from stages.core.registry import register_model
from stages.models.gaussian import GaussianClassifier, shrink, train_closed_form
from stages.models.generative import class_counts

if TYPE_CHECKING:
    from stages.models.training import Trained, TrainJob
from stages.models.lda import LDAConfig


@register_model("lda")
class LDAClassifier(GaussianClassifier):
    """Class means, one shared covariance and log priors as float64 buffers."""

    COVARIANCE = "covariance"

    def _initial_covariance(self) -> torch.Tensor:
        return torch.eye(self.in_dim, dtype=torch.float64)

    def _not_positive_definite(self, info: torch.Tensor) -> str | None:
        if int(info) == 0:
            return None
        return (
            "LDA covariance is not positive definite (constant or collinear features?); use shrinkage > 0 "
            "(and shrink_target scaled_identity or identity when a feature is constant)"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """log p(x, y) for every class, float64, shape (n, n_classes)."""
        chol = self.cholesky()
        # Whiten: with Σ = L Lᵀ, (x − μ)ᵀ Σ⁻¹ (x − μ) = ‖L⁻¹x − L⁻¹μ‖².
        u = torch.linalg.solve_triangular(chol, x.double().T, upper=False).T  # (n, d)
        m = torch.linalg.solve_triangular(chol, self.means.T, upper=False).T  # (K, d)
        maha = ((u[:, None, :] - m[None, :, :]) ** 2).sum(-1)  # (n, K)
        log_det = 2.0 * torch.log(torch.diagonal(chol)).sum()
        log_norm = -0.5 * (self.in_dim * math.log(2 * math.pi) + log_det)
        return log_norm - 0.5 * maha + self.log_priors

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs per example as `forward` computes it:
        the triangular whitening solve L⁻¹x (d(d+1)/2) and the squared distance to every
        whitened class mean (K·d). The whitened means are per batch, not per example."""
        d, k = self.in_dim, self.n_classes
        return {"params": self._params(), "macs": d * (d + 1) // 2 + k * d, "forward_passes": 1}


def fit_lda(
    x: np.ndarray, y: np.ndarray, n_classes: int, shrinkage: float, target: str = "scaled_identity"
) -> LDAClassifier:
    """Fit LDA on (x, y) in closed form, the pooled covariance shrunk by `shrinkage` towards
    `target` (stages/models/gaussian.py `shrink`); every class must occur in `y`.

    Raises ValueError when a class is missing, the shrinkage or target is invalid, or the
    shrunk covariance is singular.
    """
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must be in [0, 1], got {shrinkage}")
    xt = torch.tensor(np.asarray(x, dtype=np.float64))
    yt = torch.tensor(np.asarray(y, dtype=np.int64))
    n, d = xt.shape
    counts = class_counts(yt, n_classes)
    if n - n_classes < 1:
        raise ValueError(f"need more examples ({n}) than classes ({n_classes})")
    onehot = torch.nn.functional.one_hot(yt, n_classes).double()  # (n, K)
    means = (onehot.T @ xt) / counts[:, None].double()
    centred = xt - means[yt]
    cov = centred.T @ centred / (n - n_classes)
    cov = shrink(cov, shrinkage, target)  # exactly symmetric, for Cholesky
    model = LDAClassifier(d, n_classes)
    with torch.no_grad():
        model.means.copy_(means)
        model.covariance.copy_(cov)
        model.log_priors.copy_(torch.log(counts.double() / n))
    model.cholesky()
    return model.eval()


def fit(x: np.ndarray, y: np.ndarray, n_classes: int, cfg: LDAConfig) -> LDAClassifier:
    """The closed-form fit of `cfg` on (x, y)."""
    return fit_lda(x, y, n_classes, cfg.shrinkage, cfg.shrink_target)


def train(job: TrainJob) -> Trained:
    """Fitted in closed form on train (stages/models/gaussian.py)."""
    return train_closed_form(job, fit)
