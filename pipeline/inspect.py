"""Explain any artifact under data/ without writing code.

    python -m pipeline.inspect PATH [--json] [--rows N]
    make inspect PATH=data/predictions/<dataset>/<model>/seed=0.parquet

- A Parquet file: schema, row count, file metadata (ours and Parquet's own), the first rows,
  per-column summary statistics and its lineage — the DVC stage that wrote it, with that
  stage's command, params and input hashes from dvc.lock (and whether the file still
  matches the hash recorded there). A predictions file also gets its per-group accuracy
  table, per split.
- A JSON file (metrics, plot data, validation results) or a safetensors file (weights):
  a short summary of its content and its lineage.
- A directory: every artifact in it with its size and the stage that wrote it.
- Anything else (a FIFO, socket or device is never opened), a symlink loop, or a corrupt file:
  one line on stderr and exit code 2.

Output is bounded whatever the file holds: long metadata values, strings and lists are cut
(with the cut marked), and at most MAX_ENTRIES files/keys are listed. `--json` prints the same
information as one JSON object for scripts.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_TEXT = 200  # characters of any one value shown
MAX_ENTRIES = 50  # metadata keys, directory entries, JSON keys
MAX_LIST = 8  # list elements shown in a cell
MAX_DEPTH = 20  # levels of nested lists/objects shown
PARQUET_MAGIC = b"PAR1"
# Control characters (ANSI escapes start with ESC) and bidi overrides: shown escaped, never raw.
UNSAFE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character (except newline) shown as an escape like \\x1b."""
    return UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


class InspectError(Exception):
    """The path cannot be explained (missing, not an artifact, corrupt)."""


def clip(value: Any, limit: int = MAX_TEXT, depth: int = 0) -> Any:
    """`value` made safe to print: strings cut to `limit`, lists to MAX_LIST, dicts to MAX_ENTRIES,
    nesting to MAX_DEPTH (JSON a few hundred levels deep would exhaust Python's recursion)."""
    if isinstance(value, list | tuple | dict) and depth >= MAX_DEPTH:
        return f"… ({type(value).__name__} nested deeper than {MAX_DEPTH} levels)"
    if isinstance(value, str):
        if len(value) <= limit:
            return printable(value)
        return printable(value[:limit]) + f"… (+{len(value) - limit} chars)"
    if isinstance(value, bytes):
        return clip(value.decode("utf-8", errors="replace"), limit)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        head = [clip(v, limit, depth + 1) for v in value[:MAX_LIST]]
        return head + ([f"… (+{len(value) - MAX_LIST} more)"] if len(value) > MAX_LIST else [])
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(clip(k, 60)): clip(v, limit, depth + 1) for k, v in items[:MAX_ENTRIES]}
        if len(items) > MAX_ENTRIES:
            out["…"] = f"+{len(items) - MAX_ENTRIES} more keys"
        return out
    return value


# ---- lineage ---------------------------------------------------------------------------------


def find_root(path: Path) -> Path | None:
    """The nearest ancestor (or cwd) holding dvc.yaml: the project the artifact belongs to."""
    for p in [path.resolve(), *path.resolve().parents, Path.cwd().resolve()]:
        if (p / "dvc.yaml").is_file():
            return p
    return None


def load_lock(root: Path | None) -> dict[str, Any]:
    """dvc.lock's stages ({} when there is no lock yet)."""
    if root is None or not (root / "dvc.lock").is_file():
        return {}
    import yaml

    from pipeline.workspace import read_lock

    try:
        lock = read_lock(root) or {}
    except yaml.YAMLError as e:
        raise InspectError(f"{root / 'dvc.lock'}: not valid YAML ({e})") from e
    except RecursionError:
        raise InspectError(f"{root / 'dvc.lock'}: YAML nested too deeply to read") from None
    stages = lock.get("stages", {}) if isinstance(lock, dict) else {}
    return stages if isinstance(stages, dict) else {}


