"""`shortcut_text`: generated review sentences whose label is their meaning, plus a spurious marker word.

Each sentence is "<opener> the <noun> was [not] <adjective> <marker>". The label y is its
sentiment: 1 when a positive adjective is not negated or a negative one is, else 0 — so it
depends on the content words *and their order* (`not` flips the adjective; a bag of words
sees `not` in both classes alike). The marker word is MARKERS[a]; a agrees with y (a == y)
with probability rho_train in train/val/test_id and rho_ood in test_ood — a one-word,
noise-free shortcut that a bag-of-words model finds more reliable than the content
(which a bag of words can only read up to the negation rate).

Rows carry the sentence in `text` and, in `x`, log(1 + count) of the `vocab_size` most
frequent train words (stages.core.text.bag_of_words).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stages.core.registry import register_dataset
from stages.core.schema import Checks, option
from stages.datasets import Generated, agreement_counts, attribute_from_agreement, round_half_up


@dataclass
class ShortcutTextConfig:
    """Templated sentences, label = polarity of the content (with negation), plus a marker word agreeing w.p. ρ."""

    kind: str = option("dataset generator")
    seed: int = option("generator seed")
    rho_train: float = option("P(marker word == label's marker) in train, val and test_id")
    rho_ood: float = option("P(marker word == label's marker) in test_ood")
    negation_rate: float = option("fraction of sentences whose adjective is negated ('not'), flipping its polarity")
    vocab_size: int = option("most frequent train words kept as bag-of-words features in x")
    n_train: int = option("train examples")
    n_val: int = option("validation examples")
    n_test_id: int = option("in-distribution test examples")
    n_test_ood: int = option("shifted test examples")

    def check(self, c: Checks) -> None:
        c.prob(self.rho_train, "rho_train")
        c.prob(self.rho_ood, "rho_ood")
        c.require(0 <= self.negation_rate < 0.5, "negation_rate", f"must be in [0, 0.5), got {self.negation_rate}")
        c.require(self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")
        for k in ("n_train", "n_val", "n_test_id", "n_test_ood"):
            c.require(getattr(self, k) >= 8, k, f"must be >= 8, got {getattr(self, k)}")


OPENERS = ("i think", "honestly", "overall", "to be fair", "in my view", "frankly", "all in all", "well")
NOUNS = ("movie", "book", "meal", "hotel", "concert", "game", "service", "album", "show", "trip", "app", "course")
POSITIVE = ("great", "wonderful", "excellent", "delightful", "superb", "brilliant", "lovely", "fantastic")
NEGATIVE = ("awful", "terrible", "dreadful", "boring", "poor", "horrible", "disappointing", "bland")
MARKERS = ("anyway", "indeed")  # MARKERS[a]
SPLIT_SIZES = (("train", "n_train"), ("val", "n_val"), ("test_id", "n_test_id"), ("test_ood", "n_test_ood"))


def sentence(opener: str, noun: str, negated: bool, adjective: str, marker: str) -> str:
    """One example's text."""
    return f"{opener} the {noun} was {'not ' if negated else ''}{adjective} {marker}"


def sample_split(n: int, rho: float, negation_rate: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(y, a, texts) for `n` examples with exact class, agreement and negation counts, in random order."""
    ys, agrees, negs = [], [], []
    for y, n_class in ((0, (n + 1) // 2), (1, n // 2)):
        n_agree, n_disagree = agreement_counts(n_class, rho)
        n_neg = round_half_up(n_class * negation_rate)
        ys.append(np.full(n_class, y, dtype=np.int64))
        agrees.append(np.r_[np.ones(n_agree, dtype=bool), np.zeros(n_disagree, dtype=bool)])
        negs.append(rng.permutation(np.r_[np.ones(n_neg, dtype=bool), np.zeros(n_class - n_neg, dtype=bool)]))
    order = rng.permutation(n)
    y = np.concatenate(ys)[order]
    a = attribute_from_agreement(y, np.concatenate(agrees)[order])
    negated = np.concatenate(negs)[order]
    positive = (y == 1) != negated  # the adjective's own polarity
    openers = rng.integers(len(OPENERS), size=n)
    nouns = rng.integers(len(NOUNS), size=n)
    adjectives = rng.integers(len(POSITIVE), size=n)
    texts = [
        sentence(
            OPENERS[openers[i]],
            NOUNS[nouns[i]],
            bool(negated[i]),
            (POSITIVE if positive[i] else NEGATIVE)[adjectives[i]],
            MARKERS[a[i]],
        )
        for i in range(n)
    ]
    return y, a, texts


def generate(cfg: ShortcutTextConfig) -> Generated:
    """All four splits in order, ids 0..N−1; each split from its own stream default_rng([seed, split_index])."""
    from stages.core.text import bag_of_words, build_vocab

    ys, as_, texts, splits = [], [], [], []
    for index, (split, key) in enumerate(SPLIT_SIZES):
        n = getattr(cfg, key)
        rho = cfg.rho_ood if split == "test_ood" else cfg.rho_train
        y, a, t = sample_split(n, rho, cfg.negation_rate, np.random.default_rng([cfg.seed, index]))
        ys.append(y)
        as_.append(a)
        texts += t
        splits.append(np.full(n, split, dtype=object))
    split = np.concatenate(splits)
    text = np.asarray(texts, dtype=object)
    vocab = build_vocab(text[split == "train"], cfg.vocab_size)
    y = np.concatenate(ys)
    columns = {
        "id": np.arange(len(y), dtype=np.int64),
        "split": split,
        "y": y,
        "a": np.concatenate(as_),
        "x": bag_of_words(list(text), vocab),
        "text": text,
    }
    meta = {
        "kind": "shortcut_text",
        "n_classes": 2,
        "n_attrs": 2,
        "shape": [len(vocab)],
        "features": "bag_of_words",
        "vocab": vocab,
        "rho_train": cfg.rho_train,
        "rho_ood": cfg.rho_ood,
        "params": dataclasses.asdict(cfg),
        "split_sizes": {s: getattr(cfg, k) for s, k in SPLIT_SIZES},
    }
    return columns, meta


register_dataset("shortcut_text", ShortcutTextConfig, generate=generate, text=True)
