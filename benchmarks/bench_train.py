"""Training throughput of shiftlab's step path vs a bare PyTorch loop, for erm and diffusion.

    python -m benchmarks.bench_train [--epochs 30] [--diffusion-epochs 15] [--repeats 5]

Single-threaded (runtime.setup_torch, as the stages run), medians of `repeats` interleaved
runs, examples/s = train examples × epochs / median seconds, ratios from the same run.

Training step path ("ours"), exactly what the stages run between their selection scorings:

- erm: `training.run_epoch` over `SplitData.tensors()` with fit_classifier's step
  (`cross_entropy(model(batch["x"]), batch)`), AdamW, the erm stage's model
  (Standardize + MLP [64] + linear head, conf/method/erm.yaml: lr 1e-3, batch 128).
- diffusion: `training.run_epoch` with `DiffusionClassifier.loss` (as fit_generative runs it),
  AdamW, the MLP denoiser of conf/method/diffusion.yaml (width 128, depth 2, T = 100, batch 128).
  The conv denoiser's figure is in benchmarks/bench_diffusion.py.

Bare loop: the same model object, data, batch size, optimiser and seeded shuffle, written
inline (randperm, index, forward, loss, zero_grad, backward, step) with nothing else.

Separately, labelled as such: the full `fit_classifier` (erm), which also scores all four
splits (9,000 examples) after every epoch for checkpoint selection and keeps the best weights —
that figure is not a training-throughput comparison.
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
DIFF_WIDTH, DIFF_DEPTH, DIFF_STEPS, DIFF_LR = 128, 2, 100, 2e-3


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


def erm_model(splits: dict, seed: int = 0):  # noqa: ANN201
    """(model, AdamW, generator) as the erm stage builds them (stages/train.py, fit_classifier)."""
    import torch

    from stages.core.runtime import setup_torch
    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize

    gen = setup_torch(seed)
    model = MLPClassifier(MLPEncoder(DIM, [HIDDEN]), 2, Standardize(DIM).fit(splits["train"].x))
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), gen


def erm_ours(splits: dict, epochs: int) -> None:
    from stages.models.training import cross_entropy, run_epoch

    model, opt, gen = erm_model(splits)
    train = splits["train"].tensors()
    model.train()
    for _ in range(epochs):
        run_epoch(train, lambda b: cross_entropy(model(b["x"]), b), opt, BATCH, gen)


def erm_bare(splits: dict, epochs: int) -> None:
    import torch
    import torch.nn.functional as F

    model, opt, gen = erm_model(splits)
    x, y = splits["train"].x, splits["train"].y
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), BATCH):
            idx = order[i : i + BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def erm_fit_classifier(splits: dict, epochs: int) -> None:
    from stages.models.training import FitOptions, cross_entropy, fit_classifier

    model, _, gen = erm_model(splits)
    fit_classifier(model, splits, cross_entropy, FitOptions(LR, epochs, BATCH, "val_worst_group"), gen)


def diffusion_model(splits: dict, seed: int = 0):  # noqa: ANN201
    """(model, AdamW, generator) as train_diffusion / fit_generative build them (MLP denoiser)."""
    import torch

    from stages.core.runtime import setup_torch
    from stages.models.diffusion_model import DiffusionClassifier

    gen = setup_torch(seed)
    model = DiffusionClassifier(DIM, 2, [DIM], "mlp", DIFF_WIDTH, DIFF_DEPTH, DIFF_STEPS)
    model.standardize.fit(splits["train"].x)
    return model, torch.optim.AdamW(model.parameters(), lr=DIFF_LR, weight_decay=0.0), gen


def diffusion_ours(splits: dict, epochs: int) -> None:
    from stages.models.training import run_epoch

    model, opt, gen = diffusion_model(splits)
    train = {"x": splits["train"].x, "y": splits["train"].y}  # as fit_generative passes it
    model.train()
    for _ in range(epochs):
        run_epoch(train, lambda b: model.loss(b, gen), opt, BATCH, gen)


def diffusion_bare(splits: dict, epochs: int) -> None:
    import torch
    import torch.nn.functional as F

    model, opt, gen = diffusion_model(splits)
    x, y = splits["train"].x, splits["train"].y
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), BATCH):
            idx = order[i : i + BATCH]
            z, yb = model.standardize(x[idx]), y[idx]
            t = torch.randint(1, DIFF_STEPS + 1, (len(z),), generator=gen)
            eps = torch.randn(z.shape, generator=gen)
            z_t = model.sqrt_ab[t, None] * z + model.sqrt_1m_ab[t, None] * eps
            loss = F.mse_loss(model.denoiser(z_t, t, yb), eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


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
    parser.add_argument("--epochs", type=int, default=30, help="erm epochs per run")
    parser.add_argument("--diffusion-epochs", type=int, default=15, help="diffusion epochs per run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("SHIFTLAB_QUIET", "1")

    splits = synthetic_splits()
    n = SIZES["train"]
    fns = {
        "erm ours": lambda: erm_ours(splits, args.epochs),
        "erm bare": lambda: erm_bare(splits, args.epochs),
        "erm fit": lambda: erm_fit_classifier(splits, args.epochs),
        "diffusion ours": lambda: diffusion_ours(splits, args.diffusion_epochs),
        "diffusion bare": lambda: diffusion_bare(splits, args.diffusion_epochs),
    }
    for name, fn in fns.items():  # warm-up: imports, allocator, first-call overheads
        (erm_fit_classifier(splits, 1) if name == "erm fit" else fn())
    t = dict(zip(fns, median_seconds(list(fns.values()), args.repeats), strict=True))
    eps = {k: n * (args.diffusion_epochs if k.startswith("diffusion") else args.epochs) / v for k, v in t.items()}

    print(f"Training throughput, {n}×{DIM} train set, batch {BATCH}, 1 thread, median of {args.repeats} "
          f"interleaved runs (erm {args.epochs} epochs, diffusion {args.diffusion_epochs} epochs per run)\n")
    print("| method | loop | examples/s | ours / bare |")
    print("|---|---|---:|---:|")
    for method, model in (("erm", f"MLP [{HIDDEN}], AdamW"), ("diffusion", f"MLP denoiser w{DIFF_WIDTH} d{DIFF_DEPTH}, T={DIFF_STEPS}, AdamW")):
        print(f"| {method} ({model}) | bare PyTorch loop | {eps[method + ' bare']:,.0f} | 1.00 |")
        print(f"| {method} | shiftlab step path (run_epoch) | {eps[method + ' ours']:,.0f} | "
              f"{eps[method + ' ours'] / eps[method + ' bare']:.2f} |")
    print(f"\nNot a training-throughput figure: full erm `fit_classifier` incl. per-epoch selection scoring of "
          f"all 4 splits ({sum(SIZES.values()):,} examples): {eps['erm fit']:,.0f} train examples/s "
          f"({eps['erm fit'] / eps['erm bare']:.2f} × bare training).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