def lineage(path: Path, root: Path | None, stages: dict[str, Any]) -> dict[str, Any] | None:
    """The lock entry of the stage whose outputs contain `path` (a file out or a folder out)."""
    if root is None:
        return None
    try:
        rel = path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None
    for name, st in stages.items():
        for out in st.get("outs", []) or []:
            out_path = str(out.get("path", "")).rstrip("/")
            if rel == out_path or rel.startswith(out_path + "/"):
                info: dict[str, Any] = {
                    "stage": name,
                    "cmd": clip(st.get("cmd")),
                    "output": out_path,
                    "output_md5": out.get("md5"),
                    "params": clip(_flatten({k: v for f in (st.get("params") or {}).values() for k, v in (f or {}).items()})),
                    "deps": clip([{"path": d.get("path"), "md5": d.get("md5")} for d in st.get("deps", []) or []]),
                }
                if rel == out_path and path.is_file() and out.get("md5"):
                    info["matches_lock"] = _md5(path) == out.get("md5")
                return info
    return None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"evaluate": {"ece_bins": 15}} -> {"evaluate.ece_bins": 15}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- parquet ---------------------------------------------------------------------------------


def _column_stats(table: Any, name: str) -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name)
    stats: dict[str, Any] = {"type": str(col.type), "nulls": int(col.null_count)}
    typ = col.type
    if pa.types.is_fixed_size_list(typ) or pa.types.is_list(typ) or pa.types.is_large_list(typ):
        flat = pc.list_flatten(col)
        stats["list_length"] = typ.list_size if pa.types.is_fixed_size_list(typ) else "variable"
        col, typ = flat, flat.type
        stats["values"] = "all list elements"
    if pa.types.is_integer(typ) or pa.types.is_floating(typ):
        arr = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64) if len(col) else np.zeros(0)
        finite = arr[np.isfinite(arr)]
        if len(finite):
            stats.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()), std=float(finite.std()))
        stats["non_finite"] = int(len(arr) - len(finite))
        if pa.types.is_integer(typ):
            stats["distinct"] = int(len(np.unique(arr))) if len(arr) else 0
    elif pa.types.is_string(typ) or pa.types.is_large_string(typ):
        counts = pc.value_counts(col).to_pylist()
        counts.sort(key=lambda c: (-c["counts"], str(c["values"])))
        stats["distinct"] = len(counts)
        stats["top"] = {str(clip(c["values"], 40)): c["counts"] for c in counts[:5]}
    return stats


def _head(table: Any, n: int) -> list[dict[str, Any]]:
    return [clip(r, 60) for r in table.slice(0, n).to_pylist()]


def group_accuracy_table(table: Any) -> list[dict[str, Any]]:
    """Per split and group of a predictions table: n, accuracy (pred == y)."""
    import numpy as np

    split = np.asarray(table.column("split").to_pylist(), dtype=object)
    y = table.column("y").to_numpy()
    a = table.column("a").to_numpy()
    g = table.column("g").to_numpy()
    correct = table.column("pred").to_numpy() == y
    rows = []
    for s in dict.fromkeys(split.tolist()):
        m = split == s
        for gi in sorted(set(g[m].tolist())):
            mg = m & (g == gi)
            rows.append({"split": s, "group": int(gi), "y": int(y[mg][0]), "a": int(a[mg][0]), "n": int(mg.sum()), "acc": float(correct[mg].mean())})
        rows.append({"split": s, "group": "all", "y": None, "a": None, "n": int(m.sum()), "acc": float(correct[m].mean())})
    return rows


