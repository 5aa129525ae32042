"""Class-conditional Gaussian classifiers in closed form: what they share.

p(x | y) = N(x | μ_y, Σ_y) and p(y) = π_y, fitted on the train split by maximum likelihood,
each covariance shrunk towards a target T (`shrink`, λ = `shrinkage`, T = `shrink_target`):

    Σ_λ = (1 − λ) Σ + λ T,   T = (tr Σ / d) I   scaled_identity
                             T = diag(Σ)        diagonal
                             T = I              identity

The scaled identity (scikit-learn's `shrunk_covariance`, Ledoit–Wolf's target) gives every
dimension the *average* variance, so adding or removing dimensions moves the target of all
the others; `diagonal` shrinks each dimension's correlations towards 0 and keeps its own
variance (the shrunk Σ of a dimension does not depend on how many others there are, and a
population whose covariance is diagonal is left unchanged); `identity` adds λ to every
variance regardless of its scale. A constant feature makes `diagonal` singular.

`logits(x)` returns log p(x, y) = log N(x | μ_y, Σ_λ) + log π_y for every class — a proper
joint log-density, so softmax of it is p(y | x) and argmax is the Bayes rule of the model.
Everything is computed in float64; the returned scores are cast to float32. Every model
also exposes `log_likelihood(x)` = log Σ_y p(x, y) = log p(x), its density of x.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from stages.core.schema import ConfigError
from stages.models.generative import logsumexp_np
from stages.models.nets import batched_logits
from stages.models.schemas import SHRINK_TARGETS

if TYPE_CHECKING:
    from stages.models.training import Trained, TrainJob


def train_closed_form(job: TrainJob, fit: Callable[[np.ndarray, np.ndarray, int, Any], Any]) -> Trained:
    """`fit` on the train split, every split scored once; a singular covariance or a missing
    class is a ConfigError naming the method's key."""
    from stages.models.training import fitted_once

    train = job.prepared.subset("train")
    try:
        model = fit(train.x, train.y, job.prepared.n_classes, job.cfg)
    except ValueError as e:
        raise ConfigError(
            f"{job.key} (shrinkage {job.cfg.shrinkage} towards {job.cfg.shrink_target}) on the train split: {e}"
        ) from None
    return fitted_once(model, job.prepared, "closed form", selection=None)


class GaussianClassifier(nn.Module):
    """What the Gaussian classifiers share: class means, log priors and the Cholesky factor(s)
    of the covariance buffer `COVARIANCE` as float64, the architecture, and scoring in batches.

    A subclass registers its `kind` (`registry.register_model`), sets `COVARIANCE` and its
    initial value, and defines `forward` (log p(x, y), float64) and `cost_per_example`.
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

    @classmethod
    def from_arch(cls, meta: dict) -> GaussianClassifier:
        """An unfitted model of the architecture `arch()` recorded (weights are loaded after)."""
        return cls(int(meta["in_dim"]), int(meta["n_classes"]))

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


def shrink(cov: torch.Tensor, shrinkage: float, target: str = "scaled_identity") -> torch.Tensor:
    """(1 − λ) Σ + λ T with T the `target` (SHRINK_TARGETS; module docstring), for one
    covariance (d, d) or a stack (K, d, d), exactly symmetric. ValueError on an unknown target."""
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must be in [0, 1], got {shrinkage}")
    d = cov.shape[-1]
    diag = torch.diagonal(cov, dim1=-2, dim2=-1)
    eye = torch.eye(d, dtype=cov.dtype)
    if target == "scaled_identity":
        # torch.trace for one matrix (its summation order is what LDA always used: outputs stay bit-identical)
        trace = torch.trace(cov) if cov.dim() == 2 else diag.sum(-1)
        goal = (trace / d)[..., None, None] * eye
    elif target == "diagonal":
        goal = torch.diag_embed(diag)
    elif target == "identity":
        goal = eye.expand_as(cov)
    else:
        raise ValueError(f"shrink target must be one of {list(SHRINK_TARGETS)}, got '{target}'")
    cov = (1.0 - shrinkage) * cov + shrinkage * goal
    return 0.5 * (cov + cov.transpose(-1, -2))
