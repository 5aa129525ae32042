"""Real-benchmark loaders on tiny fixtures in each release's exact public format.

Each fixture is written by the test itself (a few generated images and CSV rows), run through
`stages.prepare` and `stages.validate`, and checked against the contract and the split/group
mapping documented in docs/datasets.md; every bad-input case has a test.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from stages.core import artifacts, io
from stages.core.artifacts import SPLITS
from stages.datasets import camelyon17, raw, waterbirds
from stages.prepare import main as prepare_main
from stages.validate import build_checks, meta_params, rows_frame, split_stats_frame
from stages.validate import main as validate_main

REPO = Path(__file__).resolve().parents[1]
RES = 8
FAST = [f"dataset.{d}.resolution={RES}" for d in ("waterbirds", "celeba", "camelyon17")] + [
    f"dataset.{d}.workers=1" for d in ("waterbirds", "celeba", "camelyon17")
]
CELEBA_ATTRS = ["5_o_Clock_Shadow", "Arched_Eyebrows", "Attractive", "Bags_Under_Eyes", "Bald", "Bangs", "Big_Lips", "Big_Nose", "Black_Hair", "Blond_Hair", "Blurry", "Brown_Hair", "Bushy_Eyebrows", "Chubby", "Double_Chin", "Eyeglasses", "Goatee", "Gray_Hair", "Heavy_Makeup", "High_Cheekbones", "Male", "Mouth_Slightly_Open", "Mustache", "Narrow_Eyes", "No_Beard", "Oval_Face", "Pale_Skin", "Pointy_Nose", "Receding_Hairline", "Rosy_Cheeks", "Sideburns", "Smiling", "Straight_Hair", "Wavy_Hair", "Wearing_Earrings", "Wearing_Hat", "Wearing_Lipstick", "Wearing_Necklace", "Wearing_Necktie", "Young"]
CIVIL_HEADER = ["id", "comment_text", "split", "toxicity", "severe_toxicity", "obscene", "sexual_explicit", "identity_attack", "insult", "threat", "male", "female", "transgender", "other_gender", "heterosexual", "homosexual_gay_or_lesbian", "bisexual", "other_sexual_orientation", "LGBTQ", "christian", "jewish", "muslim", "hindu", "buddhist", "atheist", "other_religion", "other_religions", "black", "white", "asian", "latino", "other_race_or_ethnicity", "physical_disability", "intellectual_or_learning_disability", "psychiatric_or_mental_illness", "other_disability", "identity_any"]


# ---- fixtures in the public formats --------------------------------------------------------------


def _image(path: Path, seed: int, size: tuple[int, int] = (20, 14), fmt: str = "JPEG") -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, fmt)


def _write_csv(path: Path, header: list[str], rows: list[list[object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


# (official split, y, place) -> count; every group present in every official split.
WATERBIRDS_COUNTS = {0: (6, 3, 3, 6), 1: (2, 2, 2, 2), 2: (2, 2, 2, 2)}


def make_waterbirds(root: Path) -> None:
    """metadata.csv (img_id, img_filename, y, split, place, place_filename) + one JPEG per row."""
    rows, i = [], 0
    for split, counts in WATERBIRDS_COUNTS.items():
        for g, n in enumerate(counts):
            y, place = divmod(g, 2)
            for _ in range(n):
                i += 1
                species = "001.Black_footed_Albatross" if y else "002.Laysan_Albatross"
                name = f"{species}/Bird_{i:04d}_{100 + i}.jpg"
                _image(root / name, i)
                rows.append([i, name, y, split, place, f"/b/bamboo_forest/{i:08d}.jpg"])
    _write_csv(root / "metadata.csv", ["img_id", "img_filename", "y", "split", "place", "place_filename"], rows)


# (partition, blond, male) counts
CELEBA_COUNTS = {0: (8, 6, 4, 2), 1: (2, 2, 2, 2), 2: (4, 4, 4, 4)}


def make_celeba(root: Path) -> None:
    """list_attr_celeba.csv (image_id + 40 attributes in -1/1), list_eval_partition.csv, and the
    JPEGs in img_align_celeba/img_align_celeba/ (as the Kaggle zip unpacks)."""
    attrs, parts, i = [], [], 0
    rng = np.random.default_rng(0)
    for partition, counts in CELEBA_COUNTS.items():
        for g, n in enumerate(counts):
            blond, male = divmod(g, 2)
            for _ in range(n):
                i += 1
                name = f"{i:06d}.jpg"
                _image(root / "img_align_celeba" / "img_align_celeba" / name, i, (18, 22))
                values = {a: int(rng.choice([-1, 1])) for a in CELEBA_ATTRS}
                values.update(Blond_Hair=2 * blond - 1, Male=2 * male - 1)
                attrs.append([name, *(values[a] for a in CELEBA_ATTRS)])
                parts.append([name, partition])
    _write_csv(root / "list_attr_celeba.csv", ["image_id", *CELEBA_ATTRS], attrs)
    _write_csv(root / "list_eval_partition.csv", ["image_id", "partition"], parts)


# center -> (split value per row, tumor values); hospitals 0/3/4 train, 1 OOD val, 2 test.
def make_camelyon17(root: Path) -> None:
    """metadata.csv (unnamed index, patient, node, x_coord, y_coord, tumor, slide, center, split)
    + PNG patches under patches/patient_XXX_node_N/."""
    rows, i = [], 0
    for center in range(5):
        for tumor in (0, 1):
            for split in (0, 0, 0, 0, 1, 1):
                patient, node, x, y = 10 * center + tumor, split, 100 + i, 200 + i
                _image(root / camelyon17.patch_path(patient, node, x, y), i, (12, 12), "PNG")
                rows.append([i, patient, node, x, y, tumor, 2 * center + node, center, split])
                i += 1
    _write_csv(root / "metadata.csv", ["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"], rows)


CIVIL_TEXTS = ("you are great", "what a stupid idea", "thanks, this helps", 'he said "no",\nthen left')


def make_civilcomments(root: Path) -> None:
    """all_data_with_identities.csv with WILDS' columns; some identity scores empty (not annotated)."""
    rows, i = [], 0
    for split, n in (("train", 5), ("val", 2), ("test", 6)):
        for g in range(4):
            toxic, ident = divmod(g, 2)
            for k in range(n):
                values = dict.fromkeys(CIVIL_HEADER, "")
                values.update(id=1000 + i, comment_text=f"{CIVIL_TEXTS[(i + k) % 4]} number {i}", split=split)
                values["toxicity"] = 0.8 if toxic else 0.1
                values["muslim" if k % 2 else "female"] = 0.9 if ident else 0.0
                if ident == 0 and k % 3 == 0:
                    values["female"] = ""  # not annotated: reads as 0
                rows.append([values[c] for c in CIVIL_HEADER])
                i += 1
    _write_csv(root / "all_data_with_identities.csv", CIVIL_HEADER, rows)


