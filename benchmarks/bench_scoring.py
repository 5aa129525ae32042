"""Diffusion classifier scoring: full vs sequential elimination, on the same trained models.

    python -m benchmarks.bench_scoring [--quick] [--draw-order informative] [--stop-first 2] [--stop-se 3.5]

Full scoring runs every class on every (t, ε) draw (K·S network evaluations per example);
adaptive scoring is the same model with `method.diffusion` sequential elimination
(`stop_se`, `stop_first`, `stop_every`, `draw_order`: conf/method/diffusion.yaml's defaults
unless given) on the same draws. With `draw_order informative` the order is ranked on each
model's val split (stages/models/draw_order.py), as training does. Network evaluations are
counted exactly (`DiffusionClassifier.score`: one per example, class and draw run); agreement
is the fraction of examples whose predicted class is the same, over all rows and over the
test_ood rows alone (the shifted split, where the shortcut no longer holds). Every model is
scored on its test_id + test_ood rows: never trained on, selected on or ranked on. Wall times
are medians of interleaved runs at the stages' thread count.

With the drawn order the rule is also replayed in numpy on digits10's full values (checked
against the model's own count and predictions), and once more with each paired difference's
standard deviation known: what no test of this form can beat at a given threshold, the
reference for how far the ratio can fall at 32 draws.

Models:
- digits10 — the scikit-learn digits colored_digits is made from, with their 10 labels
  (colored_digits itself is 2-class: digit < 5), trained here with the project's own
  `train_diffusion` (MLP denoiser, the default scoring keys). The harder case (10 classes), so
  the last line.
- colored_digits, gaussian_shortcut — the checked-out default models
  (data/models/<dataset>/diffusion/seed=0), 2 classes.

The last line reads `scoring: <ratio>x network evaluations of full scoring at <agreement>
agreement (digits10, <n> examples)` at the default 32 draws; digits10 and gaussian_shortcut are
also scored at 64 draws (full and adaptive both), where the first round's share of the work
halves and the ratio falls below 0.10x. Whether 64 draws would be the better default is asked of
an independent reference: full scoring at 128 draws of another `score_seed` (a less noisy estimate
of the same scores, sharing no draw with the others); the bench prints how often each scoring's
prediction agrees with it. --quick: 2,000
gaussian_shortcut rows (a fixed random subset, both splits) and 1 timing repeat.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def digits10_model(epochs: int) -> tuple[Any, np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray]:
    """A 10-class diffusion classifier trained on half of the scikit-learn digits; its test
    inputs (test_id + test_ood: neither trained on nor used to select or order); its val split;
    each test input's split (digits10's "test_ood" is a random part of the held-out half: no shift)."""
    from benchmarks.bench_diffusion import digits10
    from stages.core.config import defaults
    from stages.models.diffusion_model import train_diffusion

    prepared = digits10()
    base = defaults("method", "diffusion")
    cfg = types.SimpleNamespace(**{**vars(base), "denoiser": "mlp", "epochs": epochs, "eval_every": epochs, "patience": 0,
                                   "selection": "val_avg", "select_draws": 4, "draw_order": "strata"})
    model, _ = train_diffusion(prepared, cfg, seed=0)
    return model.eval(), *held_out(prepared)


def held_out(prepared: Any) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray]:
    """(test inputs, (val inputs, val labels), each test input's split) of a Prepared."""
    test = np.isin(prepared.split, ["test_id", "test_ood"])
    val = prepared.split == "val"
    return prepared.x[test], (prepared.x[val], prepared.y[val]), np.asarray(prepared.split[test], dtype=str)


def checked_out_model(dataset: str, limit: int | None) -> tuple[Any, np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray]:
    """The default run's trained diffusion model of `dataset`, its test inputs, its val split,
    each test input's split (`limit`: a random subset of that many test inputs, fixed seed, both
    splits in their proportions)."""
    from stages.core.artifacts import model_dir, prepared_path, read_prepared
    from stages.models import load_model

    prepared = read_prepared(prepared_path(dataset))
    x, val, split = held_out(prepared)
    if limit and limit < len(x):
        pick = np.sort(np.random.default_rng(0).choice(len(x), limit, replace=False))
        x, split = x[pick], split[pick]
    return load_model(model_dir(dataset, "diffusion", 0)), x, val, split


def with_scoring(model: Any, **keys: Any) -> Any:
    """The same weights under other scoring keys (prune_keep 0: full or sequential)."""
    from stages.models.diffusion_model import DiffusionClassifier

    other = DiffusionClassifier.from_arch({**model.arch(), "prune_keep": 0, **keys})
    other.load_state_dict(model.state_dict())
    return other.eval()


def compare(model: Any, x: np.ndarray, split: np.ndarray, stop: dict[str, Any], repeats: int,
            draws: int | None = None, perm: list[int] | None = None) -> dict[str, Any]:
    """Evaluations, agreement (all rows and test_ood's) and wall time of sequential vs full
    scoring of `x` (at `draws`, default the model's; sequential elimination taking the draws in
    the order `perm`, if given)."""
    s = {"draws": draws} if draws else {}
    full_model = with_scoring(model, stop_se=0.0, **s)
    fast_model = with_scoring(model, **stop, draw_perm=perm, **s)
    full, _, rows_full = full_model.score(x)
    fast, _, rows_fast = fast_model.score(x)
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for m, ts in zip((full_model, fast_model), times, strict=True):
            t0 = time.perf_counter()
            m.score(x)
            ts.append(time.perf_counter() - t0)
    same = full.argmax(1) == fast.argmax(1)
    ood = split == "test_ood"
    return {"n": len(x), "classes": model.n_classes, "draws": full_model.draws, "ratio": rows_fast / rows_full,
            "agree": float(same.mean()), "agree_ood": float(same[ood].mean()) if ood.any() else math.nan,
            "rows_full": rows_full / len(x), "rows_fast": rows_fast / len(x),
            "wall": statistics.median(times[1]) / statistics.median(times[0]),
            "full_pred": full.argmax(1), "fast_pred": fast.argmax(1), "fast_model": fast_model}


@torch.no_grad()
def draw_values(model: Any, x: np.ndarray) -> np.ndarray:
    """v_s(y) for every example, class and draw, float64 (n, K, S): the values sequential
    elimination compares (the weighted denoising errors), on the draws `model.score` makes."""
    from stages.models.draw_order import draw_noise

    k, s = model.n_classes, model.draws
    generator = torch.Generator().manual_seed(model.score_seed)
    chunk = max(1, model.score_rows // (k * s))
    out = []
    for i in range(0, len(x), chunk):
        z = model.standardize(torch.from_numpy(np.asarray(x[i : i + chunk], dtype=np.float32)))
        t, eps = draw_noise(len(z), s, model.in_dim, model.steps, generator)
        v = model.errors(z, t, eps, torch.arange(k).expand(len(z), k)).double()
        out.append((v * model.steps * model.elbo_w[t].unsqueeze(1) if model.weighting == "elbo" else v).numpy())
    return np.concatenate(out)


def replay(v: np.ndarray, model: Any, known_sd: bool) -> tuple[float, np.ndarray]:
    """`model`'s sequential elimination (its stop_* keys and `stop_threshold`, drawn order)
    replayed on the full values `v` (n, K, S): (evaluations per example, predictions).
    known_sd: each paired difference's sd is taken over all S draws (what the test would use if
    it knew it: not implementable, so no test of this form beats it at this threshold) instead of
    over the draws seen so far (the real rule, replayed to check this replica against the model's
    own count)."""
    v_all = torch.from_numpy(v)
    n, k, s = v.shape
    rows = torch.arange(n)
    classes = torch.arange(k)
    alive = torch.ones(n, k, dtype=torch.bool)
    used = torch.zeros(n, k, dtype=torch.long)
    cost, lo = 0, 0
    while lo < s:
        hi = min(s, model.stop_first if lo == 0 else lo + model.stop_every)
        live = alive & (alive.sum(1, keepdim=True) > 1) if lo else alive.clone()
        if not live.any():
            break
        cost += int(live.sum()) * (hi - lo)
        used[live] = hi
        seen = v_all[:, :, :hi]
        leader = seen.mean(-1).masked_fill(~alive, math.inf).argmin(1)
        diff = seen - seen[rows, leader].unsqueeze(1)
        rival = live & (classes != leader[:, None])
        spread = (v_all - v_all[rows, leader].unsqueeze(1)) if known_sd else diff
        sd, q = model.stop_threshold(spread.std(-1), rival, s if known_sd else hi)
        drop = rival & (diff.mean(-1) > q * sd * math.sqrt((1 - hi / s) / hi))
        alive &= ~drop
        lo = hi
    mean = v_all.cumsum(-1).gather(2, (used - 1).clamp(min=0).unsqueeze(2)).squeeze(2) / used.clamp(min=1)
    return cost / n, mean.masked_fill(~alive, math.inf).argmin(1).numpy()


def reference_predictions(model: Any, x: np.ndarray, draws: int = 128) -> np.ndarray:
    """Full scoring's predictions at `draws` draws of another `score_seed` than `model`'s: a less
    noisy estimate of the same class scores, from draws none of the compared scorings use."""
    logits, _, _ = with_scoring(model, stop_se=0.0, draws=draws, score_seed=model.score_seed + 1).score(x)
    return logits.argmax(1)


def ordered(model: Any, val: tuple[np.ndarray, np.ndarray], draws: int | None = None) -> list[int]:
    """`draw_order: informative`'s order of `model`'s draws (at `draws`), ranked on `val`."""
    from stages.models.draw_order import informative_order

    return informative_order(with_scoring(model, stop_se=0.0, **({"draws": draws} if draws else {})), *val)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scoring", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2,000 gaussian_shortcut rows (a fixed random subset of test_id + test_ood), 1 timing repeat")
    parser.add_argument("--epochs", type=int, default=100, help="digits10 training epochs")
    parser.add_argument("--stop-se", type=float, default=None, help="default: conf/method/diffusion.yaml")
    parser.add_argument("--stop-first", type=int, default=None)
    parser.add_argument("--stop-every", type=int, default=None)
    parser.add_argument("--stop-test", choices=["t_pooled", "t", "z"], default=None)
    parser.add_argument("--draw-order", choices=["strata", "informative"], default=None,
                        help="the order the test takes the draws in (default: conf/method/diffusion.yaml)")
    args = parser.parse_args(argv)
    os.environ.setdefault("SHIFTLAB_QUIET", "1")
    from stages.core.config import defaults
    from stages.core.runtime import setup_torch

    base = defaults("method", "diffusion")
    se = base.stop_se if args.stop_se is None else args.stop_se
    first = base.stop_first if args.stop_first is None else args.stop_first
    every = base.stop_every if args.stop_every is None else args.stop_every
    order = base.draw_order if args.draw_order is None else args.draw_order
    test = base.stop_test if args.stop_test is None else args.stop_test
    stop = {"stop_se": se, "stop_first": first, "stop_every": every, "stop_test": test}
    if se <= 0:
        parser.error("--stop-se must be > 0 (sequential elimination on)")
    repeats = 1 if args.quick else 3
    setup_torch(0)
    t0 = time.perf_counter()
    results, loaded = {}, {}
    for name, load in (
        ("colored_digits", lambda: checked_out_model("colored_digits", None)),
        ("gaussian_shortcut", lambda: checked_out_model("gaussian_shortcut", 2000 if args.quick else None)),
        ("digits10", lambda: digits10_model(args.epochs)),
    ):
        loaded[name] = model, x, val, split = load()
        perm = ordered(model, val) if order == "informative" else None
        results[name] = compare(model, x, split, stop, repeats, perm=perm)
    # More draws: the first round (every class) is a smaller share, so the ratio falls (same models);
    # and each scoring against an independent, less noisy reference.
    reference = {}
    for name in ("digits10", "gaussian_shortcut"):
        m, xs, v, sp = loaded[name]
        perm = ordered(m, v, draws=64) if order == "informative" else None
        results[f"{name}, 64 draws"] = compare(m, xs, sp, stop, repeats, draws=64, perm=perm)
        reference[name] = reference_predictions(m, xs)
    model, x, val, split = loaded["digits10"]  # the harder case: the replay and the last line below
    print(f"Sequential elimination (stop_test={test}, stop_se={se:g}, stop_first={first}, stop_every={every}, draw_order={order}) "
          f"vs full scoring, test_id + test_ood, 1 thread; {time.perf_counter() - t0:.0f} s\n")
    print("| model | classes | draws | examples | evaluations / example (full) | adaptive | ratio | agreement | on test_ood | wall-time ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['classes']} | {r['draws']} | {r['n']} | {r['rows_full']:.0f} | {r['rows_fast']:.1f} | {r['ratio']:.3f} | "
              f"{r['agree']:.2%} | {r['agree_ood']:.2%} | {r['wall']:.2f} |")
    hard = results["digits10"]
    if order == "strata":
        # What a test of this form could reach on digits10 if it knew each difference's sd: the
        # replica is checked against the model's own count first (same rule, same draws).
        v = draw_values(with_scoring(model, stop_se=0.0), x)
        cost, pred = replay(v, hard["fast_model"], known_sd=False)
        exact = math.isclose(cost, hard["rows_fast"]) and bool((pred == hard["fast_pred"]).all())
        full = v.mean(-1).argmin(1)
        check = "the model's own count and predictions" if exact else "NOT the model's own count or predictions"
        print(f"\nThe rule replayed on digits10's full values: {cost / (model.n_classes * model.draws):.3f}x, {check}. "
              "With each difference's sd known (over all S draws, z test; not implementable), at stop_first 2 and 3:")
        for k in (2.0, 2.5, 3.0):
            line = []
            for f in (2, 3):
                cost, pred = replay(v, with_scoring(model, **{**stop, "stop_se": k, "stop_first": f, "stop_test": "z"}), known_sd=True)
                line.append(f"stop_first {f}: {cost / (model.n_classes * model.draws):.3f}x at {(pred == full).mean():.2%}")
            print(f"  stop_se {k:g}: " + "; ".join(line))
    two = results["colored_digits"]
    print(f"\n2-class (colored_digits): {two['ratio']:.3f}x network evaluations at {two['agree']:.4f} agreement; "
          f"gaussian_shortcut: {results['gaussian_shortcut']['ratio']:.3f}x at {results['gaussian_shortcut']['agree']:.4f} "
          f"({results['gaussian_shortcut']['agree_ood']:.4f} on its shifted test_ood rows)")
    print("\nAgreement with an independent reference (full scoring, 128 draws of another score_seed), "
          "evaluations per example in brackets:")
    for name, ref in reference.items():
        cells = []
        for draws, key in ((32, name), (64, f"{name}, 64 draws")):
            r = results[key]
            cells.append(f"{draws} draws: full {(r['full_pred'] == ref).mean():.2%} [{r['rows_full']:.0f}], "
                         f"adaptive {(r['fast_pred'] == ref).mean():.2%} [{r['rows_fast']:.1f}]")
        print(f"  {name}: " + "; ".join(cells))
    more = results["digits10, 64 draws"]
    print(f"at 64 draws: {more['ratio']:.3f}x network evaluations of full 64-draw scoring at {more['agree']:.4f} agreement "
          f"(digits10, {more['n']} examples)")
    print(f"wall time: {hard['wall']:.2f}x of full scoring (digits10, {hard['n']} examples)")
    print(f"scoring: {hard['ratio']:.3f}x network evaluations of full scoring at {hard['agree']:.4f} agreement "
          f"(digits10, {hard['n']} examples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
