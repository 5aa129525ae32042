"""The MLP classifier (model kind `mlp`): standardise → MLP encoder → linear head.

What the discriminative methods, DFR's head on a frozen encoder and distilled students save.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from stages.core.registry import register_model
from stages.models.nets import MLPEncoder, Standardize, batched_logits


@register_model("mlp")
class MLPClassifier(nn.Module):
    """standardise → encoder → linear head; `logits` is the evaluate-facing interface."""

    on_accelerator = True  # runs on runtime.device (stages/models/training.py `place`)

    def __init__(self, encoder: MLPEncoder, n_classes: int, standardize: Standardize | None = None) -> None:
        super().__init__()
        self.standardize = standardize if standardize is not None else Standardize(encoder.in_dim)
        self.encoder = encoder
        self.head = nn.Linear(encoder.out_dim, int(n_classes))
        self.n_classes = int(n_classes)
        self.in_dim = encoder.in_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.standardize(x)))

    @classmethod
    def from_arch(cls, meta: dict) -> MLPClassifier:
        """An untrained network of the architecture `arch()` recorded."""
        hidden = meta.get("hidden")
        if not isinstance(hidden, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
            raise ValueError(f"metadata 'hidden' must be a list of positive integers, got {hidden!r}")
        return cls(MLPEncoder(int(meta["in_dim"]), hidden), int(meta["n_classes"]))

    def arch(self) -> dict:
        """The architecture arguments `load_model` rebuilds this network from."""
        return {"kind": self.kind, "in_dim": self.in_dim, "hidden": self.encoder.hidden, "n_classes": self.n_classes}

    def logits(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """Class scores (float32, (n, n_classes)); softmax gives p(y | x)."""
        return batched_logits(self, x, self.in_dim, self.n_classes, batch_size)

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: multiply-adds of the Linear layers for one
        example (the standardisation and ReLUs are elementwise and not counted); one forward pass."""
        params = sum(t.numel() for t in self.state_dict().values())
        macs = sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        return {"params": int(params), "macs": int(macs), "forward_passes": 1}