MAKERS = {
    "waterbirds": make_waterbirds,
    "celeba": make_celeba,
    "camelyon17": make_camelyon17,
    "civilcomments": make_civilcomments,
}


def prepare(dataset: str, *overrides: str) -> int:
    return prepare_main([dataset, *FAST, *overrides, "--params", "params.yaml"])


def raw_dir(dataset: str) -> Path:
    root = Path("data/raw") / dataset
    MAKERS[dataset](root)
    return root


# ---- happy paths: contract and mapping ----------------------------------------------------------


def _contract(dataset: str) -> artifacts.Prepared:
    path = artifacts.prepared_path(dataset)
    p = artifacts.read_prepared(path)
    assert np.array_equal(p.g, p.y * p.n_attrs + p.a)
    assert len(np.unique(p.id)) == len(p.id)
    assert set(p.split) == set(SPLITS)
    order = [SPLITS.index(s) for s in p.split]
    assert order == sorted(order)  # rows ordered by split
    assert p.meta["split_sizes"] == {s: int(p.mask(s).sum()) for s in SPLITS}
    assert p.meta["dataset"] == dataset and p.meta["kind"] == dataset
    # the regime, estimated as the rows streamed past, is the in-memory estimate on the train
    # rows (images area-averaged to 3×8×8; a fixture's groups are far below the sampling cap)
    from stages.evaluation.regime import KEYS, estimate_separation, pool_pixels

    train = p.subset("train")
    features = pool_pixels(train.x, p.shape[-1]) if p.meta.get("layout") == "CHW" else train.x
    want = estimate_separation(features, train.y, train.a, p.n_attrs)
    got = p.meta["separation"]
    assert set(got) == set(KEYS) and p.meta["separation_source"].startswith("train_sample")
    for k in ("cue", "core"):
        assert (got[k] is None and want[k] is None) or got[k] == pytest.approx(want[k], abs=2e-4), (k, got, want)
    return p


