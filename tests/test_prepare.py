"""Stage `prepare`: the prepared-data contract, determinism, sampling, cue forms, errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stages.core import artifacts, io, registry
from stages.core.artifacts import SPLITS
from stages.core.config import defaults
from stages.datasets import agreement_counts, colored_digits, gaussian_shortcut
from stages.prepare import main, prepare

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    f"dataset.gaussian_shortcut.{k}={n}"
    for k, n in (("n_train", 200), ("n_val", 100), ("n_test_id", 100), ("n_test_ood", 100))
]
SMALL_GAUSS = defaults("dataset", "gaussian_shortcut", n_train=200, n_val=100, n_test_id=100, n_test_ood=100)
META_KEYS = {
    "dataset",
    "kind",
    "n_classes",
    "n_attrs",
    "shape",
    "rho_train",
    "rho_ood",
    "params",
    "split_sizes",
}


def _write(dataset: str, cfg: object, path: Path) -> bytes:
    table, meta = prepare(dataset, cfg)
    dim = int(np.prod(meta["shape"]))
    io.write_parquet(table, path, artifacts.prepared_schema(dim), meta)
    return path.read_bytes()


def _check_contract(path: Path, dataset: str, shape: list[int]) -> artifacts.Prepared:
    dim = int(np.prod(shape))
    io.read_parquet(path, artifacts.prepared_schema(dim))  # exact column types
    p = artifacts.read_prepared(path)
    assert set(p.meta) >= META_KEYS
    assert p.meta["dataset"] == dataset and p.meta["kind"] == dataset
    assert p.shape == shape and p.x.shape == (len(p.id), dim) and p.x.dtype == np.float32
    assert p.n_classes == 2 and p.n_attrs == 2
    assert np.array_equal(p.g, p.y * p.n_attrs + p.a)
    assert len(np.unique(p.id)) == len(p.id)
    assert set(p.split) == set(SPLITS)
    assert p.meta["split_sizes"] == {s: int(p.mask(s).sum()) for s in SPLITS}
    for s in ("val", "test_id", "test_ood"):
        assert set(p.g[p.mask(s)]) == {0, 1, 2, 3}, s
    return p


def test_gaussian_end_to_end_writes_the_contract(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gaussian_shortcut", *SMALL, "--params", "params.yaml"]) == 0
    out = capsys.readouterr().out
    assert (
        "wrote data/prepared/gaussian_shortcut.parquet: 500 rows (train 200, val 100, test_id 100, test_ood 100)"
        in out
    )
    p = _check_contract(
        workdir / "data/prepared/gaussian_shortcut.parquet", "gaussian_shortcut", [10]
    )
    assert p.meta["params"]["n_train"] == 200 and p.meta["params"]["spurious_scale"] == 1.0
    assert set(p.y) == {0, 1}


def test_colored_digits_end_to_end_writes_the_contract(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["colored_digits", "--params", "params.yaml"]) == 0
    assert "1797 rows" in capsys.readouterr().out
    p = _check_contract(
        workdir / "data/prepared/colored_digits.parquet", "colored_digits", [3, 8, 8]
    )
    assert p.meta["layout"] == "CHW"
    assert sorted(p.id.tolist()) == list(range(1797))
    assert p.x.min() >= 0.0 and p.x.max() <= 1.0
    # ids are load_digits indices: the label follows the digit at that index
    from sklearn.datasets import load_digits

    assert np.array_equal(p.y, (load_digits().target[p.id] < 5).astype(np.int64))
    for s in ("val", "test_id", "test_ood"):
        assert np.bincount(p.g[p.mask(s)]).min() >= 2, s


@pytest.mark.parametrize(
    ("dataset", "cfg"),
    [("gaussian_shortcut", SMALL_GAUSS), ("colored_digits", defaults("dataset", "colored_digits"))],
)
def test_same_seed_gives_identical_bytes_and_another_seed_does_not(
    dataset: str, cfg: object, tmp_path: Path
) -> None:
    first = _write(dataset, cfg, tmp_path / "a.parquet")
    again = _write(dataset, cfg, tmp_path / "b.parquet")
    other = _write(dataset, dataclasses.replace(cfg, seed=1), tmp_path / "c.parquet")
    assert first == again
    assert first != other


def test_gaussian_splits_are_independent_of_other_split_sizes() -> None:
    small, _ = gaussian_shortcut.generate(SMALL_GAUSS)
    bigger, _ = gaussian_shortcut.generate(dataclasses.replace(SMALL_GAUSS, n_train=300))
    assert np.array_equal(
        small["x"][small["split"] == "val"], bigger["x"][bigger["split"] == "val"]
    )


@pytest.mark.parametrize("kind", ["gaussian_shortcut", "colored_digits"])
def test_observed_agreement_matches_rho(kind: str) -> None:
    cfg = defaults("dataset", kind, rho_train=0.9, rho_ood=0.2)
    cols, _ = registry.dataset(kind).generate(cfg)
    agree = cols["y"] == cols["a"]
    for split, rho in (("train", 0.9), ("val", 0.9), ("test_id", 0.9), ("test_ood", 0.2)):
        assert abs(agree[cols["split"] == split].mean() - rho) < 0.02, split


def test_agreement_counts_keep_every_group_at_extreme_rho() -> None:
    assert agreement_counts(100, 0.95) == (95, 5)
    assert agreement_counts(100, 0.999) == (98, 2)
    assert agreement_counts(100, 0.001) == (2, 98)
    assert agreement_counts(3, 0.99) == (2, 1)
    assert agreement_counts(100, 1.0) == (100, 0)
    assert agreement_counts(100, 0.0) == (0, 100)


def test_gaussian_sample_matches_population_moments() -> None:
    cfg = defaults("dataset", "gaussian_shortcut", n_train=40000, rho_train=0.8)
    cols, _ = gaussian_shortcut.generate(cfg)
    train = cols["split"] == "train"
    x, y = cols["x"][train].astype(np.float64), cols["y"][train]
    means, cov, priors = gaussian_shortcut.population_lda(cfg)
    assert np.allclose(priors, [0.5, 0.5])
    for c in (0, 1):
        assert np.allclose(x[y == c].mean(0), means[c], atol=0.05)
    within = np.mean([np.cov(x[y == c], rowvar=False) for c in (0, 1)], axis=0)
    assert np.allclose(within, cov, atol=0.06)
    groups = gaussian_shortcut.population_groups(cfg)
    assert sum(g.prob for g in groups) == pytest.approx(1.0)
    for g in groups:
        rows = x[(y == g.y) & (cols["a"][train] == g.a)]
        assert len(rows) / len(x) == pytest.approx(g.prob, abs=0.01)
        assert np.allclose(rows.mean(0), g.mean, atol=0.1)


def test_colored_digits_test_repeats_copy_test_images_with_fresh_cues_and_leave_train_alone() -> None:
    once, _ = colored_digits.generate(defaults("dataset", "colored_digits"))
    cfg = defaults("dataset", "colored_digits", test_repeats=4)
    many, meta = colored_digits.generate(cfg)
    n_images = len(colored_digits.load_images()[1])
    for split in ("train", "val"):  # untouched: same rows, same bytes
        a, b = once["split"] == split, many["split"] == split
        for col in ("id", "y", "a", "x"):
            assert np.array_equal(once[col][a], many[col][b]), (split, col)
    for split in ("test_id", "test_ood"):
        a, b = once["split"] == split, many["split"] == split
        ids = many["id"][b]
        image = ids % n_images
        # every image of the split, 4 times (ids r·1797 + image), with its label
        assert meta["split_sizes"][split] == 4 * a.sum()
        assert sorted(np.unique(image)) == sorted(once["id"][a])
        assert np.bincount(image).max() == 4 and set(ids // n_images) == {0, 1, 2, 3}
        assert np.array_equal(many["y"][b], (colored_digits.load_images()[1][image] < 5).astype(np.int64))
        # the copies of one image differ: their cue noise (and often their attribute) is drawn afresh
        x = many["x"][b]
        first = np.flatnonzero(image == image[0])
        assert len({x[i].tobytes() for i in first}) == 4
        for y in (0, 1):
            in_class = many["y"][b] == y
            # the attribute still follows the split's rho over the copies, exactly
            n = int(in_class.sum())
            rho = cfg.rho_ood if split == "test_ood" else cfg.rho_train
            assert int((many["a"][b][in_class] == y).sum()) == agreement_counts(n, rho)[0]
            # the small group holds distinct images (assigned round by round)
            for a_value in (0, 1):
                group = in_class & (many["a"][b] == a_value)
                if group.sum() <= len(np.unique(image[in_class])):
                    assert len(np.unique(image[group])) == group.sum(), (split, y, a_value)


@pytest.mark.parametrize("form", ["color", "marker", "background"])
def test_each_cue_form_changes_the_same_digit(form: str) -> None:
    images, _ = colored_digits.load_images()
    pair = np.repeat(images[:1], 2, axis=0)
    out = colored_digits.render(pair, np.array([0, 1]), form, 0.0, np.random.default_rng(0))
    assert out.shape == (2, 3, 8, 8)
    diff = np.abs(out[0] - out[1])
    assert diff.max() > 0.1
    if form == "marker":  # only the two marker pixels differ
        assert set(zip(*np.nonzero(diff.max(0)), strict=True)) == {(0, 0), (7, 0)}
    if form == "background":  # red and green carry the plain digit
        assert diff[:2].max() == 0.0 and np.array_equal(out[0, 0], images[0])


def test_bad_config_value_exits_2_naming_the_key(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "gaussian_shortcut",
                "dataset.gaussian_shortcut.rho_train=1.5",
                "--params",
                "params.yaml",
            ]
        )
        == 2
    )
    assert "dataset.gaussian_shortcut.rho_train" in capsys.readouterr().err
    assert not (workdir / "data/prepared/gaussian_shortcut.parquet").exists()


def test_missing_group_exits_2_naming_split_and_group(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "gaussian_shortcut",
                *SMALL,
                "dataset.gaussian_shortcut.rho_train=1.0",
                "--params",
                "params.yaml",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "split 'train'" in err and "g=1 (y=0, a=1)" in err  # train is checked first, then val, test_id, test_ood
    assert not (workdir / "data/prepared/gaussian_shortcut.parquet").exists()


def test_unknown_dataset_exits_2(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope", "--params", "params.yaml"]) == 2
    assert "dataset.nope" in capsys.readouterr().err


def test_help_lists_params(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for key in ("rho_train", "rho_ood", "spurious_noise", "d_noise", "val_frac", "spurious:"):
        assert key in out


def test_table_fits_schema_exactly() -> None:
    table, meta = prepare("gaussian_shortcut", SMALL_GAUSS)
    assert table.schema.field("x").type == pa.list_(pa.float32(), 10)
    assert table.column_names == ["id", "split", "y", "a", "g", "x"]
    assert meta["dataset"] == "gaussian_shortcut"
