"""Odd inputs a careless user gives: each ends in one clear line (exit 2 where it is a refusal) and loses nothing.

- a NaN in a prepared file's `x` is refused the same way by every stage that reads prepared
  rows (pretrain, train, distill, evaluate), before any output is touched;
- images in every Pillow mode become the right 8-bit pixels (16-bit greyscale scaled over its
  full range), or are refused naming the file and the mode;
- `pipeline.inspect` on a FIFO, a socket, a device, a symlink loop or JSON nested 100,000 deep;
- NaN and ±inf in any float key of any schema: one rule, one wording;
- a sweep grid with an unknown key, an empty list or a bad value is refused before any point starts;
  so is a `pipeline.flows --override` that does not compose, before its Prefect server starts.

docs/reliability.md lists the same cases.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import math
import os
import shutil
import socket
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages import distill, evaluate, pretrain, train
from stages.core.artifacts import model_dir, prepared_path, prepared_schema, pretrained_dir
from stages.core.io import numpy_to_fixed_list, write_parquet
from tests.support import project_env

REPO = Path(__file__).resolve().parents[1]
DS = "gaussian_shortcut"
P = prepared_path(DS)
FAST = ["method.erm.epochs=2", "method.erm.hidden=[8]"]
PRETRAIN_FAST = ["pretrain.epochs=2", "pretrain.hidden=[8]"]
META = {"dataset": DS, "kind": DS, "n_classes": 2, "n_attrs": 2, "shape": [4], "rho_train": 0.9, "rho_ood": 0.1, "params": {}}
COUNTS = {"train": (90, 10, 10, 90), "val": (45, 5, 5, 45), "test_id": (45, 5, 5, 45), "test_ood": (5, 45, 45, 5)}


def env() -> dict[str, str]:
    return {**project_env(), "PYTHONPATH": str(REPO)}


def one_line(err: str) -> str:
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].strip(), err[-3000:]
    assert "Traceback" not in err
    return lines[0]


def refused_before_prefect(module: str, args: list[str], cwd: Path, limit: float = 240) -> str:
    """`python -m <module> <args>` in `cwd`: exit 2 with one line on stderr (returned), nothing on
    stdout, no Prefect server started, within `limit` seconds (a hang guard, not a timing), every file under `cwd` as it was."""
    def files() -> dict[str, bytes]:
        return {p.relative_to(cwd).as_posix(): p.read_bytes() for p in sorted(cwd.rglob("*")) if p.is_file()}

    before = files()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env(), text=True, capture_output=True,
                          timeout=limit)  # a hang guard, not a timing
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    assert proc.stdout == "" and "prefect" not in proc.stderr.lower()  # no flow run, no Prefect server
    assert files() == before
    return line


def hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "data").rglob("*")) if p.is_file()}


# ---- 1. a NaN in x: every reader of prepared rows refuses it the same way -----------------------


def write_prepared(bad: tuple[int, float] | None = None) -> None:
    """The prepared file (500 rows, 4 features); `bad` = (row, value) puts a value into that row's x."""
    rng = np.random.default_rng(0)
    split, g = [], []
    for s, counts in COUNTS.items():
        for group, n in enumerate(counts):
            split += [s] * n
            g += [group] * n
    g_arr = np.asarray(g, dtype=np.int64)
    y, a = g_arr // 2, g_arr % 2
    x = np.column_stack([2 * y - 1 + rng.standard_normal(len(g)), 2 * a - 1 + 0.2 * rng.standard_normal(len(g)),
                         rng.standard_normal((len(g), 2))]).astype(np.float32)
    if bad is not None:
        x[bad[0], 2] = bad[1]
    table = pa.table({"id": np.arange(len(g), dtype=np.int64), "split": split, "y": y, "a": a, "g": g_arr,
                      "x": numpy_to_fixed_list(x)})
    write_parquet(table, P, prepared_schema(4), META)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A workspace with a prepared file, the pretrain stage's outputs and a trained erm model."""
    root = tmp_path_factory.mktemp("nan")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        shutil.copy(REPO / "params.yaml", "params.yaml")
        write_prepared()
        assert pretrain.main([DS, *PRETRAIN_FAST]) == 0
        assert train.main([DS, "erm", "0", *FAST]) == 0
    finally:
        os.chdir(cwd)
    return root


