"""The networks the others build on: input standardisation, an MLP encoder, and the DAE.

Every network standardises its own inputs with the train split's mean and std, held as
buffers, so a stored state_dict is self-contained: evaluate feeds raw `x` and needs
nothing else from the training run.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

# A feature whose train std is below this (e.g. a pixel that is always 0) is only centred.
MIN_STD = 1e-6


class Standardize(nn.Module):
    """x ↦ (x − mean) / std with train statistics kept as buffers."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    @torch.no_grad()
    def fit(self, x: torch.Tensor) -> Standardize:
        """Set mean/std from `x` (rows = examples); constant features keep std 1."""
        x64 = x.double()
        std = x64.std(dim=0, unbiased=False)
        self.mean.copy_(x64.mean(dim=0).float())
        self.std.copy_(torch.where(std < MIN_STD, torch.ones_like(std), std).float())
        return self

    @torch.no_grad()
    def fit_batches(self, batches: Iterable[torch.Tensor]) -> Standardize:
        """`fit` over a stream of batches (rows = examples, inputs as the model takes them), in one
        pass: per-batch float64 mean and sum of squared deviations, merged by Chan et al.'s rule."""
        n, mean, m2 = 0, None, None
        for x in batches:
            x64 = x.double()
            k = x64.shape[0]
            if k == 0:
                continue
            bm = x64.mean(dim=0)
            bm2 = ((x64 - bm) ** 2).sum(dim=0)
            if mean is None:
                n, mean, m2 = k, bm, bm2
                continue
            delta = bm - mean
            total = n + k
            mean = mean + delta * (k / total)
            m2 = m2 + bm2 + delta**2 * (n * k / total)
            n = total
        if mean is None:
            raise ValueError("no rows to fit the standardisation on")
        std = (m2 / n).sqrt()
        self.mean.copy_(mean.float())
        self.std.copy_(torch.where(std < MIN_STD, torch.ones_like(std), std).float())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class MLPEncoder(nn.Module):
    """Linear+ReLU layers of widths `hidden`; with `hidden == []` it is the identity."""

    def __init__(self, in_dim: int, hidden: list[int]) -> None:
        super().__init__()
        self.in_dim = int(in_dim)
        self.hidden = [int(h) for h in hidden]
        layers: list[nn.Module] = []
        d = self.in_dim
        for h in self.hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.net = nn.Sequential(*layers)
        self.out_dim = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DenoisingAutoencoder(nn.Module):
    """standardise → encoder → mirrored decoder; trained to undo Gaussian corruption."""

    def __init__(self, in_dim: int, hidden: list[int]) -> None:
        super().__init__()
        self.standardize = Standardize(in_dim)
        self.encoder = MLPEncoder(in_dim, hidden)
        widths = list(reversed([in_dim, *hidden]))  # e.g. [64, 192] for hidden=[64], in_dim=192
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.decoder = nn.Sequential(*layers)

    def forward(self, z_std: torch.Tensor) -> torch.Tensor:
        """Reconstruct standardised inputs from (corrupted) standardised inputs."""
        return self.decoder(self.encoder(z_std))

    @torch.no_grad()
    def embed(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """Encoder outputs of raw inputs (float32, (n, hidden[-1]))."""
        self.eval()
        out = [
            self.encoder(self.standardize(_as_tensor(x[i : i + batch_size])))
            for i in range(0, len(x), batch_size)
        ]
        if not out:
            return np.zeros((0, self.encoder.out_dim), dtype=np.float32)
        return torch.cat(out).numpy().astype(np.float32, copy=False)


@torch.no_grad()
def batched_logits(model: nn.Module, x: np.ndarray, in_dim: int, n_classes: int, batch_size: int) -> np.ndarray:
    """Run `model` over `x` in eval mode and batches; checks the input width."""
    from stages.core.io import ArtifactError

    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != in_dim:
        raise ArtifactError(f"model expects inputs of shape (n, {in_dim}), got {x.shape}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    try:
        from stages.core.runtime import current

        device, rt = model_device(model), current()
        out = np.empty((len(x), n_classes), dtype=np.float32)
        for i in range(0, len(x), batch_size):
            xb = _as_tensor(x[i : i + batch_size])
            with rt.autocast(on=device):
                out[i : i + len(xb)] = model(xb.to(device)).float().cpu().numpy()
        return out
    finally:
        model.train(was_training)


def model_device(model: nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (the CPU for a module with neither)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def place(model: nn.Module) -> torch.device:
    """Move `model` to the runtime's device if its class says it runs there (`on_accelerator`:
    every tensor it makes follows its inputs' device); others stay on the CPU. Returns the device."""
    from stages.core.runtime import current

    device = torch.device(current().device if getattr(model, "on_accelerator", False) else "cpu")
    model.to(device)
    return device


def _as_tensor(x: np.ndarray) -> torch.Tensor:
    """A float32 tensor copy (Arrow-backed arrays are read-only, which torch warns about)."""
    return torch.tensor(np.asarray(x, dtype=np.float32))
