"""The documentation (README.md and docs/*.md) names only things that exist, and is a reference,
not a diary.

Fast and static: the files are read as text; nothing runs make, DVC or a stage.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Where a path into the repository starts; data/ holds outputs, which need not exist.
PATH_PREFIXES = ("stages/", "pipeline/", "tests/", "benchmarks/", "docs/", "conf/", "hydra_plugins/", "vendor/")
TOP_LEVEL_FILES = {"dvc.yaml", "dvc.lock", "params.yaml", "Makefile", "requirements.lock", "requirements.in",
                   "prefect.yaml", "pyproject.toml", "README.md"}
PLACEHOLDERS = ("<", "*", "{", "…", "$", "...")
# `python -m` modules that are not the project's.
FOREIGN_MODULES = {"pytest", "pip", "prefect", "uvicorn", "venv", "dvc", "http", "json", "cProfile", "timeit"}
# Where the repository must not point: the files of the design brief outside it.
# the design document and the shared folder beside a checkout, which a clone does not have
OUTSIDE = re.compile("DESIGN" + r"\.md|\.\./" + "shared")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```[^\n]*\n.*?^```[^\n]*$", "", text, flags=re.M | re.S)


def code_spans(text: str) -> list[str]:
    """Inline code spans (`...`) of the prose; a span may wrap onto the next line."""
    return [m.group(1) for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", prose(text))]


def links(text: str) -> list[str]:
    """Targets of markdown links `[text](target)` in the prose."""
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


def declared_files(text: str) -> set[str]:
    """Files a document creates itself, each introduced as "File `<path>`:" (docs/extending.md's
    walk-through writes them; tests/test_extending.py follows it)."""
    return set(re.findall(r"^File `([^`]+)`:", text, flags=re.M))


def placeholder_name(token: str) -> bool:
    """A path whose file or folder name is one capital letter stands for any (`stages/models/K.py`
    for a method of kind `K`); no file of the repository is named so."""
    return any(re.fullmatch(r"[A-Z]", Path(part).stem) for part in token.split("/"))


def looks_like_repo_path(token: str) -> bool:
    return token.startswith(PATH_PREFIXES) or token in TOP_LEVEL_FILES


def named_paths(doc: Path) -> set[str]:
    """Repository paths named in the document's inline code spans and link targets."""
    text = doc.read_text()
    tokens: set[str] = set()
    for span in code_spans(text):
        tokens |= set(span.split())
    tokens |= {t.split("#")[0] for t in links(text)}
    found = set()
    for token in tokens:
        token = token.strip("()[],;:'\"").removesuffix(".")
        if token.startswith("./"):
            token = token[2:]
        if looks_like_repo_path(token) and not any(p in token for p in PLACEHOLDERS) and not placeholder_name(token):
            found.add(token.split("#")[0].split(":")[0])
    return found - declared_files(text)


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def make_commands(text: str) -> list[str]:
    """The targets of the `make <target>` commands a text names: in inline code
    (`make repro JOBS=1`, `SHIFTLAB_POOL_CONCURRENCY=N make serve`) and on the lines of fenced
    code blocks. Prose ("make the shortcut ...") is English, not a command."""
    command = r"(?:^|[\s;&|(`])make\s+([a-z][A-Za-z0-9_.-]*)"
    lines = code_spans(text) + [ln for block in fenced_blocks(text) for ln in block.splitlines()]
    return [m.group(1) for ln in lines for m in re.finditer(command, ln)]


def test_every_make_target_named_in_the_docs_exists():
    targets = make_targets()
    assert {"repro", "test"} <= targets, "the Makefile parse found no repro/test targets"
    assert make_commands("run `make repro JOBS=1`, then\n```bash\nmake test\n```\nto make the most of it") == ["repro", "test"]
    missing = []
    for doc in DOCS:
        for name in make_commands(doc.read_text()):
            if name not in targets:
                missing.append(f"{rel(doc)}: `make {name}`")
    assert not missing, "make targets the Makefile does not define:\n" + "\n".join(sorted(set(missing)))


def test_every_repository_path_named_in_the_docs_exists():
    """Paths in inline code and link targets that start with a source folder (stages/, pipeline/,
    tests/, benchmarks/, docs/, conf/, hydra_plugins/, vendor/) or are a top-level file; placeholders
    (`<`, `*`, `{`, `…`, a one-capital-letter name like `K.py`) and data/ (outputs) are not
    checked, nor the files a walk-through creates."""
    missing = [f"{rel(doc)}: {p}" for doc in DOCS for p in sorted(named_paths(doc)) if not (ROOT / p).exists()]
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def test_every_relative_link_resolves():
    """A link to a file (relative to the document) points at one, and a `#anchor` into a markdown
    file names one of its headings (GitHub's slugs)."""
    bad = []
    for doc in DOCS:
        for target in links(doc.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{rel(doc)}: ({target}) -> no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{rel(doc)}: ({target}) -> no heading with that anchor in {rel(dest)}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, spaces and
    hyphens stay), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", prose(doc.read_text()), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def test_slug_matches_githubs():
    assert slug("Real scale: GPUs, streaming data, the field's networks") == \
        "real-scale-gpus-streaming-data-the-fields-networks"
    assert slug("Replicates that redraw the data (`run.redraw_data`)") == "replicates-that-redraw-the-data-runredraw_data"
    assert slug("Bad inputs — 55 rows") == "bad-inputs--55-rows"


