"""GX Data Docs that open offline: local copies of the scripts and styles its pages load.

Great Expectations 1.24 writes pages that load jQuery, Bootstrap (+ Popper), bootstrap-table
with its filter-control extension, bootstrap-datepicker, a dark-mode Bootstrap theme, Font
Awesome and Vega from CDNs; offline the index's tables (drawn by bootstrap-table) stay empty
and every page is unstyled, without its status icons. `localize(site)` copies the files the
pages reference into `<site>/static/vendor/` and points each `<script src>` and `<link href>`
at its copy by a relative path, so the site works opened from disk with no network.

Where the copies come from (requirements.in pins the packages; the pages ask for the version
in brackets, and each substitute is a later release of the same major version):

- jQuery 3.7.1: XStatic-jQuery (the same version);
- Bootstrap 4.5.3 [4.3.1] and Popper: XStatic-Bootstrap's bootstrap.bundle.min.js, which
  contains Popper, so the pages' separate Popper tag is dropped;
- bootstrap-datepicker 1.4.0 [1.9.0]: XStatic-Bootstrap-Datepicker (the filter of the index's
  run-time column);
- Font Awesome 6.6.0: fontawesomefree (the same version), its woff2 fonts only (every browser
  that runs these pages reads woff2; the TrueType fallbacks would add 700 kB);
- bootstrap-table 1.19.1 and @forevolve/bootstrap-dark 1.1.0: on npm only, so vendored in
  vendor/data_docs/ (its README names the package tarballs and their checksums).

Vega, Vega-Lite and vega-embed are loaded by every page but drawn only by the charts of
profiling and distribution expectations, which this project's suite has none of: a page that
never calls `vegaEmbed` loses those three tags; one that does is an error, as is any other
remote script or stylesheet, so a GX upgrade that adds one stops the stage instead of
writing a site that silently needs the network. The copies are the packages' files
byte for byte, less trailing source-map comments (no map ships) and Font Awesome's
TrueType fallbacks: the same packages give the same site, byte for byte.
"""

from __future__ import annotations

import importlib
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

VENDOR_DIR = Path(__file__).resolve().parents[2] / "vendor" / "data_docs"  # the npm-only files
SITE_DIR = "static/vendor"  # the copies' folder inside a docs site


@dataclass(frozen=True)
class Asset:
    """A local copy: `path` inside Python package `package` (None: inside VENDOR_DIR), copied to
    `dest` under the site's static/vendor/."""

    package: str | None
    path: str
    dest: str

    def source(self) -> Path:
        if self.package is None:
            return VENDOR_DIR / self.path
        module = importlib.import_module(self.package)
        return Path(module.__file__).parent / self.path  # type: ignore[arg-type]


_FA = "static/fontawesomefree/css/all.min.css"
_FILTER_CONTROL_CSS = Asset(
    None,
    "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.css",
    "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.css",
)

# Every URL GX 1.24's pages load a script or stylesheet from: its local copy, or None for a tag
# that goes (Popper: inside the Bootstrap bundle).
CDN: dict[str, Asset | None] = {
    "https://code.jquery.com/jquery-3.7.1.min.js": Asset(
        "xstatic.pkg.jquery", "data/jquery.min.js", "jquery/jquery.min.js"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": None,
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": Asset(
        "xstatic.pkg.bootstrap", "data/js/bootstrap.bundle.min.js", "bootstrap/js/bootstrap.bundle.min.js"
    ),
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": Asset(
        "xstatic.pkg.bootstrap", "data/css/bootstrap.min.css", "bootstrap/css/bootstrap.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js": Asset(
        None, "bootstrap-table/bootstrap-table.min.js", "bootstrap-table/bootstrap-table.min.js"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css": Asset(
        None, "bootstrap-table/bootstrap-table.min.css", "bootstrap-table/bootstrap-table.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/bootstrap-table-filter-control.min.js": Asset(
        None,
        "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.js",
        "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.js",
    ),
    # the pages ask for 1.19.0's stylesheet of the extension, minified or not: 1.19.1's, minified
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.min.css": _FILTER_CONTROL_CSS,
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.css": _FILTER_CONTROL_CSS,
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/bootstrap-datepicker.min.js": Asset(
        "xstatic.pkg.bootstrap_datepicker", "data/bootstrap-datepicker.js", "bootstrap-datepicker/bootstrap-datepicker.js"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/bootstrap-datepicker.min.css": Asset(
        "xstatic.pkg.bootstrap_datepicker", "data/datepicker.css", "bootstrap-datepicker/datepicker.css"
    ),
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css": Asset(
        None, "bootstrap-dark/bootstrap-prefers-dark.min.css", "bootstrap-dark/bootstrap-prefers-dark.min.css"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css": Asset(
        "fontawesomefree", _FA, "fontawesome/css/all.min.css"
    ),
}
VEGA = frozenset(
    {
        "https://cdn.jsdelivr.net/npm/vega@5",
        "https://cdn.jsdelivr.net/npm/vega-lite@5",
        "https://cdn.jsdelivr.net/npm/vega-embed@6",
    }
)
# GX's dark-mode stylesheet swaps the navbar logo for a remote white one: the local logo instead.
_DARK_LOGO = re.compile(r"url\('https://great-expectations-web-assets\.[^']*/full_logo_dark\.png'\)")
LOGO = "static/images/logo-long.png"

