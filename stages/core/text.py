"""Text: one tokenizer, a train-split vocabulary, bag-of-words features and token ids.

Text datasets (registered with `text=True`) carry their raw `text` column and, in `x`,
the bag-of-words features `bag_of_words` computes with the vocabulary built from their train
split — so every vector method (MLPs, LDA, ...) runs on them unchanged, and text-aware
methods read `text` and tokenize it with `tokenize` / `encode`.

Text methods (stages/models/) build on these tokens; this module imports no torch, so
prepare stays light.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

TOKEN = re.compile(r"[a-z0-9']+")
PAD, UNK = "<pad>", "<unk>"


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens: runs of letters, digits and apostrophes."""
    return TOKEN.findall(text.lower())


def build_vocab(texts: Iterable[str], size: int) -> list[str]:
    """The `size` most frequent tokens of `texts`, ties broken alphabetically (deterministic)."""
    counts = Counter(tok for t in texts for tok in tokenize(t))
    return [tok for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def bag_of_words(texts: Sequence[str], vocab: Sequence[str]) -> np.ndarray:
    """float32 (n, len(vocab)): log(1 + count) of each vocabulary word; other words are ignored."""
    index = {w: i for i, w in enumerate(vocab)}
    out = np.zeros((len(texts), len(vocab)), dtype=np.float32)
    for row, text in enumerate(texts):
        for tok, c in Counter(tokenize(text)).items():
            j = index.get(tok)
            if j is not None:
                out[row, j] = c
    return np.log1p(out, out=out)


def encode(texts: Sequence[str], vocab: Sequence[str], max_len: int) -> np.ndarray:
    """int64 token ids (n, max_len): 0 = padding, 1 = unknown word, 2+i = vocab[i]; truncated at max_len."""
    index = {w: i + 2 for i, w in enumerate(vocab)}
    out = np.zeros((len(texts), max_len), dtype=np.int64)
    for row, text in enumerate(texts):
        ids = [index.get(tok, 1) for tok in tokenize(text)][:max_len]
        out[row, : len(ids)] = ids
    return out
