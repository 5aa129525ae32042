"""The validate stage's Data Docs open offline: every script, style and font is a local file.

GX writes pages that load jQuery, Bootstrap, bootstrap-table, Font Awesome, ... from CDNs;
stages/validation/data_docs.py copies them into the site. Checked statically (every reference resolves
to a file in the site) and in headless Chromium with the network blocked (the index's tables
are drawn, so the scripts ran; the icons' font loaded; nothing failed to load).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stages import validate as stage
from stages.core.artifacts import data_docs_dir
from stages.validation import data_docs
from tests.test_report_html import CHROMIUM_FLAGS, chromium
from tests.test_validate import PARAMS, make_columns, write_prepared

# Any host name fails to resolve and any proxied request goes to a closed loopback port.
NO_NETWORK = ["--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9"]
_ATTR = re.compile(r"<(?P<tag>[a-zA-Z]+)\b[^>]*?\b(?:src|href)\s*=\s*\"(?P<url>[^\"]*)\"")
_REMOTE = re.compile(r"^(?:https?:)?//", re.IGNORECASE)
_ROW_LINK = re.compile(r"'_table_row_link_path': '([^']*)'")
# After load: failed loads and script errors, the Font Awesome fonts' status, the libraries.
PROBE = """<script>
window.__errors = [];
window.addEventListener("error", e => window.__errors.push(String(e.message || (e.target && e.target.outerHTML))), true);
const origError = console.error;
console.error = (...a) => { window.__errors.push(a.join(" ")); origError(...a); };
window.addEventListener("load", () => setTimeout(() => {
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify({
    errors: window.__errors,
    fonts: [...document.fonts].filter(f => f.family.startsWith("Font Awesome")).map(f => f.status),
    libs: ["jQuery", "bootstrapTable", "datepicker", "tooltip"].filter(
      n => n === "jQuery" ? typeof window.jQuery === "function" : !!(window.jQuery && jQuery.fn[n])),
    rows: [...document.querySelectorAll("table.ge-index-page-validation-results-table tbody tr[data-index]")]
      .map(r => ({href: r.getAttribute("data-href"), text: r.textContent.replace(/\\s+/g, " ").trim()})),
  });
  document.body.appendChild(pre);
}, 200));
</script>"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Data Docs of one passing validation of a small generated dataset (as tests/test_validate.py)."""
    root = tmp_path_factory.mktemp("data_docs")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        (root / "params.yaml").write_text(PARAMS)
        write_prepared("toy", make_columns())
        assert stage.main(["toy"]) == 0
    return root / data_docs_dir("toy")


def pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


def validation_pages(site: Path) -> list[Path]:
    return sorted((site / "validations").rglob("*.html"))


def test_every_reference_in_the_site_is_a_local_file_that_exists(site: Path) -> None:
    assert len(validation_pages(site)) == 3  # one per frame: rows, split_stats, file
    referenced: set[Path] = set()
    for page in pages(site):
        text = page.read_text(encoding="utf-8")
        assert "integrity=" not in text and "crossorigin=" not in text, page  # refused for file:// copies
        refs = [(m.group("tag").lower(), m.group("url")) for m in _ATTR.finditer(text)]
        assert any(tag == "script" for tag, _ in refs) and any(tag == "link" for tag, _ in refs), page
        # the index's rows link to the result pages from its table's data, not from an href
        refs += [("row", url) for url in _ROW_LINK.findall(text)]
        for tag, url in refs:
            if _REMOTE.match(url):
                # only a link a person may follow (GX's home page, its newsletter) is remote
                assert tag == "a", (page.relative_to(site), tag, url)
                continue
            path = url.split("#")[0].split("?")[0]
            if not path:
                continue  # an anchor in the same page
            target = (page.parent / path).resolve()
            assert target.is_file() and target.is_relative_to(site.resolve()), (page.relative_to(site), tag, url)
            referenced.add(target)
    # every stylesheet's fonts resolve too, and static/vendor holds nothing no page loads
    vendor = site / data_docs.SITE_DIR
    for css in sorted(vendor.rglob("*.css")):
        for m in re.finditer(r"url\(\s*['\"]?([^'\")]+)", css.read_text(encoding="utf-8")):
            if not m.group(1).startswith("data:"):
                target = (css.parent / m.group(1)).resolve()
                assert target.is_file(), (css.relative_to(site), m.group(1))
                referenced.add(target)
    copied = {p.resolve() for p in vendor.rglob("*") if p.is_file()}
    assert copied and copied <= referenced, sorted(p.relative_to(site.resolve()) for p in copied - referenced)


