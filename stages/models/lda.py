"""Linear discriminant analysis: a generative classifier in closed form.

p(x | y) = N(x | μ_y, Σ) with one covariance Σ shared by all classes and p(y) = π_y, fitted
on the train split by maximum likelihood (Σ pooled within classes, with the unbiased n − K
denominator), then shrunk towards a scaled identity:

    Σ_λ = (1 − λ) Σ + λ (tr Σ / d) I        λ = LDAConfig.shrinkage

`logits(x)` returns log p(x, y) = log N(x | μ_y, Σ_λ) + log π_y for every class — a proper
joint log-density, so softmax of it is p(y | x) and argmax is the Bayes rule of the model.
Everything is computed in float64; the returned scores are cast to float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from stages.models.nets import batched_logits


class LDAClassifier(nn.Module):
    """Class means, shared covariance and log priors as float64 buffers."""

    kind = "lda"

    def __init__(self, in_dim: int, n_classes: int) -> None:
        super().__init__()
        self.in_dim = int(in_dim)
        self.n_classes = int(n_classes)
        self.register_buffer("means", torch.zeros(self.n_classes, self.in_dim, dtype=torch.float64))
        self.register_buffer("covariance", torch.eye(self.in_dim, dtype=torch.float64))
        self.register_buffer("log_priors", torch.full((self.n_classes,), -math.log(self.n_classes), dtype=torch.float64))
        self._chol: torch.Tensor | None = None

    def arch(self) -> dict:
        """The architecture arguments `load_model` rebuilds this model from."""
        return {"kind": self.kind, "in_dim": self.in_dim, "n_classes": self.n_classes}

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._chol = None  # the covariance changed

    def cholesky(self) -> torch.Tensor:
        """Lower Cholesky factor of the covariance; ValueError if it is not positive definite."""
        if self._chol is None:
            chol, info = torch.linalg.cholesky_ex(self.covariance)
            if int(info) != 0:
                raise ValueError(
                    "LDA covariance is not positive definite (constant or collinear features?); "
                    "use shrinkage > 0"
                )
            self._chol = chol
        return self._chol

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

    def logits(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """log p(x, y) (float32, (n, n_classes)); softmax gives p(y | x)."""
        self.cholesky()  # fail before any batch if the covariance is unusable
        return batched_logits(self, x, self.in_dim, self.n_classes, batch_size)


def fit_lda(x: np.ndarray, y: np.ndarray, n_classes: int, shrinkage: float) -> LDAClassifier:
    """Fit LDA on (x, y) in closed form; every class must occur in `y`.

    Raises ValueError when a class is missing or the shrunk covariance is singular.
    """
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must be in [0, 1], got {shrinkage}")
    xt = torch.tensor(np.asarray(x, dtype=np.float64))
    yt = torch.tensor(np.asarray(y, dtype=np.int64))
    n, d = xt.shape
    counts = torch.bincount(yt, minlength=n_classes)
    if len(counts) > n_classes:
        raise ValueError(f"labels go up to {int(yt.max())} but n_classes is {n_classes}")
    missing = [k for k in range(n_classes) if counts[k] == 0]
    if missing:
        raise ValueError(f"class(es) {missing} have no training examples")
    if n - n_classes < 1:
        raise ValueError(f"need more examples ({n}) than classes ({n_classes})")
    onehot = torch.nn.functional.one_hot(yt, n_classes).double()  # (n, K)
    means = (onehot.T @ xt) / counts[:, None].double()
    centred = xt - means[yt]
    cov = centred.T @ centred / (n - n_classes)
    cov = (1.0 - shrinkage) * cov + shrinkage * (torch.trace(cov) / d) * torch.eye(d, dtype=torch.float64)
    cov = 0.5 * (cov + cov.T)  # exact symmetry for Cholesky
    model = LDAClassifier(d, n_classes)
    with torch.no_grad():
        model.means.copy_(means)
        model.covariance.copy_(cov)
        model.log_priors.copy_(torch.log(counts.double() / n))
    model.cholesky()
    return model.eval()
