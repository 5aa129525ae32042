"""Diffusion classifier: scoring vs bare forward, adaptive pruning, training loop vs bare PyTorch.

    python -m benchmarks.bench_diffusion [--repeats 5] [--examples 256]

All at the thread count the stages use (runtime.setup_torch: 1 intra-op thread), medians
of `repeats` interleaved runs, ratios from the same run.

1. Scoring throughput at the default draws (32) and T = 100, for the two default denoisers:
   conv (3×8×8 inputs, 32 channels — colored_digits) and MLP (width 128, 10-d — gaussian_shortcut),
   2 classes. "scoring" is `DiffusionClassifier.score` (noise draws, z_t, all classes × draws
   in one forward per chunk, errors, weighting, ELBO log-likelihood); "bare forward" is the
   denoiser alone on pre-built rows of exactly the same batch shapes. GFLOP/s counts the
   denoiser's multiply-adds (`diffusion.denoiser_flops`) over the scoring time.
2. Adaptive pruning on the 10-class scikit-learn digits (64-d, MLP denoiser): predictions of
   pruned vs full scoring on the held-out half, and the network evaluations of each.
3. Training throughput: our loop (`training.run_epoch` + `DiffusionClassifier.loss`, as
   `fit_generative` runs it between evaluations) vs a bare loop over the same network and data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np


def median_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each function; runs are interleaved so load drift hits all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def scoring_vs_forward(shape: list[int], denoiser: str, width: int, n: int, repeats: int) -> dict[str, float]:
    """Examples/s of scoring and of the bare denoiser forward on the same row batches."""
    import torch

    from stages.core.runtime import setup_torch
    from stages.models.diffusion_model import DiffusionClassifier, denoiser_flops
    from stages.models.draw_order import draw_noise

    setup_torch(0)
    dim = int(np.prod(shape))
    model = DiffusionClassifier(dim, 2, shape, denoiser, width, 2, 100, "cosine", "simple", 32).eval()
    x = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    k, s = model.n_classes, model.draws
    chunk = max(1, model.score_rows // (k * s))
    # The bare forward's inputs: the same rows scoring builds, made once, outside the timing.
    gen = torch.Generator().manual_seed(0)
    batches = []
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        t, eps = draw_noise(m, s, dim, model.steps, gen)
        rows = m * k * s
        batches.append((torch.randn(rows, dim), t.repeat_interleave(k, 0).reshape(-1), torch.arange(k).repeat_interleave(s).repeat(m)))

    def score() -> None:
        model.score(x)

    @torch.no_grad()
    def bare() -> None:
        for xb, tb, yb in batches:
            model.denoiser(xb, tb, yb)

    score(), bare()  # warm-up
    t_score, t_bare = median_seconds([score, bare], repeats)
    flops = denoiser_flops(model.arch()) * n * k * s
    return {"score": n / t_score, "bare": n / t_bare, "ratio": t_bare / t_score, "gflops": flops / t_score / 1e9,
            "gflops_bare": flops / t_bare / 1e9, "rows": model.score_rows}


def digits10(seed: int = 0):  # noqa: ANN201
    """sklearn's 10-class digits as a Prepared (train half / test halves), 64-d."""
    from sklearn.datasets import load_digits

    from stages.core.artifacts import Prepared

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    split = np.where(rng.random(len(y)) < 0.5, "train", "test_id").astype(object)
    split[(split == "test_id") & (rng.random(len(y)) < 0.3)] = "val"
    split[(split == "test_id") & (rng.random(len(y)) < 0.3)] = "test_ood"
    meta = {"dataset": "digits10", "n_classes": 10, "n_attrs": 1, "shape": [64]}
    return Prepared(np.arange(len(y)), split, y, np.zeros_like(y), y, x, meta)


def pruning(keep: int, prune_draws: int, epochs: int) -> dict[str, float]:
    """Agreement of pruned and full scoring on 10-class digits, and their network evaluations."""
    import types

    from stages.models.diffusion_model import DiffusionClassifier, train_diffusion

    prepared = digits10()
    cfg = types.SimpleNamespace(
        denoiser="mlp", width=128, channels=32, depth=2, steps=100, schedule="cosine", weighting="simple", draws=32,
        prune_draws=prune_draws, prune_keep=0, score_seed=0, score_rows=8192, class_dropout=0.0, select_draws=4,
        lr=2e-3, weight_decay=0.0, epochs=epochs, batch_size=128, selection="val_avg", eval_every=epochs,
    )
    model, _ = train_diffusion(prepared, cfg, seed=0)
    test = prepared.x[prepared.split != "train"]
    y = prepared.y[prepared.split != "train"]
    full, _, rows_full = model.score(test)
    pruned_model = DiffusionClassifier.from_arch({**model.arch(), "prune_keep": keep})
    pruned_model.load_state_dict(model.state_dict())
    pruned, _, rows_pruned = pruned_model.score(test)
    return {"agree": float((full.argmax(1) == pruned.argmax(1)).mean()), "rows_full": rows_full / len(test),
            "rows_pruned": rows_pruned / len(test), "acc_full": float((full.argmax(1) == y).mean()),
            "acc_pruned": float((pruned.argmax(1) == y).mean()), "n": len(test)}


