"""`qda`: quadratic discriminant analysis — a generative classifier in closed form.

p(x | y) = N(x | μ_y, Σ_y) with one covariance per class, Σ_y the maximum-likelihood
estimate from class y's examples (denominator n_y, as scikit-learn >= 1.9's
QuadraticDiscriminantAnalysis), each shrunk towards its own `shrink_target` (e.g. tr Σ_y / d · I;
stages/models/gaussian.py).
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
from stages.models.qda import QDAConfig


@register_model("qda")
class QDAClassifier(GaussianClassifier):
    """Class means, per-class covariances and log priors as float64 buffers."""

    COVARIANCE = "covariances"

    def _initial_covariance(self) -> torch.Tensor:
        return torch.eye(self.in_dim, dtype=torch.float64).repeat(self.n_classes, 1, 1)

    def _not_positive_definite(self, info: torch.Tensor) -> str | None:
        bad = [k for k in range(self.n_classes) if int(info[k]) != 0]
        if not bad:
            return None
        return (
            f"QDA covariance of class(es) {bad} is not positive definite (constant or collinear "
            "features, or fewer examples than features?); use shrinkage > 0 (and shrink_target "
            "scaled_identity or identity when a feature is constant)"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """log p(x, y) for every class, float64, shape (n, n_classes)."""
        chol = self.cholesky()  # (K, d, d)
        centred = x.double()[None, :, :] - self.means[:, None, :]  # (K, n, d)
        u = torch.linalg.solve_triangular(chol, centred.transpose(1, 2), upper=False)  # (K, d, n)
        maha = (u**2).sum(1).T  # (n, K)
        log_det = 2.0 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)  # (K,)
        return -0.5 * (self.in_dim * math.log(2 * math.pi) + log_det) - 0.5 * maha + self.log_priors

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs per example as `forward` computes it: one
        triangular solve L_y⁻¹(x − μ_y) (d(d+1)/2) and squared norm (d) per class."""
        d, k = self.in_dim, self.n_classes
        return {"params": self._params(), "macs": k * (d * (d + 1) // 2 + d), "forward_passes": 1}


def fit_qda(
    x: np.ndarray, y: np.ndarray, n_classes: int, shrinkage: float, target: str = "scaled_identity"
) -> QDAClassifier:
    """Fit QDA on (x, y) in closed form; every class needs >= 2 examples.

    Raises ValueError when a class is missing or too small, or a shrunk covariance is singular.
    """
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must be in [0, 1], got {shrinkage}")
    xt = torch.tensor(np.asarray(x, dtype=np.float64))
    yt = torch.tensor(np.asarray(y, dtype=np.int64))
    counts = class_counts(yt, n_classes)
    small = [k for k in range(n_classes) if counts[k] < 2]
    if small:
        raise ValueError(f"class(es) {small} have fewer than 2 training examples (a covariance needs 2)")
    means = torch.stack([xt[yt == k].mean(0) for k in range(n_classes)])
    covs = torch.stack([(xt[yt == k] - means[k]).T @ (xt[yt == k] - means[k]) / counts[k] for k in range(n_classes)])
    model = QDAClassifier(xt.shape[1], n_classes)
    with torch.no_grad():
        model.means.copy_(means)
        model.covariances.copy_(shrink(covs, shrinkage, target))
        model.log_priors.copy_(torch.log(counts.double() / len(yt)))
    model.cholesky()
    return model.eval()


def fit(x: np.ndarray, y: np.ndarray, n_classes: int, cfg: QDAConfig) -> QDAClassifier:
    """The closed-form fit of `cfg` on (x, y)."""
    return fit_qda(x, y, n_classes, cfg.shrinkage, cfg.shrink_target)


def train(job: TrainJob) -> Trained:
    """Fitted in closed form on train (stages/models/gaussian.py)."""
    return train_closed_form(job, fit)