# A <script> or <link> tag (a script's closing tag and the line's end with it, so a dropped tag
# leaves no blank line) and the URL it loads.
_TAG = re.compile(r"<(?P<name>script|link)\b(?P<attrs>[^>]*)>(?P<close></script>)?(?P<eol>\n?)", re.IGNORECASE)
_URL_ATTR = re.compile(r'\b(?:src|href)\s*=\s*"(?P<url>[^"]*)"')
_SRC_ATTR = re.compile(r'\bsrc\s*=\s*"(?P<url>[^"]*)"')  # what an <img> or <iframe> loads
_SRI_ATTR = re.compile(r'\s+(?:integrity|crossorigin)\s*=\s*"[^"]*"')  # refused for file:// copies
_REMOTE = re.compile(r"^(?:https?:)?//", re.IGNORECASE)
_CSS_URL = re.compile(r"url\(\s*(?P<q>['\"]?)(?P<url>[^'\")]+)(?P=q)\s*\)")
_TRUETYPE = re.compile(r",\s*url\([^)]*\.ttf\)\s*format\([\"']truetype[\"']\)")
_SOURCE_MAP = re.compile(rb"\n?(?://# sourceMappingURL=[^\n]*|/\*# sourceMappingURL=[^*]*\*/)\s*$")


class RemoteAsset(ValueError):
    """A page loads a script or stylesheet this module has no local copy of."""


def localize(site: Path) -> list[str]:
    """Point every page of the Data Docs `site` at local copies of its scripts and styles, copied
    into `site`/static/vendor/; return the copied files' site-relative paths, sorted."""
    used: set[str] = set()
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        text = page.read_text(encoding="utf-8")
        new = _rewrite_page(text, page.relative_to(site).as_posix(), used, site)
        if new != text:
            page.write_text(new, encoding="utf-8")
    copied: dict[str, bytes] = {}
    by_dest = {a.dest: a for a in CDN.values() if a is not None}
    for dest in sorted(used):
        _collect(by_dest[dest].source(), dest, copied)
    for dest, data in sorted(copied.items()):
        target = site / SITE_DIR / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return [f"{SITE_DIR}/{d}" for d in sorted(copied)]


def _rewrite_page(text: str, rel: str, used: set[str], site: Path) -> str:
    """`text` of the page at site-relative `rel` with its remote tags pointed at (or dropped for)
    local copies; the copies' dest paths are added to `used`. A local `static/` file the page
    misses by its count of `../` (GX 1.24's favicon on validation result pages) is repointed."""
    up = posixpath.relpath(".", posixpath.dirname(rel) or ".")  # the site's root from the page
    uses_vega = "vegaEmbed(" in text

    def tag(m: re.Match[str]) -> str:
        url_m = _URL_ATTR.search(m.group("attrs"))
        if url_m is None:
            return m.group(0)
        url = url_m.group("url")
        if not _REMOTE.match(url):
            static = url.find("static/")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(rel), url))
            if static < 0 or (site / target).is_file() or not (site / url[static:]).is_file():
                return m.group(0)
            local = posixpath.normpath(posixpath.join(up, url[static:]))
            return m.group(0).replace(f'"{url}"', f'"{local}"', 1)
        if url in VEGA and not uses_vega:
            return ""
        if url in VEGA or url not in CDN:
            what = "draws a Vega chart, and Vega is" if url in VEGA else "loads a file"
            raise RemoteAsset(
                f"Data Docs page {rel} {what} not copied locally: {url}; add a local copy to "
                "stages/validation/data_docs.py's CDN table (from a pinned package or vendor/data_docs/)"
            )
        asset = CDN[url]
        if asset is None:
            return ""
        used.add(asset.dest)
        local = posixpath.normpath(posixpath.join(up, SITE_DIR, asset.dest))
        attrs = _SRI_ATTR.sub("", m.group("attrs")).replace(f'"{url}"', f'"{local}"')
        return f"<{m.group('name')}{attrs}>{m.group('close') or ''}{m.group('eol')}"

    text = _TAG.sub(tag, text)
    text = _DARK_LOGO.sub(f"url('{posixpath.normpath(posixpath.join(up, LOGO))}')", text)
    for m in (*_CSS_URL.finditer(text), *_SRC_ATTR.finditer(text)):
        if _REMOTE.match(m.group("url")):
            raise RemoteAsset(f"Data Docs page {rel} loads {m.group('url')}, not copied locally")
    return text


def _collect(source: Path, dest: str, copied: dict[str, bytes]) -> None:
    """Read `source` into `copied[dest]`, minus its source-map comment; for a stylesheet, minus
    TrueType font fallbacks and with every file it references (fonts) collected beside it."""
    if dest in copied:
        return
    if not source.is_file():
        raise FileNotFoundError(
            f"{source}: the Data Docs asset {dest} is missing; install the project's packages "
            "(pip install -r requirements.lock) or restore vendor/data_docs/"
        )
    data = _SOURCE_MAP.sub(b"\n", source.read_bytes()) if dest.endswith((".js", ".css")) else source.read_bytes()
    if dest.endswith(".css"):
        css = _TRUETYPE.sub("", data.decode("utf-8"))
        data = css.encode("utf-8")
        for m in _CSS_URL.finditer(css):
            url = m.group("url")
            if url.startswith(("data:", "#")):
                continue
            if _REMOTE.match(url):
                raise RemoteAsset(f"{source}: loads {url}, not copied locally")
            path = url.split("?")[0].split("#")[0]
            _collect(
                Path(os.path.normpath(source.parent / path)),
                posixpath.normpath(posixpath.join(posixpath.dirname(dest), path)),
                copied,
            )
    copied[dest] = data
