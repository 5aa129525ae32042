"""Overhead of shiftlab's training loop over a bare PyTorch loop.

    python -m benchmarks.bench_train [--epochs 30] [--repeats 5]

Both loops train the same MLP (10 → 64 → 2) on the same synthetic 4000×10 train set with
the same epochs, batch size and learning rate, single-threaded (runtime.setup_torch). The
bare loop is plain Adam + cross-entropy and nothing else; ours (stages.models.training.
fit_classifier) also scores all four splits (9000 examples) after every epoch, writes the
history and keeps a copy of the selected weights. Prints the median of `repeats` runs each
and their ratio as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

SIZES = {"train": 4000, "val": 1000, "test_id": 2000, "test_ood": 2000}
DIM, HIDDEN, BATCH, LR = 10, 64, 128, 1e-3


def synthetic_splits(seed: int = 0) -> dict:
    """Gaussian-shortcut-like splits: core, spurious and 8 noise features, groups = 2y + a."""
    import torch

    from stages.models.training import SplitData

    rng = np.random.default_rng(seed)
    out = {}
    for name, n in SIZES.items():
        rho = 0.05 if name == "test_ood" else 0.95
        y = rng.integers(0, 2, n)
        a = np.where(rng.random(n) < rho, y, 1 - y)
        x = np.column_stack([2 * y - 1 + rng.standard_normal(n), 2 * a - 1 + 0.2 * rng.standard_normal(n),
                             rng.standard_normal((n, DIM - 2))]).astype(np.float32)
        out[name] = SplitData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(2 * y + a))
    return out


def ours(splits: dict, epochs: int, seed: int = 0) -> float:
    """fit_classifier with ERM; returns the final train loss (to keep the work observable)."""
    from stages.models.nets import MLPClassifier, MLPEncoder, Standardize
    from stages.models.training import FitOptions, cross_entropy, fit_classifier
    from stages.runtime import setup_torch

    gen = setup_torch(seed)
    model = MLPClassifier(MLPEncoder(DIM, [HIDDEN]), 2, Standardize(DIM).fit(splits["train"].x))
    result = fit_classifier(model, splits, cross_entropy, FitOptions(LR, epochs, BATCH, "val_avg"), gen)
    return float(result.history.column("loss")[0].as_py())


def bare(splits: dict, epochs: int, seed: int = 0) -> float:
    """The textbook loop: shuffle, forward, cross-entropy, backward, Adam step."""
    import torch
    from torch import nn

    from stages.runtime import setup_torch

    gen = setup_torch(seed)
    x, y = splits["train"].x, splits["train"].y
    x = (x - x.mean(0)) / x.std(0)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 2))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss = torch.zeros(())
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), BATCH):
            idx = order[i : i + BATCH]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return float(loss.item())


def median_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each function; runs are interleaved so load drift hits all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("SHIFTLAB_QUIET", "1")

    splits = synthetic_splits()
    ours(splits, 1)  # warm-up: imports, allocator, first-call overheads
    bare(splits, 1)
    t_ours, t_bare = median_seconds([lambda: ours(splits, args.epochs), lambda: bare(splits, args.epochs)], args.repeats)
    steps = args.epochs * -(-SIZES["train"] // BATCH)
    print(f"Training loop, {SIZES['train']}×{DIM} train set, MLP [{HIDDEN}], {args.epochs} epochs, "
          f"batch {BATCH}, 1 thread, median of {args.repeats}\n")
    print("| loop | median s | steps/s | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| bare PyTorch (Adam + CE) | {t_bare:.3f} | {steps / t_bare:,.0f} | 1.00 |")
    print(f"| shiftlab fit_classifier (+ per-epoch eval of 4 splits, selection) | {t_ours:.3f} | "
          f"{steps / t_ours:,.0f} | {t_ours / t_bare:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
