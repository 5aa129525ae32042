"""`qda`: quadratic discriminant analysis — a generative classifier in closed form (the model:
stages/models/qda_model.py).

p(x | y) = N(x | μ_y, Σ_y) with one covariance per class, Σ_y the maximum-likelihood
estimate from class y's examples (denominator n_y, as scikit-learn >= 1.9's
QuadraticDiscriminantAnalysis), each shrunk towards its own `shrink_target` (e.g. tr Σ_y / d · I;
stages/models/gaussian.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.registry import register_method
from stages.models.schemas import GaussianConfig


@dataclass
class QDAConfig(GaussianConfig):
    """Generative classifier: class-conditional Gaussians, one shrunk covariance per class."""


register_method("qda", QDAConfig, "stages.models.qda_model:train", generative=True, model="qda", fit="stages.models.qda_model:fit")