READERS = {
    "pretrain": (pretrain.main, [DS, *PRETRAIN_FAST]),
    "train": (train.main, [DS, "erm", "0", *FAST]),
    "distill": (distill.main, [DS, "erm", "0"]),
    "evaluate": (evaluate.main, [DS, "erm", "0"]),
}


@pytest.mark.parametrize("stage", list(READERS))
def test_a_nan_in_x_is_refused_by_every_reader_before_any_output_is_touched(stage, trained, tmp_path, monkeypatch, capsys):
    work = tmp_path / "w"
    shutil.copytree(trained, work)
    monkeypatch.chdir(work)
    write_prepared(bad=(7, np.nan))
    encoder_and_embeddings = sorted((work / pretrained_dir(DS)).iterdir())
    assert [p.name for p in encoder_and_embeddings] == ["embeddings.parquet", "encoder.safetensors"]
    before = hashes(work)
    capsys.readouterr()

    main, args = READERS[stage]
    assert main(args) == 2

    out, err = capsys.readouterr()
    # the same words from every stage: the file, the column, the first bad row and its id
    assert one_line(err) == f"{stage}: error: {P}: column 'x' has NaN or inf values in 1 row(s), first at row 7 (id 7)"
    assert not out
    assert hashes(work) == before  # the previous encoder, embeddings, model: the same bytes
    assert not (work / model_dir(DS, "erm_student", 0)).exists()


