"""Validating a timm backbone name without importing timm (stages/models/timm_catalog.py).

The cache lives in its own directory per test (XDG_CACHE_HOME). A check that finds it answers in
a fresh process — as DVC's process composing `experiment=waterbirds` or `make check` would — with
neither timm nor torch imported; a cache that is corrupt, of another timm install or in a
directory that cannot be made is never trusted, and the names are always timm's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm

from stages.models import timm_catalog
from tests.support import project_env

REPO = Path(__file__).resolve().parents[1]
TIMM_NAMES = sorted(set(timm.list_models()) | set(timm.list_models(pretrained=True)))

PROBE = """
import json, sys
from stages.models.timm_catalog import name_problem, timm_names
names = timm_names()
print(json.dumps({"names": sorted(names), "mlp": name_problem("mlp"), "resnet50": name_problem("resnet50"),
                  "imported": sorted(m for m in ("timm", "torch") if m in sys.modules)}))
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's cache directory, and the in-process memo of `timm_names` cleared around it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timm_catalog.timm_names.cache_clear()
    yield tmp_path
    timm_catalog.timm_names.cache_clear()


def cache_file(cache: Path) -> Path:
    (only,) = (cache / "shiftlab").iterdir()
    assert only.name.startswith(f"timm-names-{timm.__version__}-") and only.suffix == ".json"
    return only


def test_the_first_check_writes_the_cache_and_a_fresh_process_answers_from_it_without_timm_or_torch(cache: Path) -> None:
    assert timm_catalog.timm_names() == frozenset(TIMM_NAMES)
    stored = json.loads(cache_file(cache).read_text())
    assert stored["names"] == TIMM_NAMES
    assert stored["key"]["version"] == timm.__version__ and Path(stored["key"]["path"]) == Path(timm.__file__).parent

    env = {**project_env(), "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imported"] == []  # answered from the cache
    assert seen["names"] == TIMM_NAMES and seen["mlp"] is None and seen["resnet50"] is None


def test_a_name_timm_lacks_is_one_line_with_timms_close_matches(cache: Path) -> None:
    problem = timm_catalog.name_problem("resnet5O")
    assert problem is not None and "\n" not in problem
    assert problem.startswith("must be 'mlp' or a timm model name") and "got 'resnet5O'" in problem and "'resnet50'" in problem


@pytest.mark.parametrize("spoil", ["garbage", "binary", "other-install", "names-not-a-list"])
def test_a_spoiled_or_foreign_cache_is_rebuilt_from_timm(cache: Path, spoil: str) -> None:
    timm_catalog.timm_names()
    path = cache_file(cache)
    stored = json.loads(path.read_text())
    if spoil == "garbage":
        path.write_text("{not json")
    elif spoil == "binary":
        path.write_bytes(b"\xff\xfe\x00")
    elif spoil == "other-install":  # the same version installed elsewhere or changed since: not trusted
        path.write_text(json.dumps({**stored, "key": {**stored["key"], "mtime_ns": stored["key"]["mtime_ns"] + 1},
                                    "names": ["resnet5O"]}))
    else:
        path.write_text(json.dumps({**stored, "names": "resnet50"}))
    timm_catalog.timm_names.cache_clear()
    assert timm_catalog.timm_names() == frozenset(TIMM_NAMES)
    assert timm_catalog.name_problem("resnet5O") is not None
    assert json.loads(path.read_text()) == stored


def test_two_installs_of_the_same_version_keep_a_cache_each(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two venvs with the same timm (a fresh clone beside a checkout) would otherwise rebuild one
    shared file in turn, each undoing the other's."""
    timm_catalog.timm_names()
    here = cache_file(cache)
    key = timm_catalog.installed()
    assert key is not None
    monkeypatch.setattr(timm_catalog, "installed", lambda: {**key, "path": key["path"] + "-elsewhere"})
    timm_catalog.timm_names.cache_clear()
    assert timm_catalog.timm_names() == frozenset(TIMM_NAMES)
    files = sorted((cache / "shiftlab").iterdir())
    assert len(files) == 2 and here in files
    assert json.loads(here.read_text())["key"] == key


@pytest.mark.parametrize("where", ["a-file", "relative", "no-home"])
def test_a_cache_directory_that_cannot_be_made_or_found_costs_only_the_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """XDG_CACHE_HOME naming a file (no directory can be made under it, even by root); a relative
    XDG_CACHE_HOME, which must not write into the project (platformdirs ignores it, as the XDG spec
    says); a user with no home directory (a container's arbitrary uid, HOME unset: platformdirs
    raises). Each time timm itself answers and nothing is written."""
    monkeypatch.chdir(tmp_path)
    if where == "a-file":
        (tmp_path / "a-file").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    elif where == "relative":
        monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    else:
        import pwd

        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.delenv("HOME", raising=False)
        monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    timm_catalog.timm_names.cache_clear()
    try:
        assert timm_catalog.timm_names() == frozenset(TIMM_NAMES)
        assert timm_catalog.name_problem("resnet50") is None
    finally:
        timm_catalog.timm_names.cache_clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["a-file"] if where == "a-file" else [])
    if where == "a-file":
        assert (tmp_path / "a-file").read_text() == ""