def test_the_copies_are_the_packages_files_and_a_second_pass_changes_nothing(site: Path, tmp_path: Path) -> None:
    vendor = site / data_docs.SITE_DIR
    copied = sorted(p.relative_to(vendor).as_posix() for p in vendor.rglob("*") if p.is_file())
    assets = {a.dest: a for a in data_docs.CDN.values() if a is not None}
    assert set(assets) <= set(copied)  # every page loads all of them; the rest are Font Awesome's fonts
    assert all(p in assets or p.endswith(".woff2") for p in copied), copied
    for dest, asset in assets.items():
        # byte for byte, less a trailing source-map comment and Font Awesome's TrueType fallbacks
        source = re.sub(rb',url\(\.\./webfonts/[\w-]+\.ttf\) format\("truetype"\)', b"", asset.source().read_bytes())
        ours = (vendor / dest).read_bytes()
        assert ours == source or (b"sourceMappingURL=" in source and source.startswith(ours.rstrip(b"\n"))), dest
    # localizing the localized site again finds nothing to do (byte-reproducibility across runs:
    # tests/test_validate.py's rerun test hashes the whole docs folder)
    again = tmp_path / "site"
    shutil.copytree(site, again)
    assert data_docs.localize(again) == []
    for page in pages(site):
        assert (again / page.relative_to(site)).read_bytes() == page.read_bytes(), page


def test_a_page_that_loads_an_unknown_remote_file_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "index.html"
    for tag in ('<script src="https://cdn.example.org/new-lib.js"></script>',
                '<link rel="stylesheet" href="//cdn.example.org/new.css">',
                '<script src="https://cdn.jsdelivr.net/npm/vega@5"></script><script>vegaEmbed("#c", {})</script>'):
        page.write_text(f"<html><head>{tag}</head><body></body></html>")
        with pytest.raises(data_docs.RemoteAsset, match="not copied locally"):
            data_docs.localize(tmp_path)
    # Vega on a page that draws no chart: the tags go
    page.write_text('<html><head>\n<script src="https://cdn.jsdelivr.net/npm/vega@5"></script>\n</head></html>')
    assert data_docs.localize(tmp_path) == []
    assert page.read_text() == "<html><head>\n</head></html>"


def _open(page: Path, tmp: Path) -> dict:
    """`page` (a probed copy) in headless Chromium with no network: the probe's findings."""
    run = subprocess.run(
        [chromium("the Data Docs"), *CHROMIUM_FLAGS, *NO_NETWORK, f"--user-data-dir={tmp / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    match = re.search(r'<pre id="probe">(.*?)</pre>', run.stdout, re.S)
    assert match, run.stdout[-2000:]
    return json.loads(match.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


@pytest.mark.slow
@pytest.mark.xdist_group("chromium")
def test_the_index_lists_every_validation_run_in_chromium_with_the_network_blocked(site: Path, tmp_path: Path) -> None:
    chromium("the Data Docs")
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    results = [p.relative_to(copy).as_posix() for p in validation_pages(copy)]
    for page in [copy / "index.html", copy / results[0]]:
        page.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")

    index = _open(copy / "index.html", tmp_path)
    assert index["errors"] == []  # no script error, nothing that failed to load
    assert index["libs"] == ["jQuery", "bootstrapTable", "datepicker", "tooltip"]
    assert "loaded" in index["fonts"]  # the status icons' font
    # bootstrap-table drew one row per validation run, each linking to its result page
    assert sorted(r["href"] for r in index["rows"]) == results
    for row in index["rows"]:
        asset = row["href"].split("/")[2]
        assert f"toy.{asset}" in row["text"] and "validate-toy" in row["text"], row

    result = _open(copy / results[0], tmp_path)
    assert result["errors"] == []
    assert result["libs"] == ["jQuery", "bootstrapTable", "datepicker", "tooltip"]
    assert "loaded" in result["fonts"]
