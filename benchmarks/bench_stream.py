"""Streaming vs in-memory training, peak memory at two dataset sizes, and CPU threads (README, "Real scale").

    python -m benchmarks.bench_stream [--sizes 20000 80000] [--epochs 1] [--repeats 3]

Each run is the real train stage (`python -m stages.train <dataset> erm 0 ...`, the erm recipe
of conf/method/erm.yaml with `epochs` overridden) in a fresh process, in a temp project holding
params.yaml and a prepared file of N uint8 3×64×64 images (70 % train, 10 % each of val, test_id,
test_ood; 4,096-row row groups, as the image loaders write them). Peak RSS is the child's
`ru_maxrss` (os.wait4); wall time is the whole stage (reading, standardisation, training, the
scoring of every split after each epoch, writing the model folder).

Measured, medians of `repeats` runs, interleaved:
- peak RSS of `runtime.stream=true` at each size (the issue's bound: 80k within 30 % of 20k), and of
  the in-memory reader at the smallest size (and at the others when `--in-memory-all`);
- throughput (train images × epochs / wall s) streamed vs in-memory at the smallest size;
- in-memory throughput with `runtime.threads=0` (every core) vs 1: the whole stage, and the
  training loop alone (`training.run_epoch` on 4,096 in-memory images, MLP [256], in-process).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (3, 64, 64)
FRACTIONS = {"train": 0.7, "val": 0.1, "test_id": 0.1, "test_ood": 0.1}


def write_dataset(root: Path, name: str, n: int, seed: int = 0) -> Path:
    """N images with a class-dependent bright square and an attribute-dependent tint, plus noise."""
    from stages.core.artifacts import prepared_path, prepared_schema
    from stages.core.io import numpy_to_fixed_list, write_parquet_stream

    rng = np.random.default_rng(seed)
    splits = np.concatenate([[s] * int(round(f * n)) for s, f in FRACTIONS.items()])[:n]
    rng.shuffle(splits)
    dim = int(np.prod(SHAPE))
    path = root / prepared_path(name)
    with write_parquet_stream(path, prepared_schema(dim, "uint8"), column_encoding={"x.list.element": "BYTE_STREAM_SPLIT"}) as (out, meta):
        for i in range(0, n, 2048):
            k = min(2048, n - i)
            y = rng.integers(0, 2, k)
            rho = np.where(splits[i : i + k] == "test_ood", 0.1, 0.9)
            a = np.where(rng.random(k) < rho, y, 1 - y)
            img = rng.integers(0, 64, (k, *SHAPE), dtype=np.int64)
            img[:, :, 16:48, 16:48] += 96 * y[:, None, None, None]
            img[:, 0] += 64 * a[:, None, None]
            out.write(pa.table({
                "id": np.arange(i, i + k, dtype=np.int64), "split": splits[i : i + k], "y": y, "a": a, "g": 2 * y + a,
                "x": numpy_to_fixed_list(np.clip(img, 0, 255).astype(np.uint8).reshape(k, dim), pa.uint8()),
            }))
        meta.update(dataset=name, kind=name, n_classes=2, n_attrs=2, shape=list(SHAPE), x_dtype="uint8")
    return path


def run_stage(root: Path, name: str, overrides: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one train stage in a fresh process."""
    env = dict(os.environ, SHIFTLAB_QUIET="1", PYTHONPATH=str(ROOT))
    shutil.rmtree(root / "data" / "models", ignore_errors=True)
    shutil.rmtree(root / "scratch", ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "stages.train", name, "erm", "0", *overrides], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"train {name} {overrides} failed:\n{out}\n{err}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def training_throughput(threads: int, repeats: int, n: int = 4096, hidden: int = 256) -> float:
    """Median examples/s of the training loop alone (`training.run_epoch`, AdamW, batch 128) on n
    in-memory 3x64x64 inputs with an MLP [hidden], at `threads` intra-op threads."""
    import torch

    from stages.models.mlp import MLPClassifier
    from stages.models.nets import MLPEncoder, Standardize
    from stages.models.training import cross_entropy, run_epoch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dim = int(np.prod(SHAPE))
    data = {"x": torch.rand(n, dim, generator=g), "y": torch.randint(0, 2, (n,), generator=g)}
    model = MLPClassifier(MLPEncoder(dim, [hidden]), 2, Standardize(dim))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_epoch(data, lambda b: cross_entropy(model(b["x"]), b), opt, 128, g)
        times.append(time.perf_counter() - start)
    return n / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 80000])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-memory-all", action="store_true", help="also the in-memory reader's peak RSS at every size")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_stream_") as tmp:
        root = Path(tmp)
        shutil.copy(ROOT / "params.yaml", root / "params.yaml")
        for n in args.sizes:
            t = time.perf_counter()
            path = write_dataset(root, f"img{n}", n)
            print(f"wrote {n} images: {path.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t:.0f} s", flush=True)
        base = [f"method.erm.epochs={args.epochs}"]
        small = min(args.sizes)
        train_small = int(round(FRACTIONS["train"] * small))
        runs: dict[str, tuple[str, list[str]]] = {}
        for n in args.sizes:
            runs[f"stream {n}"] = (f"img{n}", [*base, "runtime.stream=true"])
            if n == small or args.in_memory_all:
                runs[f"memory {n}"] = (f"img{n}", base)
        runs[f"memory {small} threads=all"] = (f"img{small}", [*base, "runtime.threads=0"])
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in runs}
        for r in range(args.repeats):
            order = list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]  # rotate: no run always goes first
            for key in order:
                results[key].append(run_stage(root, *runs[key]))
                print(f"  round {r + 1} {key}: {results[key][-1][0]:.1f} s, peak RSS {results[key][-1][1] / 2**20:.0f} MiB", flush=True)

    def med(key: str, i: int) -> float:
        return statistics.median(v[i] for v in results[key])

    print(f"\nerm on uint8 3x64x64 images, {args.epochs} epoch(s), median of {args.repeats}, {os.cpu_count()} cores")
    print(f"{'run':<28} {'wall s':>8} {'peak RSS MiB':>13}")
    for key in runs:
        print(f"{key:<28} {med(key, 0):>8.1f} {med(key, 1) / 2**20:>13.0f}")
    big = max(args.sizes)
    print(f"\npeak RSS, streamed, {big} vs {small} images: {med(f'stream {big}', 1) / med(f'stream {small}', 1):.2f}x (bound 1.30x)")
    ratio = med(f"memory {small}", 0) / med(f"stream {small}", 0)
    print(f"throughput streamed / in-memory at {small}: {ratio:.2f} "
          f"({train_small * args.epochs / med(f'stream {small}', 0):.0f} vs {train_small * args.epochs / med(f'memory {small}', 0):.0f} train images/s of stage time)")
    threads = med(f"memory {small}", 0) / med(f"memory {small} threads=all", 0)
    print(f"whole stage, threads all ({os.cpu_count()}) vs 1, in memory at {small}: {threads:.2f}x faster")
    from stages.core.runtime import available_cores

    one, every = training_throughput(1, args.repeats + 2), training_throughput(available_cores(), args.repeats + 2)
    print(f"training loop alone (MLP [256] on 3x64x64, batch 128): {every:.0f} examples/s at {available_cores()} threads "
          f"vs {one:.0f} at 1: {every / one:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
