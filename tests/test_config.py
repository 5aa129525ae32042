"""The config loader: params.yaml in sync with conf/, and every bad value stops with its key named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.core import config, registry
from stages.core.config import ConfigError, check_all, load_params, method_config, section

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def params():
    return load_params(ROOT / "params.yaml")


def test_params_yaml_is_in_sync_with_conf(tmp_path, monkeypatch):
    # Compose conf/ exactly as `dvc exp run` does and compare with the committed file.
    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"
    config.compose(ROOT / "conf", out)
    assert out.read_text() == (ROOT / "params.yaml").read_text(), (
        "params.yaml is out of sync with conf/: run `make params` and commit it"
    )


def test_committed_params_are_valid(params):
    run = check_all(params)
    assert set(run.datasets) == {"gaussian_shortcut", "colored_digits"}
    assert {"erm", "lda", "groupdro"} <= set(run.methods)
    assert run.seeds == [0]


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes_to_a_valid_config(experiment, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "params.yaml"
    config.compose(ROOT / "conf", out, [f"experiment={experiment}"])
    check_all(load_params(out))


@pytest.mark.parametrize(
    ("override", "key", "reason"),
    [
        ("dataset.gaussian_shortcut.rho_train=1.5", "dataset.gaussian_shortcut.rho_train", "[0, 1]"),
        ("dataset.colored_digits.rho_ood=-0.1", "dataset.colored_digits.rho_ood", "[0, 1]"),
        ("method.erm.lr=-0.01", "method.erm.lr", "> 0"),
        ("method.erm.epochs=0", "method.erm.epochs", ">= 1"),
        ("method.erm.lr=fast", "method.erm.lr", "lr"),
        ("method.erm.selection=best", "method.erm.selection", "val_avg"),
        ("dataset.colored_digits.spurious=texture", "dataset.colored_digits.spurious", "color"),
        ("+method.erm.lrr=0.1", "method.erm.lrr", "lrr"),
        ("run.models=[erm,lda]", "run.models", "groupdro"),
        ("run.teachers=[svm]", "run.teachers", "svm"),
    ],
)
def test_bad_values_name_their_key(params, override, key, reason):
    cfg = load_params(ROOT / "params.yaml", [override])
    with pytest.raises(ConfigError) as err:
        check_all(cfg)
    msg = str(err.value)
    assert key in msg and reason in msg, msg


def test_unknown_override_key_is_rejected_with_the_way_to_a_key_that_exists():
    """The hint points at what params.yaml has (it said "prefix with +", which schema validation
    then refuses): the closest key where there is one, else the section's keys."""
    with pytest.raises(ConfigError, match=r"unknown key 'method.erm.lrr'; did you mean 'method.erm.lr'\?$"):
        load_params(ROOT / "params.yaml", ["method.erm.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"unknown key 'methd.erm.lr'; did you mean 'method.erm.lr'\?$"):
        load_params(ROOT / "params.yaml", ["methd.erm.lr=0.1"])
    with pytest.raises(ConfigError, match=r"\(the keys of method.erm: kind, init, .*\)$"):
        load_params(ROOT / "params.yaml", ["method.erm.zzzzzz=1"])
    with pytest.raises(ConfigError, match=r"'method.erm.lr' is a value, not a section$"):
        load_params(ROOT / "params.yaml", ["method.erm.lr.x=1"])


def test_unknown_method_names_known_ones(params):
    with pytest.raises(ConfigError, match=r"no section 'method.svm'.*erm"):
        method_config(params, "svm")


def test_section_returns_typed_dataclass(params):
    cfg = section(params, "method.erm", registry.method("erm").schema)
    assert isinstance(cfg, registry.method("erm").schema) and isinstance(cfg.lr, float) and cfg.hidden == [64]


def test_missing_params_file_says_how_to_make_it(tmp_path):
    with pytest.raises(ConfigError, match="make params"):
        load_params(tmp_path / "params.yaml")


def test_cli_check_exits_2_with_one_line(tmp_path, capsys):
    bad = yaml.safe_load((ROOT / "params.yaml").read_text())
    bad["method"]["groupdro"]["eta"] = 0
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(bad))
    assert config.main(["check", "--params", str(tmp_path / "params.yaml")]) == 2
    err = capsys.readouterr().err
    assert "method.groupdro.eta: must be a finite number > 0" in err and "Traceback" not in err


def test_describe_lists_every_key():
    params = load_params()
    schema = registry.dataset("gaussian_shortcut").schema
    text = config.describe_section(params, "dataset.gaussian_shortcut", schema)
    for name in ("rho_train", "rho_ood", "sigma", "spurious_scale", "d_noise", "n_train"):
        assert f"dataset.gaussian_shortcut.{name}" in text


KEYS = [
    "dataset.gaussian_shortcut.rho_train",
    "dataset.gaussian_shortcut.n_train",
    "dataset.colored_digits.spurious",
    "method.erm.lr",
    "method.erm.hidden",
    "method.lda.shrinkage",
    "pretrain.epochs",
    "distill.temperature",
    "run.seeds",
    "run.models",
    "no.such.key",
]
VALUES = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet="abc[],=.{}:' -01", max_size=8),
    st.sampled_from(["[]", "[0]", "[erm]", "null", "true", "1e-3", "color"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=3))
def test_random_overrides_give_a_valid_config_or_a_config_error(tmp_path, pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        check_all(load_params(ROOT / "params.yaml", overrides))
    except ConfigError as e:
        assert str(e).strip(), "a config error must say what is wrong"


def test_stage_copy_of_params_is_independent(tmp_path):
    # Guard for the other tests: they copy params.yaml; the loader must read the copy given.
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    cfg = load_params(tmp_path / "params.yaml", ["method.erm.lr=0.5"])
    assert cfg.method.erm.lr == 0.5
