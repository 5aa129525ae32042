"""`civilcomments`: WILDS CivilComments — toxicity with identity mentions as the spurious attribute.

Raw folder (`dataset.civilcomments.root`, default data/raw/civilcomments/): WILDS'
`civilcomments_v1.0/all_data_with_identities.csv`, columns `comment_text, toxicity, split`
(train/val/test) and one [0, 1] score column per identity (`male, female, LGBTQ, christian,
muslim, other_religions, black, white, ...`; empty = not annotated = 0). Where the file has
WILDS' `id` column, each id must be unique (a comment listed twice could sit in two splits).

    y = toxicity >= threshold,  a = any configured identity >= threshold,  g = 2y + a
    official train -> train
    official val   -> val
    official test  -> per group, a seeded (1 - test_ood_frac) -> test_id; from the rest, the
                      same number of comments of every group -> test_ood (group-balanced)

Rows carry the comment in `text` and, in `x`, log(1 + count) of the `vocab_size` most frequent
train words (stages.core.text.bag_of_words).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.core import artifacts
from stages.core.io import ArtifactError, write_parquet_stream
from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import raw
from stages.datasets.packages import sha256_file
from stages.evaluation import regime


@dataclass
class CivilCommentsConfig(raw.RawFolder):
    """CivilComments (WILDS CSV) from data/raw: y = toxic, a = any configured identity mentioned."""

    kind: str = option("dataset loader")
    root: str = option("folder holding all_data_with_identities.csv")
    identities: list[str] = option("identity columns; a = 1 when any is >= threshold")
    threshold: float = option("toxicity and identity scores >= threshold count as 1")
    seed: int = option("seed of the test_id / test_ood split of the official test split")
    test_ood_frac: float = option("fraction of the official test split (per group) from which the group-balanced test_ood is drawn")
    vocab_size: int = option("most frequent train words kept as bag-of-words features in x")

    def raw_files(self) -> dict[str, tuple[str, ...]]:
        return {FILE: ("comment_text", "toxicity", "split", *self.identities)}

    def where(self) -> str:
        return WHERE

    def check(self, c: Checks) -> None:
        c.require(len(self.identities) > 0, "identities", "must not be empty")
        c.prob(self.threshold, "threshold")
        c.require(0 < self.test_ood_frac < 1, "test_ood_frac", f"must be in (0, 1), got {self.test_ood_frac}")
        c.require(self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")


WHERE = (
    "WILDS (https://wilds.stanford.edu/datasets/#civilcomments; `pip install wilds` then "
    "`python -c \"import wilds; wilds.get_dataset('civilcomments', download=True)\"` on a machine "
    "with network access, then copy civilcomments_v1.0/all_data_with_identities.csv)"
)
FILE = "all_data_with_identities.csv"
SPLITS = ("train", "val", "test")
# Comments per official split in WILDS civilcomments_v1.0 (448,000 in all). Source: Koh et al.,
# "WILDS: A Benchmark of in-the-Wild Distribution Shifts", ICML 2021, Appendix E.6.
PUBLISHED = {"train": [269038], "val": [45180], "test": [133782]}
SOURCE = "Koh et al. 2021 (WILDS), CivilComments split sizes"


def load(dataset: str, cfg: CivilCommentsConfig, out: Path) -> str:
    """Read the CSV, map splits and groups, featurise the text and write `out` in row groups."""
    import pyarrow as pa

    from stages.core.text import bag_of_words, build_vocab

    csv = cfg.check_files(dataset)[FILE]
    df = raw.read_csv(csv, cfg.raw_files()[FILE], optional=("id",))
    y = (raw.score_column(df, "toxicity", csv, required=True) >= cfg.threshold).astype(np.int64)
    identity = np.stack([raw.score_column(df, c, csv) for c in cfg.identities], axis=1)
    a = (identity >= cfg.threshold).any(axis=1).astype(np.int64)
    names = raw.text_column(df, "split")
    bad = ~np.isin(names, SPLITS)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ArtifactError(
            f"{csv}: row {i + 1}: column 'split' is {names[i]!r}, expected one of {list(SPLITS)}; "
            f"{int(bad.sum())} row(s) like this. Re-download the file (see {raw.DOCS})"
        )
    if "id" in df.column_names:  # WILDS' comment id: a comment listed twice could sit in two splits
        raw.require_unique(raw.text_column(df, "id"), "id", csv, names)
    texts = raw.text_column(df, "comment_text")
    g = y * 2 + a
    observed = {s: [int((names == s).sum())] for s in SPLITS}
    split = raw.balanced_ood(names, g, 4, "test", cfg.test_ood_frac, np.random.default_rng(cfg.seed))
    vocab = build_vocab(texts[split == "train"], cfg.vocab_size)
    meta = {
        "dataset": dataset,
        "kind": "civilcomments",
        "n_classes": 2,
        "n_attrs": 2,
        "shape": [len(vocab)],
        "text": True,
        "features": "bag_of_words",
        "vocab": vocab,
        "classes": ["non-toxic", "toxic"],
        "attributes": ["no identity mentioned", "identity mentioned: " + ", ".join(cfg.identities)],
        "params": dataclasses.asdict(cfg),
        "raw_checksums": {FILE: sha256_file(csv)},
        "published_counts": raw.published_check(observed, PUBLISHED, SOURCE),
    }
    plan = raw.make_plan(np.arange(len(df), dtype=np.int64), split, y, a, meta, {"text": texts}, csv)
    schema = artifacts.prepared_schema(len(vocab), text=True)
    # The regime, on the bag of words `x` of a bounded sample of train rows as the chunks pass.
    sample, weights = regime.train_sample(plan.split, plan.y, plan.a, 2, cfg.seed)
    separation = regime.SeparationAccumulator(len(vocab), 2, 2, weights)
    with write_parquet_stream(out, schema) as (stream, file_meta):
        for start in range(0, len(plan), 16 * raw.CHUNK_ROWS):
            rows = np.arange(start, min(start + 16 * raw.CHUNK_ROWS, len(plan)))
            chunk_text = plan.extra["text"][rows].tolist()
            x = bag_of_words(chunk_text, vocab)
            pick = sample[rows]
            separation.add(x[pick], plan.y[rows[pick]], plan.a[rows[pick]])
            table = pa.table(
                {
                    **raw.base_table(plan, rows),
                    "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), type=pa.float32()), len(vocab)),
                    "text": pa.array(chunk_text, type=pa.string()),
                }
            )
            stream.write(table)
        plan.meta["separation"] = separation.result()
        plan.meta["separation_source"] = "train_sample"
        file_meta.update(plan.meta)
        n_rows = stream.num_rows
    return raw.summary(out, plan.meta, n_rows)


register_dataset("civilcomments", CivilCommentsConfig, load=load, text=True)
