"""`lda`: linear discriminant analysis — a generative classifier in closed form (the model:
stages/models/lda_model.py).

p(x | y) = N(x | μ_y, Σ) with one covariance Σ shared by all classes and p(y) = π_y, fitted
on the train split by maximum likelihood (Σ pooled within classes, with the unbiased n − K
denominator), then shrunk towards `shrink_target` (λ = `shrinkage`; stages/models/gaussian.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.registry import register_method
from stages.models.schemas import GaussianConfig


@dataclass
class LDAConfig(GaussianConfig):
    """Generative classifier: class-conditional Gaussians with a shared, shrunk covariance."""


register_method("lda", LDAConfig, "stages.models.lda_model:train", generative=True, model="lda", fit="stages.models.lda_model:fit")
