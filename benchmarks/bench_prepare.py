"""Throughput and peak memory of `prepare` on a synthetic Waterbirds-format folder.

    python -m benchmarks.bench_prepare [--images 20000] [--size 128] [--runs 3] [--workers 1 2]

Writes `--images` JPEGs (size × size, smooth colour fields plus noise, so they compress like
photos) and a `metadata.csv` in the waterbird_complete95_forest2water2 layout into a temp
folder, then runs `python -m stages.prepare waterbirds` on it once per worker count per
run, alternating the worker counts within each run so machine load hits them alike.
For each it prints the median images/s, the median peak memory of the whole process tree
(the stage plus its decoding workers, sampled every 20 ms with psutil), the CPU seconds they
used and the speed-up over one worker, as a markdown table. A wall-clock speed-up needs idle
cores: the load average is printed with every run. The output files of every run are checked byte-identical.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_folder(root: Path, n: int, size: int, seed: int = 0) -> None:
    """`n` JPEGs under species folders + metadata.csv (img_id, img_filename, y, split, place, place_filename).

    Groups follow the real release's proportions (95% of train agrees with its background).
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    rows = []
    split = rng.choice([0, 1, 2], size=n, p=[0.41, 0.10, 0.49])
    y = rng.integers(0, 2, size=n)
    agree = np.where(split == 0, rng.random(n) < 0.95, rng.random(n) < 0.5)
    place = np.where(agree, y, 1 - y)
    for i in range(n):
        folder = root / f"{i % 200:03d}.Species_{i % 200}"
        folder.mkdir(parents=True, exist_ok=True)
        a, b, c = rng.random(3)
        img = np.stack([a * xx + (1 - a) * yy, b * yy, c * (1 - xx)], axis=-1) * 255
        img += rng.normal(0, 12, img.shape)
        name = f"{folder.name}/Bird_{i:06d}.jpg"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / name, "JPEG", quality=90)
        rows.append([i + 1, name, int(y[i]), int(split[i]), int(place[i]), f"/x/{i}.jpg"])
    with open(root / "metadata.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["img_id", "img_filename", "y", "split", "place", "place_filename"])
        w.writerows(rows)


def run_prepare(workdir: Path, raw: Path, workers: int) -> tuple[float, float, int, bytes]:
    """(wall seconds, CPU seconds of the whole tree, peak bytes of the process tree, output bytes) of one run."""
    import resource

    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)

    env = dict(os.environ, SHIFTLAB_QUIET="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "stages.prepare", "waterbirds",
        f"dataset.waterbirds.root={raw}", f"dataset.waterbirds.workers={workers}", "--params", "params.yaml",
    ]
    out = workdir / "data/prepared/waterbirds.parquet"
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"prepare failed:\n{stdout}\n{stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the stage and its workers, once waited for
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu, peak, out.read_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--size", type=int, default=128, help="side of the synthetic JPEGs, pixels")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp_path = Path(tmp)
        raw = tmp_path / "raw"
        t0 = time.perf_counter()
        make_folder(raw, args.images, args.size)
        print(f"wrote {args.images} {args.size}x{args.size} JPEGs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
        times: dict[int, list[float]] = {w: [] for w in args.workers}
        peaks: dict[int, list[int]] = {w: [] for w in args.workers}
        cpus: dict[int, list[float]] = {w: [] for w in args.workers}
        outputs = set()
        for r in range(args.runs):
            for w in args.workers:
                seconds, cpu, peak, data = run_prepare(tmp_path, raw, w)
                times[w].append(seconds)
                cpus[w].append(cpu)
                peaks[w].append(peak)
                outputs.add(data)
                print(f"run {r + 1}, {w} worker(s): {seconds:.1f} s wall, {cpu:.1f} s CPU, peak {peak / 2**20:.0f} MiB, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    base = statistics.median(times[args.workers[0]])
    print(f"| workers | images/s (median of {args.runs}) | wall s | CPU s (stage + workers) | peak memory, process tree | speed-up vs {args.workers[0]} |")
    print("|---|---|---|---|---|---|")
    for w in args.workers:
        t = statistics.median(times[w])
        print(
            f"| {w} | {args.images / t:.0f} | {t:.1f} | {statistics.median(cpus[w]):.1f} | "
            f"{statistics.median(peaks[w]) / 2**20:.0f} MiB | {base / t:.2f}x |"
        )
    print(f"\noutputs byte-identical across all runs and worker counts: {len(outputs) == 1}")
    print(f"cores available: {len(os.sched_getaffinity(0))}, load average at the end: {os.getloadavg()[0]:.1f}")
    return 0 if len(outputs) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
