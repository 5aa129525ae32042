"""Decode image files in parallel and stream them into the prepared Parquet as uint8 pixels.

Each image is opened with Pillow, converted to 8-bit RGB (`to_rgb`: 16-bit greyscale scaled
over its full range, float pixels refused), resized so its shorter side is
`resolution` and centre-cropped to resolution × resolution (`ImageOps.fit`, bilinear), and
stored CHW-flattened as uint8 in `x` (metadata `x_dtype: uint8`; readers divide by 255).
For JPEGs, `Image.draft` first lets libjpeg decode at a reduced scale no smaller than the
target, which is most of the speed.

Rows go through a process pool in blocks of `raw.CHUNK_ROWS`, at most a few blocks in
flight, and are written in row groups as they come back in order — memory stays flat
however many images there are, and the bytes do not depend on the number of workers.
"""

from __future__ import annotations

import hashlib
import io as _io
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from stages.core import artifacts
from stages.core.io import ArtifactError, write_parquet_stream
from stages.core.schema import Checks
from stages.datasets.raw import CHUNK_ROWS, DOCS, Plan, base_table, observed_stats, summary
from stages.evaluation import regime

T = TypeVar("T")
R = TypeVar("R")
MAX_ERRORS_LISTED = 20
# Parquet stores uint8 as 4-byte ints; split into byte streams, zstd squeezes the three zero
# streams for free (half the write time, a third of the read time of dictionary encoding).
PIXEL_ENCODING = {"x.list.element": "BYTE_STREAM_SPLIT"}
BAD_IMAGE = ("error", "skip")


def check_images(c: Checks, resolution: int, on_bad_image: str, workers: int) -> None:
    """The config checks every image benchmark shares."""
    c.require(4 <= resolution <= 512, "resolution", f"must be in 4..512, got {resolution}")
    c.choice(on_bad_image, "on_bad_image", BAD_IMAGE)
    c.non_negative(workers, "workers")


# Pillow's 16-bit greyscale modes (PNG, TIFF). Its own convert("RGB") clips them at 255 instead
# of scaling, so a 16-bit image came out almost all white.
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
SIXTEEN_MAX = 65535


class PixelModeError(ValueError):
    """An image whose pixel mode has no defined mapping to 8-bit RGB."""