def training(epochs: int, repeats: int) -> dict[str, float]:
    """Examples/s of our epoch loop vs a bare loop, same network (conv, 3×8×8), data and batch size."""
    import torch
    import torch.nn.functional as F

    from stages.core.runtime import setup_torch
    from stages.models.diffusion_model import DiffusionClassifier
    from stages.models.training import run_epoch

    n, shape, batch = 900, [3, 8, 8], 128
    x = torch.from_numpy(np.random.default_rng(0).random((n, 192), dtype=np.float32))
    y = torch.from_numpy(np.random.default_rng(1).integers(0, 2, n))

    def make() -> tuple[DiffusionClassifier, torch.optim.Optimizer, torch.Generator]:
        gen = setup_torch(0)
        model = DiffusionClassifier(192, 2, shape, "conv", 32, 2, 100)
        model.standardize.fit(x)
        return model, torch.optim.AdamW(model.parameters(), lr=2e-3), gen

    def ours() -> None:
        model, opt, gen = make()
        model.train()
        for _ in range(epochs):
            run_epoch({"x": x, "y": y}, lambda b: model.loss(b, gen), opt, batch, gen)

    def bare() -> None:
        model, opt, gen = make()
        model.train()
        z_all = model.standardize(x)
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen)
            for i in range(0, n, batch):
                idx = order[i : i + batch]
                z, yb = z_all[idx], y[idx]
                t = torch.randint(1, 101, (len(z),), generator=gen)
                eps = torch.randn(z.shape, generator=gen)
                z_t = model.sqrt_ab[t, None] * z + model.sqrt_1m_ab[t, None] * eps
                loss = F.mse_loss(model.denoiser(z_t, t, yb), eps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    ours(), bare()
    t_ours, t_bare = median_seconds([ours, bare], repeats)
    return {"ours": n * epochs / t_ours, "bare": n * epochs / t_bare, "ratio": t_bare / t_ours}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_diffusion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per training-throughput run")
    parser.add_argument("--prune-epochs", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ.setdefault("SHIFTLAB_QUIET", "1")

    print(f"Diffusion classifier, 1 thread (runtime.setup_torch), median of {args.repeats}\n")
    print("| scoring, 2 classes × 32 draws, T=100 | scoring ex/s | bare forward ex/s | scoring / bare | GFLOP/s (scoring) | GFLOP/s (bare) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, shape, den, width in (("conv 3×8×8, 32 ch", [3, 8, 8], "conv", 32), ("MLP 10-d, width 128", [10], "mlp", 128)):
        r = scoring_vs_forward(shape, den, width, args.examples, args.repeats)
        print(f"| {name} | {r['score']:,.0f} | {r['bare']:,.0f} | {r['ratio']:.2f} | {r['gflops']:.1f} | {r['gflops_bare']:.1f} |")

    print("\n| pruning, 10-class digits, 32 draws | agreement with full | evaluations / example | vs full | acc full | acc pruned |")
    print("|---|---:|---:|---:|---:|---:|")
    for keep, s1 in ((3, 4), (2, 8)):
        r = pruning(keep, s1, args.prune_epochs)
        print(f"| keep {keep} after {s1} draws (n={r['n']}) | {r['agree']:.2%} | {r['rows_pruned']:.0f} (full {r['rows_full']:.0f}) | "
              f"{r['rows_pruned'] / r['rows_full']:.2f} | {r['acc_full']:.3f} | {r['acc_pruned']:.3f} |")

    r = training(args.epochs, args.repeats)
    print("\n| training, conv 3×8×8, 900 examples, batch 128 | examples/s | ours / bare |")
    print("|---|---:|---:|")
    print(f"| bare PyTorch loop | {r['bare']:,.0f} | 1.00 |")
    print(f"| run_epoch + DiffusionClassifier.loss | {r['ours']:,.0f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