def inspect_parquet(path: Path, rows: int) -> dict[str, Any]:
    """Schema, metadata, head, per-column stats (and per-group accuracy for predictions)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        table = pf.read()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InspectError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
    md = pf.metadata
    raw = pf.schema_arrow.metadata or {}
    meta: dict[str, Any] = {}
    keys = [k for k in raw if k != b"ARROW:schema"]
    for k in keys[:MAX_ENTRIES]:
        key, v = k.decode(errors="replace"), raw[k]
        try:
            meta[key] = json.loads(v)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # shown as the text it is
            meta[key] = v.decode(errors="replace")
    info: dict[str, Any] = {
        "kind": "parquet",
        "rows": table.num_rows,
        "schema": [{"name": f.name, "type": clip(str(f.type), 80), "nullable": f.nullable} for f in pf.schema_arrow][:MAX_ENTRIES],
        "metadata": clip(meta) | ({"…": f"+{len(keys) - MAX_ENTRIES} more keys"} if len(keys) > MAX_ENTRIES else {}),
        "parquet": {
            "created_by": clip(md.created_by, 80),
            "format_version": md.format_version,
            "row_groups": md.num_row_groups,
            "columns": md.num_columns,
            "serialized_metadata_bytes": md.serialized_size,
        },
        "head": _head(table, rows),
        "columns": {name: _column_stats(table, name) for name in table.column_names[:MAX_ENTRIES]},
    }
    if {"split", "y", "a", "g", "pred", "logits"} <= set(table.column_names):
        info["group_accuracy"] = group_accuracy_table(table)
    return info


# ---- other artifacts ---------------------------------------------------------------------------


def inspect_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InspectError(f"{path}: not valid JSON ({e})") from e
    except RecursionError:  # the parser recurses once per level
        raise InspectError(f"{path}: JSON nested too deeply to read (over ~{sys.getrecursionlimit()} levels of arrays or objects)") from None
    info: dict[str, Any] = {"kind": "json"}
    if isinstance(obj, dict):
        info["keys"] = clip(sorted(obj))
        info["scalars"] = clip({k: v for k, v in obj.items() if isinstance(v, int | float | str | bool) or v is None})
    elif isinstance(obj, list):
        info["records"] = len(obj)
        info["fields"] = clip(sorted({k for r in obj if isinstance(r, dict) for k in r}))
        info["head"] = [clip(r, 60) for r in obj[:3]]
    return info


def inspect_safetensors(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > min(path.stat().st_size, 100_000_000):
                raise InspectError(f"{path}: not a valid safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise InspectError(f"{path}: not a valid safetensors file ({e})") from e
    except RecursionError:
        raise InspectError(f"{path}: not a valid safetensors file (its JSON header is nested too deeply to read)") from None
    if not isinstance(header, dict):
        raise InspectError(f"{path}: not a valid safetensors file (its header is JSON {type(header).__name__}, not an object)")
    meta = header.pop("__metadata__", {}) or {}
    shiftlab = meta.get("shiftlab")
    try:
        meta_obj = json.loads(shiftlab) if isinstance(shiftlab, str) else meta
    except json.JSONDecodeError:
        meta_obj = meta
    tensors = {k: {"dtype": v.get("dtype"), "shape": v.get("shape")} for k, v in header.items() if isinstance(v, dict)}
    return {"kind": "safetensors", "metadata": clip(meta_obj), "tensors": clip(tensors), "n_tensors": len(tensors)}


def inspect_dir(path: Path, root: Path | None, stages: dict[str, Any]) -> dict[str, Any]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise InspectError(f"{path}: no artifacts here (the folder is empty or holds only hidden files)")
    entries = []
    for p in files[:MAX_ENTRIES * 4]:
        lin = lineage(p, root, stages)
        entries.append({"path": p.relative_to(path).as_posix(), "bytes": p.stat().st_size, "stage": lin["stage"] if lin else None})
    out = {"kind": "directory", "files": len(files), "total_bytes": sum(p.stat().st_size for p in files), "entries": entries}
    if len(files) > len(entries):
        out["truncated"] = f"+{len(files) - len(entries)} more files"
    return out


# What a path that is neither a file nor a folder is (os.stat's mode), for the refusal.
_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_path(p: Path) -> os.stat_result:
    """`p`'s stat if it is a regular file or a folder (symlinks followed), else InspectError:
    missing, a symlink loop, a dangling symlink, or a FIFO, socket or device, which are never
    opened (reading a FIFO blocks until a writer comes, /dev/zero never ends)."""
    try:
        st = os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InspectError(f"{p}: a symlink loop (too many levels of symbolic links); nothing to inspect") from None
        if e.errno == errno.ENOENT and os.path.islink(p):
            raise InspectError(f"{p}: a symlink to {os.readlink(p)!r}, which does not exist") from None
        if e.errno == errno.ENOENT:
            raise InspectError(f"{p}: no such file or directory") from None
        raise InspectError(f"{p}: cannot be read ({e.strerror or e})") from None
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return st
    what = next((name for test, name in _SPECIAL if test(st.st_mode)), "not a regular file")
    raise InspectError(f"{p}: {what}, not a file or folder; inspect reads artifact files (Parquet, JSON, safetensors) and folders")


def inspect(path: str | Path, rows: int = 5) -> dict[str, Any]:
    """Everything `python -m pipeline.inspect` prints, as a dict."""
    p = Path(path)
    check_path(p)
    root = find_root(p)
    stages = load_lock(root)
    if p.is_dir():
        info = inspect_dir(p, root, stages)
    else:
        with open(p, "rb") as f:
            magic = f.read(4)
        if p.suffix == ".parquet" or magic == PARQUET_MAGIC:
            info = inspect_parquet(p, rows)
        elif p.suffix == ".json":
            info = inspect_json(p)
        elif p.suffix == ".safetensors":
            info = inspect_safetensors(p)
        else:
            raise InspectError(f"{p}: not a Parquet, JSON or safetensors artifact")
        info["bytes"] = p.stat().st_size
    info["path"] = str(p)
    info["lineage"] = lineage(p, root, stages)
    return info


# ---- text output ---------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    cells = [[str(k) for k in keys]] + [[_cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    return ["  " + "  ".join(c[i].ljust(widths[i]) for i in range(len(keys))) for c in cells]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(clip(json.dumps(v) if isinstance(v, list | dict) else v, 60))


def render(info: dict[str, Any]) -> str:
    """The human-readable report of `inspect()`."""
    out = [f"{info['path']}  ({info['kind']})"]
    if info["kind"] == "directory":
        out.append(f"{info['files']} files, {info['total_bytes']:,} bytes")
        out += _table(info["entries"], ["path", "bytes", "stage"])
        if "truncated" in info:
            out.append(f"  … {info['truncated']}")
    elif info["kind"] == "parquet":
        out.append(f"{info['rows']:,} rows, {info['bytes']:,} bytes; {json.dumps(info['parquet'])}")
        out.append("schema:")
        out += [f"  {f['name']}: {f['type']}{'' if f['nullable'] else ' not null'}" for f in info["schema"]]
        out.append("file metadata:")
        out += [f"  {k}: {v if isinstance(v, str) else _cell(v)}" for k, v in info["metadata"].items()] or ["  (none)"]
        out.append(f"first {len(info['head'])} rows:")
        if info["head"]:
            out += _table(info["head"], list(info["head"][0]))
        out.append("columns:")
        for name, st in info["columns"].items():
            rest = ", ".join(f"{k} {_cell(v)}" for k, v in st.items() if k != "type")
            out.append(f"  {name} ({st['type']}): {rest}")
        if "group_accuracy" in info:
            out.append("per-group accuracy (pred == y):")
            out += _table(info["group_accuracy"], ["split", "group", "y", "a", "n", "acc"])
    elif info["kind"] == "json":
        out.append(f"{info['bytes']:,} bytes")
        for k in ("keys", "scalars", "records", "fields"):
            if k in info:
                out.append(f"{k}: {_cell(info[k]) if not isinstance(info[k], dict) else json.dumps(info[k])[:MAX_TEXT * 2]}")
    elif info["kind"] == "safetensors":
        out.append(f"{info['bytes']:,} bytes, {info['n_tensors']} tensors; metadata: {json.dumps(info['metadata'])[:MAX_TEXT * 2]}")
        out += [f"  {k}: {v['dtype']} {v['shape']}" for k, v in list(info["tensors"].items())[:MAX_ENTRIES] if isinstance(v, dict)]
    lin = info.get("lineage")
    if lin:
        state = {True: "matches dvc.lock", False: "DIFFERS from dvc.lock (stale or edited)"}.get(lin.get("matches_lock"), "")
        out.append(f"lineage: written by stage '{lin['stage']}' (output {lin['output']}{', ' + state if state else ''})")
        out.append(f"  cmd: {lin['cmd']}")
        out += [f"  param {k}: {_cell(v)}" for k, v in lin["params"].items()]
        out += [f"  dep {d['path']}  md5 {d['md5']}" for d in lin["deps"] if isinstance(d, dict)]
    elif info["kind"] != "directory":
        out.append("lineage: not an output recorded in dvc.lock")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from stages.core.console import ArgumentParser, count_of  # a usage error is one line too

    parser = ArgumentParser(name="inspect", prog="python -m pipeline.inspect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rows", type=count_of("rows", least=0), default=5, help="first rows to show (default 5)")
    args = parser.parse_args(argv)
    try:
        info = inspect(args.path, min(args.rows, 100))
    except InspectError as e:
        print(f"inspect: error: {printable(str(e).splitlines()[0][:MAX_TEXT * 2] if str(e) else type(e).__name__)}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(info, indent=2, default=str) if args.json else printable(render(info)))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush would raise again
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