def to_rgb(im: Any) -> Any:
    """A Pillow image as 8-bit RGB: 16-bit greyscale (the I;16 modes, and 32-bit 'I' whose values
    fit 16 bits, as older Pillows open 16-bit PNGs) scaled over the full range (v/257 rounded:
    65535 -> 255); palette, 1-bit, alpha and CMYK/YCbCr/LAB/HSV modes through Pillow's convert
    (alpha dropped). PixelModeError for float ('F') pixels and 'I' values outside [0, 65535],
    whose range says nothing about what white is, and any mode Pillow cannot convert."""
    from PIL import Image

    if im.mode in SIXTEEN_BIT or im.mode == "I":
        values = np.asarray(im)
        low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
        if low < 0 or high > SIXTEEN_MAX:
            raise PixelModeError(
                f"pixel mode 'I' (32-bit integer) with values in [{low}, {high}], outside the 16-bit range "
                f"[0, {SIXTEEN_MAX}] this loader scales to 8 bits; save the image as 8- or 16-bit"
            )
        eight = ((values.astype(np.uint32) + 128) // 257).astype(np.uint8)  # round(v * 255 / 65535)
        return Image.fromarray(eight).convert("RGB")
    if im.mode == "F":
        raise PixelModeError("pixel mode 'F' (32-bit float) has no fixed range to map to 8 bits; save the image as 8- or 16-bit")
    try:
        return im.convert("RGB")
    except ValueError as e:  # e.g. 'La': "conversion from La to L not supported"
        raise PixelModeError(f"pixel mode '{im.mode}' cannot be converted to RGB ({e}); save the image as 8-bit RGB") from e


def decode_image(data: bytes, resolution: int) -> np.ndarray:
    """Encoded image bytes -> uint8 pixels (3 · resolution²,), CHW order. Raises OSError/ValueError if
    undecodable (PixelModeError, a ValueError, for a pixel mode with no 8-bit RGB meaning)."""
    from PIL import Image, ImageOps

    with Image.open(_io.BytesIO(data)) as im:
        im.draft("RGB", (resolution, resolution))
        rgb = to_rgb(im)
    fitted = ImageOps.fit(rgb, (resolution, resolution), method=Image.Resampling.BILINEAR)
    return np.asarray(fitted, dtype=np.uint8).transpose(2, 0, 1).reshape(-1)


def decode_chunk(job: tuple[str, list[str], int]) -> tuple[np.ndarray, list[str], list[str | None]]:
    """Decode one block of files under `root`: (pixels (k, dim) uint8, sha256 per file, error per file or None).

    A file that is missing or fails to decode gets a zero row, an empty digest and its error.
    """
    from PIL import Image

    root, files, resolution = job
    pixels = np.zeros((len(files), 3 * resolution * resolution), dtype=np.uint8)
    digests: list[str] = []
    errors: list[str | None] = []
    for i, name in enumerate(files):
        try:
            data = (Path(root) / name).read_bytes()
        except OSError as e:
            digests.append("")
            errors.append(f"cannot read the file ({e.strerror or e})")
            continue
        digests.append(hashlib.sha256(data).hexdigest())
        try:
            pixels[i] = decode_image(data, resolution)
            errors.append(None)
        except PixelModeError as e:  # it decodes; its pixels have no 8-bit meaning
            errors.append(str(e))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            errors.append(f"cannot decode the image ({type(e).__name__}: {e})")
    return pixels, digests, errors


def ordered_map(fn: Callable[[T], R], jobs: Iterable[T], workers: int, window: int | None = None) -> Iterator[R]:
    """`map(fn, jobs)` over `workers` processes, results in order, at most `window` jobs in flight.

    The default window (8 jobs per worker) keeps the workers busy while the caller is away
    writing a row group: with 2 per worker they ran dry and 2 workers decoded 1.47x as fast as
    one process instead of 1.6x (benchmarks/bench_prepare.py).
    """
    if workers <= 1:
        yield from map(fn, jobs)
        return
    window = window or 8 * workers
    it = iter(jobs)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending = deque(pool.submit(fn, job) for job in islice(it, window))
        while pending:
            result = pending.popleft().result()
            for job in islice(it, 1):
                pending.append(pool.submit(fn, job))
            yield result


def n_workers(configured: int) -> int:
    """Worker processes to use: `configured`, or one per available core when 0."""
    if configured > 0:
        return configured
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def write_images(
    out: Path,
    plan: Plan,
    root: Path,
    resolution: int,
    on_bad_image: str,
    workers: int,
    desc: str | None = None,
) -> str:
    """Decode `plan.extra['file']` (paths relative to `root`) and stream the prepared file to `out`.

    An undecodable or missing image is an ArtifactError naming the file, its CSV row and the
    fix (on_bad_image=error), or is left out and counted in the metadata (`n_skipped`,
    `skipped_files`; on_bad_image=skip). The metadata gets `raw_checksums.images`: the sha256
    of the lines "<file>\\t<sha256 of its bytes>\\n" over every image read, in row order, and
    `separation`, estimated as the blocks pass on a bounded sample of the train rows
    (`regime.train_sample`), each image area-averaged to 3×8×8 (`regime.pool_pixels`).
    """
    import pyarrow as pa

    from stages.core.runtime import progress

    dataset = plan.meta["dataset"]
    files = plan.extra["file"]
    dim = 3 * resolution * resolution
    schema = artifacts.prepared_schema(dim, "uint8").append(pa.field("file", pa.string(), nullable=False))
    starts = range(0, len(plan), CHUNK_ROWS)
    jobs = ((str(root), files[s : s + CHUNK_ROWS].tolist(), resolution) for s in starts)
    combined = hashlib.sha256()
    kept = np.ones(len(plan), dtype=bool)
    skipped: list[str] = []
    n_attrs = int(plan.meta["n_attrs"])
    sample, weights = regime.train_sample(plan.split, plan.y, plan.a, n_attrs, int(plan.meta["params"].get("seed", 0)))
    pooled_dim = 3 * min(regime.POOL_SIDE, resolution) ** 2
    separation = regime.SeparationAccumulator(pooled_dim, int(plan.meta["n_classes"]), n_attrs, weights)
    with write_parquet_stream(out, schema, column_encoding=PIXEL_ENCODING) as (stream, meta):
        results = ordered_map(decode_chunk, jobs, n_workers(workers))
        for start, (pixels, digests, errors) in progress(
            zip(starts, results, strict=True), desc=desc or f"decode {dataset}", total=len(starts), unit="block"
        ):
            index = np.arange(start, start + len(digests))
            for i, (name, digest, err) in enumerate(zip(files[index], digests, errors, strict=True)):
                combined.update(f"{name}\t{digest}\n".encode())
                if err is None:
                    continue
                if on_bad_image == "error":
                    raise ArtifactError(
                        f"{root / name}: {err} (row {plan.row[index[i]]} of the metadata CSV). "
                        f"Re-download or replace the file (see {DOCS}, section '{dataset}'), or set "
                        f"dataset.{dataset}.on_bad_image=skip to leave such images out and count them"
                    )
                kept[index[i]] = False
                skipped.append(str(name))
            ok = kept[index]
            rows = index[ok]
            pick = ok & sample[index]
            if pick.any():
                separation.add(regime.pool_pixels(pixels[pick], resolution), plan.y[index[pick]], plan.a[index[pick]])
            table = pa.table(
                {
                    **base_table(plan, rows),
                    "x": pa.FixedSizeListArray.from_arrays(pa.array(pixels[ok].reshape(-1), type=pa.uint8()), dim),
                    "file": pa.array(files[rows].tolist(), type=pa.string()),
                }
            )
            stream.write(table)
        meta.update(plan.meta)
        meta["x_dtype"] = "uint8"
        meta["shape"] = [3, resolution, resolution]
        meta["layout"] = "CHW"
        meta["n_skipped"] = len(skipped)
        meta["skipped_files"] = skipped[:MAX_ERRORS_LISTED]
        meta.update(observed_stats(plan, kept))
        meta.setdefault("raw_checksums", {})["images"] = {"sha256": combined.hexdigest(), "n_files": len(plan)}
        meta["separation"] = separation.result()
        meta["separation_source"] = "train_sample_pooled"
        n_rows = stream.num_rows
    return summary(out, meta, n_rows)


def meta_base(dataset: str, kind: str, cfg: Any, n_classes: int, n_attrs: int, **more: Any) -> dict[str, Any]:
    """The metadata every image loader starts from (the rest is added by make_plan / write_images)."""
    import dataclasses

    return {
        "dataset": dataset,
        "kind": kind,
        "n_classes": n_classes,
        "n_attrs": n_attrs,
        "shape": [3, cfg.resolution, cfg.resolution],
        # `workers` changes how fast, never what is written: it stays out of the file.
        "params": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "workers"},
        **more,
    }