def test_pretrain_by_hand_refuses_an_inf_as_one_line_from_the_command_line(trained, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(trained, work)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        write_prepared(bad=(123, -np.inf))
    finally:
        os.chdir(cwd)
    before = hashes(work)
    proc = subprocess.run([sys.executable, "-m", "stages.pretrain", DS, *PRETRAIN_FAST], cwd=work, env=env(),
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line(proc.stderr) == f"pretrain: error: {P}: column 'x' has NaN or inf values in 1 row(s), first at row 123 (id 123)"
    assert proc.stdout == ""
    assert hashes(work) == before


# ---- 2. images in every Pillow mode ----------------------------------------------------------------

RES = 8
# linspace(0, 65535, 8): a 16-bit gradient; 8-bit is round(v * 255 / 65535) = round(v / 257)
GRADIENT16 = np.linspace(0, 65535, RES).round().astype(np.uint16)
GRADIENT8 = [0, 36, 73, 109, 146, 182, 219, 255]


def encode(im, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def gradient_image(mode: str):
    """A RES x RES image whose columns hold GRADIENT16, stored in `mode`."""
    from PIL import Image

    rows = np.tile(GRADIENT16, (RES, 1))
    if mode == "I;16":
        return Image.fromarray(rows)
    if mode == "I;16B":
        return Image.frombytes("I;16B", (RES, RES), rows.astype(">u2").tobytes())
    assert mode == "I"
    return Image.fromarray(rows.astype(np.int32))


@pytest.mark.parametrize(("mode", "fmt"), [("I;16", "PNG"), ("I;16B", "TIFF"), ("I", "TIFF")])
def test_16_bit_greyscale_is_scaled_over_its_full_range(mode, fmt):
    from PIL import Image

    from stages.datasets.images import decode_image

    data = encode(gradient_image(mode), fmt)
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == mode
    chw = decode_image(data, RES).reshape(3, RES, RES)
    assert chw.tolist() == [[GRADIENT8] * RES] * 3  # not 0 then 255 everywhere (Pillow's own convert clips)


def test_every_other_pillow_mode_gives_its_8_bit_rgb():
    from PIL import Image

    from stages.datasets.images import decode_image

    def pixel(im, fmt: str = "PNG") -> list[int]:
        return decode_image(encode(im, fmt), 4)[:: 16].tolist()  # R, G, B of pixel (0, 0), CHW

    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    assert pixel(palette) == [200, 100, 50]
    assert pixel(Image.new("RGBA", (4, 4), (10, 20, 30, 0))) == [10, 20, 30]  # alpha dropped, colour kept
    assert pixel(Image.new("LA", (4, 4), (77, 128))) == [77, 77, 77]
    assert pixel(Image.new("L", (4, 4), 5)) == [5, 5, 5]
    assert pixel(Image.new("1", (4, 4), 1)) == [255, 255, 255]
    assert pixel(Image.new("CMYK", (4, 4), (0, 0, 0, 0)), "JPEG") == [255, 255, 255]
    assert pixel(Image.new("RGB", (4, 4), (1, 2, 3)), "TIFF") == [1, 2, 3]


@pytest.mark.parametrize(("array", "names"), [
    (np.full((RES, RES), 0.5, np.float32), ("pixel mode 'F' (32-bit float)", "8- or 16-bit")),
    (np.full((RES, RES), 70000, np.int32), ("pixel mode 'I' (32-bit integer)", "[70000, 70000]", "[0, 65535]")),
])
def test_a_mode_with_no_8_bit_meaning_is_refused(array, names):
    from PIL import Image

    from stages.datasets.images import PixelModeError, decode_image

    with pytest.raises(PixelModeError) as e:
        decode_image(encode(Image.fromarray(array), "TIFF"), RES)
    assert all(n in str(e.value) for n in names), str(e.value)


WB = Path("data/raw/waterbirds")
WB_COUNTS = {0: (6, 3, 3, 6), 1: (2, 2, 2, 2), 2: (2, 2, 2, 2)}


def waterbirds_folder(root: Path, image: typing.Callable[[int], tuple[str, bytes]]) -> list[str]:
    """metadata.csv in the public format and image(i) -> (file name, bytes) for every row i (1-based)."""
    rows, names, i = [], [], 0
    for split, counts in WB_COUNTS.items():
        for g, n in enumerate(counts):
            y, place = divmod(g, 2)
            for _ in range(n):
                i += 1
                name, data = image(i)
                (root / WB / name).parent.mkdir(parents=True, exist_ok=True)
                (root / WB / name).write_bytes(data)
                rows.append([i, name, y, split, place, f"/b/bamboo_forest/{i:08d}.jpg"])
                names.append(name)
    with open(root / WB / "metadata.csv", "w", newline="") as f:
        csv.writer(f).writerows([["img_id", "img_filename", "y", "split", "place", "place_filename"], *rows])
    return names


WB_ARGS = ["waterbirds", f"dataset.waterbirds.resolution={RES}", "dataset.waterbirds.workers=1"]


def test_a_waterbirds_folder_of_16_bit_pngs_prepares_to_the_right_pixels(tmp_path, monkeypatch):
    from stages import prepare
    from stages.core.artifacts import read_prepared

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    png = encode(gradient_image("I;16"))
    waterbirds_folder(tmp_path, lambda i: (f"birds/{i:04d}.png", png))
    assert prepare.main(WB_ARGS) == 0
    p = read_prepared(prepared_path("waterbirds"))
    want = np.asarray([[GRADIENT8] * RES] * 3, dtype=np.float32).reshape(-1) / np.float32(255)
    assert np.array_equal(p.x, np.tile(want, (len(p.id), 1)))
    assert (p.x == 1.0).mean() == pytest.approx(1 / RES)  # one column of eight is white, not 98 %


def test_an_image_in_an_unsupported_mode_is_one_line_naming_file_and_mode(tmp_path):
    from PIL import Image

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    good = encode(Image.new("RGB", (RES, RES), (9, 9, 9)))
    waterbirds_folder(tmp_path, lambda i: (f"birds/{i:04d}.png", good))
    assert subprocess.run([sys.executable, "-m", "stages.prepare", *WB_ARGS], cwd=tmp_path, env=env(),
                          capture_output=True, timeout=300).returncode == 0
    floats = encode(Image.fromarray(np.full((RES, RES), 0.5, np.float32)), "TIFF")
    names = waterbirds_folder(tmp_path, lambda i: (f"birds/{i:04d}.tif", floats) if i == 5 else (f"birds/{i:04d}.png", good))
    before = hashes(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "stages.prepare", *WB_ARGS], cwd=tmp_path, env=env(),
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc.stderr)
    for name in (f"prepare: error: {WB / names[4]}: ", "pixel mode 'F'", "row 5 of the metadata CSV", "on_bad_image=skip"):
        assert name in line, line
    assert hashes(tmp_path) == before  # the prepared file from the run before keeps its bytes


# ---- 3. inspect: never opens what is not a file, never recurses without bound ------------------


def inspect_cli(path: str | Path, cwd: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """The real command; a hang fails the test at the timeout instead of hanging the suite."""
    return subprocess.run([sys.executable, "-m", "pipeline.inspect", str(path), *more], cwd=cwd, env=env(),
                          text=True, capture_output=True, timeout=60)


def test_inspect_refuses_a_fifo_a_socket_and_a_device_without_reading_them(tmp_path):
    os.mkfifo(tmp_path / "pipe.parquet")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.json"))
    try:
        for path, what in ((tmp_path / "pipe.parquet", "a FIFO (named pipe)"), (tmp_path / "sock.json", "a socket"),
                           (Path("/dev/zero"), "a character device")):
            for more in ((), ("--json",)):
                proc = inspect_cli(path, tmp_path, *more)
                assert proc.returncode == 2, proc.stderr[-2000:]
                assert one_line(proc.stderr) == (f"inspect: error: {path}: {what}, not a file or folder; inspect reads "
                                                 "artifact files (Parquet, JSON, safetensors) and folders")
                assert proc.stdout == ""
    finally:
        sock.close()


def test_inspect_names_a_symlink_loop_and_a_dangling_symlink(tmp_path):
    (tmp_path / "a.parquet").symlink_to("b.parquet")
    (tmp_path / "b.parquet").symlink_to("a.parquet")
    (tmp_path / "gone.json").symlink_to("nowhere.json")
    proc = inspect_cli("a.parquet", tmp_path)
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "inspect: error: a.parquet: a symlink loop (too many levels of symbolic links); nothing to inspect"
    proc = inspect_cli("gone.json", tmp_path)
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "inspect: error: gone.json: a symlink to 'nowhere.json', which does not exist"
    proc = inspect_cli("missing.json", tmp_path)
    assert one_line(proc.stderr) == "inspect: error: missing.json: no such file or directory"


def test_inspect_json_nested_100000_levels_is_one_line_and_900_levels_is_shown_cut(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    proc = inspect_cli("deep.json", tmp_path)
    assert proc.returncode == 2
    assert one_line(proc.stderr).startswith("inspect: error: deep.json: JSON nested too deeply to read")
    # parseable but deeper than the printer recursed: shown, nesting cut at MAX_DEPTH
    (tmp_path / "deep.json").write_text("[" * 900 + "]" * 900)
    (tmp_path / "deep.safetensors").write_bytes(len(h := b'{"t":' + b"[" * 100_000 + b"]" * 100_000 + b"}").to_bytes(8, "little") + h)
    for more in ((), ("--json",)):
        proc = inspect_cli("deep.json", tmp_path, *more)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
        assert len(proc.stdout) < 5000
    assert "nested deeper than 20 levels" in inspect_cli("deep.json", tmp_path, "--json").stdout
    proc = inspect_cli("deep.safetensors", tmp_path)
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "inspect: error: deep.safetensors: not a valid safetensors file (its JSON header is nested too deeply to read)"


def test_inspect_of_a_folder_skips_fifos_and_loops_inside_it(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "m.json").write_text("{}")
    os.mkfifo(tmp_path / "d" / "pipe.json")
    (tmp_path / "d" / "loop").symlink_to("loop")
    proc = inspect_cli("d", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "m.json" in proc.stdout and "pipe.json" not in proc.stdout and "1 files" in proc.stdout


# ---- 4. NaN and ±inf in a float key: one rule, one wording ----------------------------------------


@pytest.mark.parametrize(("value", "shown"), [("nan", "nan"), (".nan", "nan"), ("NaN", "nan"), ("inf", "inf"),
                                              ("-inf", "-inf"), ("1e999", "inf"), ("-0.001", "-0.001"), ("0", "0.0")])
def test_a_learning_rate_that_is_not_a_finite_positive_number_has_one_wording(value, shown, monkeypatch, capsys, tmp_path):
    from stages.core import config
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "params.yaml", "params.yaml")
    assert config.main(["check", f"method.erm.lr={value}"]) == 2
    assert one_line(capsys.readouterr().err) == f"config: error: params.yaml: method.erm.lr: must be a finite number > 0, got {shown}"
    assert config.main(["check", f"method.erm.weight_decay={value.replace('0.001', '1')}"]) == (0 if shown == "0.0" else 2)
    err = capsys.readouterr().err
    if shown != "0.0":
        assert one_line(err) == f"config: error: params.yaml: method.erm.weight_decay: must be a finite number >= 0, got {shown.replace('0.001', '1.0')}"


def test_nan_through_composition_and_a_hand_run_stage_reads_the_same(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    compose = subprocess.run([sys.executable, "-m", "stages.core.config", "compose", "method.erm.lr=nan"], cwd=tmp_path, env=env(),
                             text=True, capture_output=True, timeout=300)
    assert compose.returncode == 2
    assert "method.erm.lr: must be a finite number > 0, got nan" in one_line(compose.stderr)
    assert (tmp_path / "params.yaml").read_bytes() == (REPO / "params.yaml").read_bytes()
    stage = subprocess.run([sys.executable, "-m", "stages.train", DS, "erm", "0", "method.erm.lr=-inf"], cwd=tmp_path, env=env(),
                           text=True, capture_output=True, timeout=300)
    assert stage.returncode == 2
    assert one_line(stage.stderr) == "train: error: params.yaml: method.erm.lr: must be a finite number > 0, got -inf"


def float_keys() -> list[tuple[str, str, type, bool]]:
    """(section, key, the section's schema, is a list) of every float key of every section of params.yaml."""
    from omegaconf import OmegaConf

    from stages.core import registry
    from stages.core.config import STAGE_SECTIONS, load_params

    params = load_params(REPO / "params.yaml")
    sections = list(STAGE_SECTIONS.items())
    for top, spec in (("dataset", registry.dataset), ("method", registry.method)):
        sections += [(f"{top}.{n}", spec(OmegaConf.select(params, f"{top}.{n}.kind")).schema) for n in OmegaConf.select(params, top)]
    keys = []
    for name, schema in sections:
        hints = typing.get_type_hints(schema)
        keys += [(name, f.name, schema, hints[f.name] is not float) for f in dataclasses.fields(schema)
                 if hints[f.name] in (float, list[float])]
    return keys


def test_no_float_key_of_any_schema_accepts_nan_or_inf():
    from omegaconf import OmegaConf

    from stages.core.config import load_params, validate
    from stages.core.schema import ConfigError

    params = load_params(REPO / "params.yaml")
    keys = float_keys()
    assert len(keys) > 50 and ("method.erm", "lr") in {k[:2] for k in keys} and ("phase", "l2_lines") in {k[:2] for k in keys}
    for name, key, schema, is_list in keys:
        for v in (math.nan, math.inf, -math.inf):
            node = OmegaConf.create(OmegaConf.to_container(OmegaConf.select(params, name)))
            node[key] = [v] if is_list else v
            with pytest.raises(ConfigError) as e:
                validate(node, name, schema)
            line = one_line(str(e.value))
            assert line.startswith(f"params.yaml: {name}.{key}: ") and str(v).lstrip("-") in line, line
    # and a float list inside a list of sections (the phase diagram's panels)
    from stages.core.settings import PhaseConfig

    node = OmegaConf.create(OmegaConf.to_container(OmegaConf.select(params, "phase")))
    node["panels"] = [{"x": "sigma", "x_values": [1.0, math.inf], "y": "rho_train", "y_values": [0.5]}]
    with pytest.raises(ConfigError, match=r"^params.yaml: phase.panels\[0\].x_values: must hold finite numbers, got \[1.0, inf\]$"):
        validate(node, "phase", PhaseConfig)


def test_a_check_that_bounds_one_side_only_still_refuses_inf():
    from stages.core.schema import Checks, check

    @dataclasses.dataclass
    class Knobs:
        scale: float
        values: list[float]

        def check(self, c: Checks) -> None:
            c.require(self.scale >= 1, "scale", f"must be >= 1, got {self.scale}")

    assert check(Knobs(math.inf, [1.0])) == [("scale", "must be a finite number, got inf")]
    assert check(Knobs(2.0, [1.0, -math.inf])) == [("values", "must hold finite numbers, got [1.0, -inf]")]
    assert check(Knobs(math.nan, [])) == [("scale", "must be >= 1, got nan")]  # its own check refused it: named once


# ---- 5. sweep: the grid is checked before any point starts ---------------------------------------


@pytest.fixture(scope="module")
def sweep_project(tmp_path_factory) -> Path:
    """The shape preflight checks (conf/ and .dvc/); it is never run as a DVC project."""
    root = tmp_path_factory.mktemp("sweep-project")
    shutil.copytree(REPO / "conf", root / "conf")
    (root / ".dvc").mkdir()
    return root


@pytest.mark.parametrize(("grid", "override", "names"), [
    (["method.erm.lrr=0.1,0.2"], [], ("--grid method.erm.lrr=0.1,0.2: ", "Could not override 'method.erm.lrr'")),
    (["method.erm.lr=0.1,0.2", "run.seeds=[0],[]"], [], ("--grid run.seeds=[0],[]: run.seeds: must not be empty",)),
    (["method.erm.lr=0.1,nan"], ["experiment=tiny"], ("--grid method.erm.lr=0.1,nan: method.erm.lr: must be a finite number > 0, got nan",)),
    (["method.erm.lr=0.1"], ["method.erm.epochs=ten"], ("--override method.erm.epochs=ten: method.erm.epochs:", "'ten'")),
], ids=["unknown-key", "empty-list", "bad-value", "bad-override"])
def test_a_bad_grid_is_one_line_before_any_point_starts(grid, override, names, sweep_project):
    args = [a for g in grid for a in ("--grid", g)] + [a for o in override for a in ("--override", o)]
    line = refused_before_prefect("pipeline.sweep", ["--name", "odd", *args], sweep_project)
    assert line.startswith("sweep: error: ") and line.endswith("; no point was started"), line
    for name in names:
        assert name in line, line


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("args", "expected"), [
    (["--workers", "0"], "sweep: error: argument --workers: expected a whole number of processes >= 1, got '0'; usage: "),
    (["--dask-address", "nonsense"], "sweep: error: --dask-address nonsense: not a Dask scheduler address (missing port number in address 'nonsense')"),
    (["--dask-address", "tcp://127.0.0.1:{port}"], "sweep: error: --dask-address tcp://127.0.0.1:{port}: no Dask scheduler answers there (Connection refused)"),
], ids=["zero-workers", "malformed-address", "nothing-listening"])
def test_sweep_workers_and_dask_address_are_one_line_before_prefect_starts(args, expected, sweep_project):
    """Before: `--workers 0` ran on one process; a malformed address failed inside the flow run (63
    lines), an address nothing listens on after Dask's 30 s connect timeout (70 lines)."""
    port = closed_port()
    args, expected = [a.format(port=port) for a in args], expected.format(port=port)
    # within 20 s: not after Dask's 30 s connect timeout
    line = refused_before_prefect("pipeline.sweep", ["--grid", "method.lda.shrinkage=0.1", *args], sweep_project)
    assert line.startswith(expected), line


def test_a_sweep_deployment_run_with_zero_workers_is_refused_not_run_on_one():
    from prefect.task_runners import ProcessPoolTaskRunner

    from pipeline.flows import Refused
    from pipeline.sweep import task_runner

    with pytest.raises(Refused, match="workers must be at least 1, got 0"):
        task_runner(0, None)
    assert isinstance(task_runner(1, None), ProcessPoolTaskRunner)


def test_value_sets_check_every_value_once_with_the_other_axes_at_their_first():
    from pipeline.sweep import value_sets

    axes = [("a", ["1", "2", "3"]), ("b", ["x", "y"])]
    assert value_sets(axes) == [
        (None, ["a=1", "b=x"]),
        ("a=1,2,3", ["a=2", "b=x"]),
        ("a=1,2,3", ["a=3", "b=x"]),
        ("b=x,y", ["a=1", "b=y"]),
    ]


@pytest.mark.parametrize(("override", "names"), [
    (["method.erm.lrr=0.1"], ("--override method.erm.lrr=0.1: Could not override 'method.erm.lrr'",)),
    (["experiment=tiny", "run.seeds=[]"], ("--override experiment=tiny run.seeds=[]: run.seeds: must not be empty",)),
    (["method.erm.lr=inf"], ("method.erm.lr: must be a finite number > 0, got inf",)),
], ids=["unknown-key", "empty-list", "bad-value"])
def test_a_flow_override_that_does_not_compose_is_one_line_before_prefect_starts(override, names, tmp_path):
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")  # what the flow's preflight looks for first
    (tmp_path / "params.yaml").write_text("the params as they were\n")
    line = refused_before_prefect("pipeline.flows", [a for o in override for a in ("--override", o)], tmp_path)
    assert line.startswith("pipeline: error: --override ") and line.endswith("; no stage ran, params.yaml is as it was"), line
    for name in names:
        assert name in line, line