def test_waterbirds_maps_splits_and_groups_and_validates(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = raw_dir("waterbirds")
    assert prepare("waterbirds") == 0
    p = _contract("waterbirds")
    assert p.shape == [3, RES, RES] and p.x.shape == (len(p.id), 3 * RES * RES)
    assert p.x.dtype == np.float32 and p.x.min() >= 0 and p.x.max() <= 1
    assert p.meta["x_dtype"] == "uint8" and p.meta["layout"] == "CHW"
    table = pq.read_table(artifacts.prepared_path("waterbirds"))
    assert table.schema.field("x").type.value_type == "uint8" and table.schema.field("x").type.list_size == 3 * RES * RES
    meta_csv = np.genfromtxt(root / "metadata.csv", delimiter=",", skip_header=1, dtype=str)
    official = {int(r[0]) - 1: int(r[3]) for r in meta_csv}  # id = row index
    for i, s in zip(p.id, p.split, strict=True):
        want = {0: ("train", "test_id"), 1: ("val",), 2: ("test_ood",)}[official[int(i)]]
        assert s in want
    # test_id: a seeded 10% of each train group (at least one)
    assert [int((p.g[p.mask("test_id")] == g).sum()) for g in range(4)] == [1, 1, 1, 1]
    files = table.column("file").to_pylist()
    assert files[0].endswith(".jpg") and (root / files[0]).is_file()
    # pixels are the resized image, CHW
    from stages.datasets.images import decode_image

    first = decode_image((root / files[0]).read_bytes(), RES)
    assert np.allclose(p.x[0], first / 255.0)
    import hashlib

    assert p.meta["raw_checksums"]["metadata.csv"] == hashlib.sha256((root / "metadata.csv").read_bytes()).hexdigest()
    assert len(p.meta["raw_checksums"]["images"]["sha256"]) == 64 and p.meta["raw_checksums"]["images"]["n_files"] == len(p.id)
    assert p.meta["published_counts"] is None  # a 34-image fixture is not the full release
    assert validate_main(["waterbirds", "validate.min_group_count=1", "--params", "params.yaml"]) == 0
    assert "expectations passed" in capsys.readouterr().out


def test_output_does_not_depend_on_worker_count(workdir: Path) -> None:
    raw_dir("waterbirds")
    assert prepare("waterbirds", "dataset.waterbirds.workers=1") == 0
    one = artifacts.prepared_path("waterbirds").read_bytes()
    assert prepare("waterbirds", "dataset.waterbirds.workers=2") == 0
    assert artifacts.prepared_path("waterbirds").read_bytes() == one


def test_celeba_balanced_test_ood_and_nested_image_folder(workdir: Path) -> None:
    raw_dir("celeba")
    assert prepare("celeba") == 0
    p = _contract("celeba")
    assert p.shape == [3, RES, RES]
    counts = {s: [int((p.g[p.mask(s)] == g).sum()) for g in range(4)] for s in SPLITS}
    assert counts["train"] == list(CELEBA_COUNTS[0]) and counts["val"] == list(CELEBA_COUNTS[1])
    assert counts["test_id"] == [2, 2, 2, 2]  # (1 - test_ood_frac) of each group of official test
    assert counts["test_ood"] == [2, 2, 2, 2]  # group-balanced
    assert p.meta["classes"] == ["not Blond_Hair", "Blond_Hair"]


def test_celeba_target_and_attribute_are_configurable(workdir: Path) -> None:
    raw_dir("celeba")
    assert prepare("celeba", "dataset.celeba.target=Male", "dataset.celeba.attribute=Blond_Hair") == 0
    p = _contract("celeba")
    train = p.subset("train")
    # y and a swap roles relative to the default
    assert [int(((train.a == b) & (train.y == m)).sum()) for b in (0, 1) for m in (0, 1)] == list(CELEBA_COUNTS[0])


def test_camelyon17_holds_out_hospitals(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw_dir("camelyon17")
    assert prepare("camelyon17") == 0
    p = _contract("camelyon17")
    assert p.n_attrs == 5
    assert set(p.a[p.mask("test_ood")]) == {2}
    for s in ("train", "val", "test_id"):
        assert set(p.a[p.mask(s)]) == {0, 3, 4}, s
    assert 1 not in set(p.a)  # WILDS' OOD validation hospital is unused by default
    assert p.meta["split_groups"]["test_ood"] == [2, 7]
    assert validate_main(["camelyon17", "validate.min_group_count=1", "--params", "params.yaml"]) == 0
    capsys.readouterr()


def test_civilcomments_text_and_identity_attribute(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw_dir("civilcomments")
    assert prepare("civilcomments", "dataset.civilcomments.identities=[female,muslim]") == 0
    p = _contract("civilcomments")
    assert p.meta["text"] is True and p.text is not None
    assert any("\n" in t for t in p.text)  # multi-line comments survive
    assert p.x.shape == (len(p.id), len(p.meta["vocab"]))
    counts = {s: [int((p.g[p.mask(s)] == g).sum()) for g in range(4)] for s in SPLITS}
    assert counts["train"] == [5] * 4 and counts["test_id"] == [3] * 4 and counts["test_ood"] == [3] * 4
    table = pq.read_table(artifacts.prepared_path("civilcomments"))
    assert table.schema.field("text").type == "string"
    assert validate_main(["civilcomments", "validate.min_group_count=1", "--params", "params.yaml"]) == 0
    capsys.readouterr()


# ---- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", list(MAKERS))
def test_missing_raw_folder_says_where_to_get_it(dataset: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare(dataset) == 2
    err = capsys.readouterr().err
    assert f"data/raw/{dataset}: raw data folder for '{dataset}' not found" in err
    assert "Download it from" in err and f"dvc add data/raw/{dataset}" in err
    assert not artifacts.prepared_path(dataset).exists()


@pytest.mark.parametrize(
    ("dataset", "file", "column"),
    [
        ("waterbirds", "metadata.csv", "place"),
        ("celeba", "list_attr_celeba.csv", "Blond_Hair"),
        ("camelyon17", "metadata.csv", "center"),
        ("civilcomments", "all_data_with_identities.csv", "toxicity"),
    ],
)
def test_missing_column_names_file_and_column(
    dataset: str, file: str, column: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = raw_dir(dataset)
    path = root / file
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    drop = rows[0].index(column)
    _write_csv(path, [c for j, c in enumerate(rows[0]) if j != drop], [[v for j, v in enumerate(r) if j != drop] for r in rows[1:]])
    assert prepare(dataset) == 2
    err = capsys.readouterr().err
    assert f"{path}: missing column(s) ['{column}']" in err


@pytest.mark.parametrize(
    ("dataset", "file", "column", "value"),
    [
        ("waterbirds", "metadata.csv", "y", "2"),
        ("waterbirds", "metadata.csv", "split", "test"),
        ("celeba", "list_attr_celeba.csv", "Male", "0"),
        ("camelyon17", "metadata.csv", "tumor", "-1"),
        ("civilcomments", "all_data_with_identities.csv", "toxicity", "1.5"),
        ("civilcomments", "all_data_with_identities.csv", "toxicity", ""),  # a missing label was read as class 0
        ("civilcomments", "all_data_with_identities.csv", "toxicity", "NaN"),
    ],
)
def test_label_outside_its_domain_names_the_row(
    dataset: str, file: str, column: str, value: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = raw_dir(dataset)
    path = root / file
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows[3][rows[0].index(column)] = value
    _write_csv(path, rows[0], rows[1:])
    assert prepare(dataset) == 2
    err = capsys.readouterr().err
    shown = "empty" if value in ("", "NaN") else value  # the CSV reader's nulls
    assert f"{path}: row 3 (line 4): column '{column}' is" in err and shown in err


@pytest.mark.parametrize(
    ("dataset", "file", "changes", "same"),
    [
        ("waterbirds", "metadata.csv", {"img_id": "999", "split": "2"}, "img_filename"),  # another id, the test split
        ("celeba", "list_eval_partition.csv", {"partition": "2"}, "image_id"),
        ("celeba", "list_attr_celeba.csv", {}, "image_id"),
        ("camelyon17", "metadata.csv", {"": "999", "split": "1"}, "patch file"),
        ("civilcomments", "all_data_with_identities.csv", {"split": "test"}, "id"),
    ],
)
def test_a_source_listed_twice_is_an_error_naming_both_rows(
    dataset: str, file: str, changes: dict[str, str], same: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One example in two rows (here: row 1 appended again, possibly with another split) would put
    # the same image or comment in train and a test split.
    root = raw_dir(dataset)
    path = root / file
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    copy = list(rows[1])
    for column, value in changes.items():
        copy[rows[0].index(column)] = value
    _write_csv(path, rows[0], [*rows[1:], copy])
    assert prepare(dataset) == 2
    err = capsys.readouterr().err
    n = len(rows)  # the appended copy is data row n
    assert f"{path}: rows 1 and {n} (lines 2 and {n + 1}) have the same {same} " in err, err
    assert "repeat an earlier one" in err and err.count("\n") == 1
    if changes.get("split") or changes.get("partition"):
        assert "one source in two splits" in err
    assert not artifacts.prepared_path(dataset).exists()


def test_a_raw_train_split_without_a_group_names_the_file_split_and_group(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = raw_dir("waterbirds")
    path = root / "metadata.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    # every official-train waterbird on land (y=1, place=0) leaves train and test_id without group 2
    kept = [r for r in rows[1:] if not (r[header.index("split")] == "0" and r[header.index("y")] == "1" and r[header.index("place")] == "0")]
    _write_csv(path, header, kept)
    assert prepare("waterbirds") == 2
    err = capsys.readouterr().err
    assert f"{path}: split 'train' has no example of group g=2 (y=1, a=0)" in err, err


def test_undecodable_image_is_an_error_naming_file_and_row(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = raw_dir("waterbirds")
    bad = sorted(root.rglob("*.jpg"))[5]
    bad.write_bytes(b"not a jpeg at all")
    assert prepare("waterbirds") == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "cannot decode the image" in err and "of the metadata CSV" in err
    assert "on_bad_image=skip" in err
    assert not artifacts.prepared_path("waterbirds").exists()


def test_missing_image_file_is_an_error(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = raw_dir("camelyon17")
    victim = sorted(root.rglob("*.png"))[0]
    victim.unlink()
    assert prepare("camelyon17") == 2
    assert f"{victim}: cannot read the file" in capsys.readouterr().err


def test_skip_mode_counts_bad_images_into_the_validation_report(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = raw_dir("waterbirds")
    bad = sorted((root / "002.Laysan_Albatross").glob("*.jpg"))[0]  # a landbird of official train
    bad.write_bytes(b"\xff\xd8\xff truncated")
    assert prepare("waterbirds", "dataset.waterbirds.on_bad_image=skip") == 0
    out = capsys.readouterr().out
    assert "1 unreadable image(s) skipped" in out
    p = _contract("waterbirds")
    assert p.meta["n_skipped"] == 1 and p.meta["skipped_files"] == [bad.relative_to(root).as_posix()]
    assert len(p.id) == sum(map(sum, WATERBIRDS_COUNTS.values())) - 1
    assert validate_main(["waterbirds", "validate.min_group_count=1", "--params", "params.yaml"]) == 0
    assert "1 unreadable raw image(s) were skipped" in capsys.readouterr().out
    report = io.read_json(artifacts.validated_path("waterbirds"))
    assert report["metadata"]["n_skipped"] == 1


def test_published_counts_are_checked_when_the_release_is_complete(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw_dir("waterbirds")
    # Pretend the fixture is the full release: same total, the fixture's own counts.
    monkeypatch.setattr(waterbirds, "PUBLISHED", {k: list(v) for k, v in zip(("train", "val", "test"), WATERBIRDS_COUNTS.values(), strict=True)})
    assert prepare("waterbirds") == 0
    meta = io.read_metadata(artifacts.prepared_path("waterbirds"))
    assert meta["published_counts"]["observed"] == meta["published_counts"]["expected"]
    table = io.read_parquet(artifacts.prepared_path("waterbirds"))
    params = meta_params(meta, "x")
    rows = rows_frame(table, 2)
    stats = split_stats_frame(rows, 4, None, params["published_counts"])
    assert stats["published_mismatch"].iloc[0] == 0
    assert "published_counts" in [c.name for c in build_checks(params, _validate_cfg())]
    # A release whose counts differ from the published ones (same total) fails that check.
    wrong = dict(params["published_counts"], expected={"train": [18, 0, 0, 0], "val": [8, 0, 0, 0], "test": [8, 0, 0, 0]})
    assert split_stats_frame(rows, 4, None, wrong)["published_mismatch"].iloc[0] == 3


def _validate_cfg():  # noqa: ANN202
    from stages.core.config import load_params, section
    from stages.core.settings import ValidateConfig

    return section(load_params(), "validate", ValidateConfig)  # the workdir's params.yaml


def test_published_counts_of_each_release_add_up_to_its_documented_totals() -> None:
    assert sum(map(sum, waterbirds.PUBLISHED.values())) == 11788
    assert [sum(v) for v in raw.CELEBA_PUBLISHED.values()] == [162770, 19867, 19962]
    assert sum(camelyon17.PUBLISHED["center"]) == 455954
    from stages.datasets import civilcomments

    assert sum(v[0] for v in civilcomments.PUBLISHED.values()) == 448000


# ---- the streaming writer -------------------------------------------------------------------------


def test_parquet_stream_writes_fixed_row_groups_metadata_and_nothing_on_failure(tmp_path: Path) -> None:
    import pyarrow as pa

    schema = pa.schema([pa.field("v", pa.int64(), nullable=False)])
    paths = []
    for batches in ([7, 3, 5], [1] * 15):  # same rows, batched differently
        path = tmp_path / f"s{len(paths)}.parquet"
        with io.write_parquet_stream(path, schema, row_group_size=4) as (stream, meta):
            start = 0
            for n in batches:
                stream.write(pa.table({"v": pa.array(range(start, start + n), type=pa.int64())}))
                start += n
            meta["learned_at_the_end"] = {"rows": stream.num_rows}
        paths.append(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    f = pq.ParquetFile(paths[0])
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [4, 4, 4, 3]
    assert io.read_metadata(paths[0])["learned_at_the_end"] == {"rows": 15}
    assert io.read_parquet(paths[0], schema).column("v").to_pylist() == list(range(15))
    failed = tmp_path / "failed.parquet"
    with pytest.raises(RuntimeError), io.write_parquet_stream(failed, schema) as (stream, _):
        stream.write(pa.table({"v": pa.array([1], type=pa.int64())}))
        raise RuntimeError("killed")
    assert not failed.exists() and list(tmp_path.glob(".failed*")) == []
