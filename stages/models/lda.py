"""Linear and quadratic discriminant analysis: generative classifiers in closed form.

p(x | y) = N(x | μ_y, Σ) with one covariance Σ shared by all classes and p(y) = π_y, fitted
on the train split by maximum likelihood (Σ pooled within classes, with the unbiased n − K
denominator), then shrunk towards a scaled identity:

    Σ_λ = (1 − λ) Σ + λ (tr Σ / d) I        λ = LDAConfig.shrinkage

`logits(x)` returns log p(x, y) = log N(x | μ_y, Σ_λ) + log π_y for every class — a proper
joint log-density, so softmax of it is p(y | x) and argmax is the Bayes rule of the model.
Everything is computed in float64; the returned scores are cast to float32.

QDA (`QDAClassifier`, `fit_qda`) is the same with one covariance per class, Σ_y the maximum-
likelihood estimate from class y's examples (denominator n_y, as scikit-learn >= 1.9's
QuadraticDiscriminantAnalysis) shrunk the same way, each towards its own tr Σ_y / d —
`logits(x)` = log N(x | μ_y, Σ_y,λ) + log π_y.

Both expose `log_likelihood(x)` = log Σ_y p(x, y) = log p(x), the model's density of x.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from stages.models.generative import class_counts, logsumexp_np
from stages.models.nets import batched_logits


class _GaussianClassifier(nn.Module):
    """What LDA and QDA share: class means, log priors and the Cholesky factor(s) of the
    covariance buffer `COVARIANCE` as float64, the architecture, and scoring in batches.

    A subclass sets `kind`, `COVARIANCE` and its initial value, and defines `forward`
    (log p(x, y), float64) and `cost_per_example`.
    """

    kind: str
    COVARIANCE: str

    def __init__(self, in_dim: int, n_classes: int) -> None:
        super().__init__()
        self.in_dim = int(in_dim)
        self.n_classes = int(n_classes)
        self.register_buffer("means", torch.zeros(self.n_classes, self.in_dim, dtype=torch.float64))
        self.register_buffer(self.COVARIANCE, self._initial_covariance())
        self.register_buffer("log_priors", torch.full((self.n_classes,), -math.log(self.n_classes), dtype=torch.float64))
        self._chol: torch.Tensor | None = None

    def _initial_covariance(self) -> torch.Tensor:
        raise NotImplementedError

    def arch(self) -> dict:
        """The architecture arguments `load_model` rebuilds this model from."""
        return {"kind": self.kind, "in_dim": self.in_dim, "n_classes": self.n_classes}

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._chol = None  # the covariance changed

    def _not_positive_definite(self, info: torch.Tensor) -> str | None:
        """The error message when `cholesky_ex` reported a failure in `info`, else None."""
        raise NotImplementedError

    def cholesky(self) -> torch.Tensor:
        """Lower Cholesky factor(s) of the covariance buffer; ValueError if one is not positive definite."""
        if self._chol is None:
            chol, info = torch.linalg.cholesky_ex(getattr(self, self.COVARIANCE))
            message = self._not_positive_definite(info)
            if message:
                raise ValueError(message)
            self._chol = chol
        return self._chol

    def logits(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """log p(x, y) (float32, (n, n_classes)); softmax gives p(y | x)."""
        self.cholesky()  # fail before any batch if the covariance is unusable
        return batched_logits(self, x, self.in_dim, self.n_classes, batch_size)

    def log_likelihood(self, x: np.ndarray) -> np.ndarray:
        """log p(x) = log Σ_y p(x, y) per example (float64, (n,))."""
        self.cholesky()
        with torch.no_grad():
            return logsumexp_np(self(torch.tensor(np.asarray(x, dtype=np.float64))).numpy())

    def _params(self) -> int:
        return int(sum(t.numel() for t in self.state_dict().values()))


class LDAClassifier(_GaussianClassifier):
    """Class means, one shared covariance and log priors as float64 buffers."""

    kind = "lda"
    COVARIANCE = "covariance"

    def _initial_covariance(self) -> torch.Tensor:
        return torch.eye(self.in_dim, dtype=torch.float64)

    def _not_positive_definite(self, info: torch.Tensor) -> str | None:
        if int(info) == 0:
            return None
        return "LDA covariance is not positive definite (constant or collinear features?); use shrinkage > 0"

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


def _shrink(cov: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """(1 − λ) Σ + λ (tr Σ / d) I, exactly symmetric."""
    d = cov.shape[-1]
    target = (torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1) / d)[..., None, None] * torch.eye(d, dtype=cov.dtype)
    cov = (1.0 - shrinkage) * cov + shrinkage * target
    return 0.5 * (cov + cov.transpose(-1, -2))


def fit_lda(x: np.ndarray, y: np.ndarray, n_classes: int, shrinkage: float) -> LDAClassifier:
    """Fit LDA on (x, y) in closed form; every class must occur in `y`.

    Raises ValueError when a class is missing or the shrunk covariance is singular.
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
    cov = (1.0 - shrinkage) * cov + shrinkage * (torch.trace(cov) / d) * torch.eye(d, dtype=torch.float64)
    cov = 0.5 * (cov + cov.T)  # exact symmetry for Cholesky
    model = LDAClassifier(d, n_classes)
    with torch.no_grad():
        model.means.copy_(means)
        model.covariance.copy_(cov)
        model.log_priors.copy_(torch.log(counts.double() / n))
    model.cholesky()
    return model.eval()


class QDAClassifier(_GaussianClassifier):
    """Class means, per-class covariances and log priors as float64 buffers."""

    kind = "qda"
    COVARIANCE = "covariances"

    def _initial_covariance(self) -> torch.Tensor:
        return torch.eye(self.in_dim, dtype=torch.float64).repeat(self.n_classes, 1, 1)

    def _not_positive_definite(self, info: torch.Tensor) -> str | None:
        bad = [k for k in range(self.n_classes) if int(info[k]) != 0]
        if not bad:
            return None
        return (
            f"QDA covariance of class(es) {bad} is not positive definite (constant or collinear "
            "features, or fewer examples than features?); use shrinkage > 0"
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


def fit_qda(x: np.ndarray, y: np.ndarray, n_classes: int, shrinkage: float) -> QDAClassifier:
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
        model.covariances.copy_(_shrink(covs, shrinkage))
        model.log_priors.copy_(torch.log(counts.double() / len(yt)))
    model.cholesky()
    return model.eval()
