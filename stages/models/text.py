"""Text: one tokenizer, a train-split vocabulary, bag-of-words features, and a discriminative
bag-of-embeddings classifier over the same tokens.

Text datasets (`shortcut_text`, `civilcomments`) carry their raw `text` column and, in `x`,
the bag-of-words features `bag_of_words` computes with the vocabulary built from their train
split — so every vector method (MLPs, LDA, ...) runs on them unchanged, and text-aware
methods read `text` and tokenize it with `tokenize` / `encode`.

torch is imported only by the model functions, so the data side stays light.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

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


def bag_of_embeddings(vocab_size: int, dim: int, n_classes: int) -> torch.nn.Module:
    """A discriminative text classifier: mean of token embeddings (padding ignored), then a linear layer.

    Input: token ids from `encode` (n, max_len); output: logits (n, n_classes).
    """
    from torch import nn

    class BagOfEmbeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.EmbeddingBag(vocab_size + 2, dim, mode="mean", padding_idx=0)
            self.head = nn.Linear(dim, n_classes)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    return BagOfEmbeddings()


def fit_bag_of_embeddings(
    ids: np.ndarray,
    y: np.ndarray,
    vocab_size: int,
    n_classes: int,
    *,
    dim: int = 32,
    epochs: int = 10,
    lr: float = 1e-2,
    batch_size: int = 64,
    seed: int = 0,
) -> torch.nn.Module:
    """Train `bag_of_embeddings` by minibatch Adam on cross-entropy (ERM); returns the model in eval mode."""
    import torch
    import torch.nn.functional as F

    from stages.runtime import setup_torch

    generator = setup_torch(seed)
    model = bag_of_embeddings(vocab_size, dim, n_classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, t = torch.from_numpy(ids), torch.from_numpy(np.asarray(y, dtype=np.int64))
    for _ in range(epochs):
        order = torch.randperm(len(t), generator=generator)
        for start in range(0, len(t), batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), t[idx]).backward()
            opt.step()
    return model.eval()