def test_every_python_module_named_in_the_docs_is_the_projects():
    """Every `python -m <module>` (inline, in code blocks, wrapped over a line) is a module of the
    repository; `python -m stages.<stage>`-style placeholders and foreign tools are skipped."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    missing = []
    for doc in DOCS:
        for m in re.finditer(r"python3?\s+-m\s+([A-Za-z_][\w.]*)(\S?)", doc.read_text()):
            module, after = m.group(1), m.group(2)
            if module.endswith(".") or after in ("<", "…") or module.split(".")[0] in FOREIGN_MODULES:
                continue
            try:
                spec = importlib.util.find_spec(module)
            except ModuleNotFoundError:
                spec = None
            if spec is None or not str(spec.origin or "").startswith(str(ROOT)):
                missing.append(f"{rel(doc)}: python -m {module}")
    assert not missing, "modules that are not the project's:\n" + "\n".join(sorted(set(missing)))


# A git commit id: 7 to 40 hex digits standing alone as a word of prose (not inside a version
# string such as 0.0~git20200523.55506a9-1, a path, a URL or a longer hash).
HEX = r"(?<![\w.~+/:#=-])([0-9a-f]{7,40})(?![\w~+/-]|\.\w)"
COMMIT_WORDS = re.compile(r"\b(commit|commits|at|in)\s+$", re.I)
DIGEST_WORDS = re.compile(r"(sha256|sha|md5|digest|checksum|hash)\W{0,3}(\w+\W{1,3}){0,2}$", re.I)


def commit_ids(text: str) -> list[str]:
    """The commit ids a text names. A token of 7–40 lower-case hex digits standing alone counts
    when it has both a letter and a digit (`d711321`, `1a26fb2`), unless the words just before it
    say it is a digest (sha256, md5, checksum, hash); an all-digit token counts only right after
    "commit", "at" or "in" (`at 4003407`). Fenced code blocks count too: a hash there is a
    hash all the same."""
    found = []
    for m in re.finditer(HEX, text):
        token, before = m.group(1), text[max(0, m.start() - 40) : m.start()]
        mixed = bool(re.search(r"[a-f]", token) and re.search(r"[0-9]", token))
        named = not DIGEST_WORDS.search(before) if mixed else token.isdigit() and bool(COMMIT_WORDS.search(before))
        if named:
            found.append(token)
    return found


def test_commit_ids_are_recognised():
    assert commit_ids("measured at d711321 on the EPYC (at 4003407: MKL)") == ["d711321", "4003407"]
    assert commit_ids("Debian 0.0~git20200523.55506a9-1, sha256 3f2a9c1d…, 4294967296 bytes") == []


def test_the_docs_name_no_commit():
    """README.md and docs/*.md state current behaviour and figures, never the commit they were
    measured at (the git log is the history)."""
    hits = [f"{rel(doc)}: {c}" for doc in DOCS for c in commit_ids(doc.read_text())]
    assert not hits, "commit ids in the docs:\n" + "\n".join(hits)


def repository_texts() -> list[Path]:
    files = [README, ROOT / "dvc.yaml", ROOT / "Makefile"]
    for folder in ("docs", "stages", "pipeline", "conf"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in {".md", ".py", ".yaml", ".sh"})
    return files


def test_nothing_points_outside_the_repository():
    """No file of README.md, docs/, stages/, pipeline/, dvc.yaml, conf/ or the Makefile refers to
    the design document or the folder beside the checkout (OUTSIDE): the design is docs/design.md."""
    hits = [
        f"{rel(p)}:{i}: {line.strip()[:120]}"
        for p in repository_texts()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line) or re.search(r"\bDESIGN\b", line)
    ]
    assert not hits, "points outside the repository (use docs/design.md):\n" + "\n".join(hits)


@pytest.mark.parametrize(
    ("use", "pattern"),
    [("dvc repro", r"dvc repro|dvc exp run"), ("the Prefect UI", r"prefect"), ("inspect", r"inspect")],
)
def test_the_readme_reaches_each_use_within_120_lines(use, pattern):
    """The three ways to use shiftlab each have a heading or a link in the README's first 120 lines."""
    head = README.read_text().splitlines()[:120]
    headings = [ln for ln in head if ln.startswith("#")]
    link_texts = [t for ln in head for t in re.findall(r"\[([^\]]+)\]\([^)]+\)", ln)]
    assert any(re.search(pattern, t, re.I) for t in headings + link_texts), \
        f"no heading or link for {use} in the README's first 120 lines"


def test_the_readme_keeps_its_layout_section():
    """tests/test_layout.py refers to the README's "Layout"."""
    assert re.search(r"^## Layout$", README.read_text(), flags=re.M)
