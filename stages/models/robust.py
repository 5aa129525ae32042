"""Pieces the shortcut-robust methods share.

`weighted_cross_entropy` with per-example weights `normalised` to mean 1 over train (so a
weighted loss has the scale of plain cross-entropy and the same learning rate suits every
method); the epoch samplers of the published recipes (`group_balanced_sampler`: GroupDRO's
`--reweight_groups`; `copies_sampler`: Just Train Twice's upsampling by copies); `logistic_regression`, an
exact L2 logistic regression (last-layer retraining); `group_scores`, accuracy and worst-group
accuracy of logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from stages.models.training import Batch

if TYPE_CHECKING:
    from stages.models.training import Sampler


# ---- weighted losses ---------------------------------------------------------------------------


def weighted_cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """mean_i w_i · CE(logits_i, y_i) with the per-example weights in the batch under "w"."""
    losses = F.cross_entropy(logits, batch["y"], reduction="none")
    return (losses * batch["w"].to(losses.dtype)).mean()


def normalised(weights: torch.Tensor) -> torch.Tensor:
    """`weights` (float32) scaled to mean 1."""
    w = weights.double()
    return (w * (len(w) / w.sum())).float()


# ---- epoch samplers ----------------------------------------------------------------------------


def group_balanced_sampler(g: torch.Tensor, n_groups: int) -> Sampler:
    """An epoch of len(g) rows drawn with replacement, row i with probability ∝ 1 / count(g_i):
    every group present is drawn equally often in expectation. What the GroupDRO code's
    `--reweight_groups` does (kohpangwei/group_DRO data/dro_dataset.py `get_loader`:
    `WeightedRandomSampler(len(self) / group_counts[g], len(self), replacement=True)`, i.e.
    `torch.multinomial` with the loader's generator), here with the loop's generator."""
    g = torch.as_tensor(g, dtype=torch.int64)
    counts = torch.bincount(g, minlength=n_groups).double()
    if len(counts) > n_groups:
        raise ValueError(f"groups go up to {int(g.max())} but there are {n_groups}")
    weights = (len(g) / counts)[g]

    def draw(generator: torch.Generator) -> torch.Tensor:
        return torch.multinomial(weights, len(g), replacement=True, generator=generator)

    return draw


def copies_sampler(copies: torch.Tensor) -> Sampler:
    """An epoch in which row i appears `copies[i]` times (>= 1), in one seeded random order: Just
    Train Twice's upsampling (its authors' run_expt.py: `ConcatDataset([train_data,
    Subset(train_data, list(aug_indices) * up_weight)])`, shuffled), so an epoch has Σ copies rows."""
    copies = torch.as_tensor(copies, dtype=torch.int64)
    if len(copies) and int(copies.min()) < 1:
        raise ValueError(f"every row needs at least one copy, got {int(copies.min())}")
    rows = torch.repeat_interleave(torch.arange(len(copies)), copies)

    def draw(generator: torch.Generator) -> torch.Tensor:
        return rows[torch.randperm(len(rows), generator=generator)]

    return draw


# ---- last-layer retraining ---------------------------------------------------------------------


def logistic_regression(
    z: np.ndarray, y: np.ndarray, n_classes: int, c: float, sample_weight: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """L2-regularised logistic regression, fitted exactly by Newton's method (float64).

    Minimises C·Σ_i s_i·CE_i + ½‖W‖² (s = `sample_weight`, default 1; the bias is not
    penalised) — scikit-learn's LogisticRegression objective: two classes use one score
    s = w·z + b (binary logistic), more classes a softmax over K rows. Returns (weight (K, d),
    bias (K,)) whose softmax is the fitted p(y | z); a binary score becomes the rows
    (−s/2, +s/2). Every class must occur in `y`. Deterministic (CPU torch, float64).
    """
    present = np.unique(y)
    if list(present) != list(range(n_classes)):
        raise ValueError(f"fit set has classes {present.tolist()}, needs all of 0..{n_classes - 1}")
    n, d = np.shape(z)
    x = torch.cat([torch.as_tensor(np.asarray(z), dtype=torch.float64), torch.ones(n, 1, dtype=torch.float64)], 1)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64)
    s = torch.ones(n, dtype=torch.float64) if sample_weight is None else torch.as_tensor(sample_weight, dtype=torch.float64)
    total = float(s.sum())
    s, lam = s * (float(c) / total), 1.0 / total  # the objective / Σs: same minimiser, scale-free tolerances
    rows = 1 if n_classes == 2 else n_classes
    penalty = torch.full((d + 1,), lam, dtype=torch.float64)
    penalty[d] = 0.0  # the bias is not penalised
    onehot = yt.double()[:, None] if rows == 1 else F.one_hot(yt, rows).double()

    def value_grad_hess(theta: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        scores = x @ theta.T  # (n, rows)
        if rows == 1:
            losses = F.binary_cross_entropy_with_logits(scores[:, 0], onehot[:, 0], reduction="none")
            p = torch.sigmoid(scores)
        else:
            losses = -(F.log_softmax(scores, 1) * onehot).sum(1)
            p = torch.softmax(scores, 1)
        value = float((s * losses).sum() + 0.5 * (penalty * theta * theta).sum())
        grad = ((s[:, None] * (p - onehot)).T @ x + penalty * theta).reshape(-1)
        if rows == 1:
            hess = (x * (s * p[:, 0] * (1 - p[:, 0]))[:, None]).T @ x
        else:
            # H[(k,i),(l,j)] = Σ_n s_n p_nk (δ_kl − p_nl) x_ni x_nj
            cov = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # (n, K, K)
            hess = torch.einsum("nkl,ni,nj->kilj", cov * s[:, None, None], x, x).reshape(rows * (d + 1), -1)
        hess = hess + torch.diag(penalty.repeat(rows)) + 1e-12 * torch.eye(rows * (d + 1), dtype=torch.float64)
        return value, grad, hess

    theta = torch.zeros(rows, d + 1, dtype=torch.float64)
    for _ in range(200):
        value, grad, hess = value_grad_hess(theta)
        if float(grad.abs().max()) < 1e-12:
            break
        step = torch.linalg.solve(hess, grad).reshape(rows, d + 1)
        t, decrease = 1.0, float(grad @ step.reshape(-1))
        while t > 1e-10 and value_grad_hess(theta - t * step)[0] > value - 1e-4 * t * decrease:
            t *= 0.5
        theta = theta - t * step
        if t * float(step.abs().max()) < 1e-14:
            break
    weight, bias = theta[:, :d].numpy().copy(), theta[:, d].numpy().copy()
    if rows == 1:
        weight, bias = np.concatenate([-weight / 2, weight / 2]), np.array([-bias[0] / 2, bias[0] / 2])
    return weight, bias


def group_scores(logits: np.ndarray, y: np.ndarray, g: np.ndarray) -> dict[str, float]:
    """Accuracy and worst-group accuracy (over the groups present) of logits."""
    correct = logits.argmax(1) == y
    wga = min(float(correct[g == v].mean()) for v in np.unique(g))
    return {"acc": float(correct.mean()), "worst_group_acc": wga}
