"""The bag-of-embeddings text classifier (model kind `text`, `input = "text"`).

Token ids (stages/text.py `encode`) → mean of their embeddings (padding ignored) → optional
ReLU layers (`hidden`) → linear head. It holds its vocabulary, built from the train split
only, and stores it in `arch()`, so `stages.models.load_model` rebuilds it from
model.safetensors alone; evaluate and distill pass it the `text` column.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from stages.models.nets import MLPEncoder
from stages.registry import register_model
from stages.text import encode


@register_model("text")
class TextClassifier(nn.Module):
    """Bag of embeddings: token ids → mean embedding → `hidden` ReLU layers → class logits.

    Ids are `encode(texts, vocab, max_len)`: 0 = padding (ignored by the mean), 1 = unknown
    word, 2+i = vocab[i]. A text with no tokens has the zero vector as its mean.
    """

    input = "text"  # evaluate / distill pass the prepared `text` column to `logits`

    def __init__(self, vocab: Sequence[str], n_classes: int, dim: int = 32, max_len: int = 64,
                 hidden: Sequence[int] = ()) -> None:
        super().__init__()
        if len(vocab) < 1 or len(set(vocab)) != len(vocab):
            raise ValueError(f"vocab must be non-empty with distinct words, got {len(vocab)} words")
        self.vocab = [str(w) for w in vocab]
        self.n_classes, self.dim, self.max_len = int(n_classes), int(dim), int(max_len)
        self.embed = nn.EmbeddingBag(len(self.vocab) + 2, self.dim, mode="mean", padding_idx=0)
        self.encoder = MLPEncoder(self.dim, [int(h) for h in hidden])
        self.head = nn.Linear(self.encoder.out_dim, self.n_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (b, n_classes) of int64 token ids (b, max_len)."""
        return self.head(self.encoder(self.embed(ids)))

    def encode(self, texts: Iterable[str]) -> torch.Tensor:
        """int64 token ids (n, max_len) of raw strings, over this model's vocabulary."""
        return torch.from_numpy(encode([str(t) for t in texts], self.vocab, self.max_len))

    def arch(self) -> dict[str, Any]:
        """The architecture arguments `load_model` rebuilds this model from, vocabulary included."""
        return {"kind": self.kind, "in_dim": self.max_len, "n_classes": self.n_classes, "dim": self.dim,
                "max_len": self.max_len, "hidden": self.encoder.hidden, "vocab": self.vocab}

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> TextClassifier:
        """Rebuild from `arch()` metadata (KeyError/TypeError/ValueError when it does not fit)."""
        vocab = arch["vocab"]
        if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab):
            raise ValueError("'vocab' must be a list of strings")
        if int(arch["in_dim"]) != int(arch["max_len"]):
            raise ValueError(f"'in_dim' ({arch['in_dim']}) must equal 'max_len' ({arch['max_len']})")
        return cls(vocab, int(arch["n_classes"]), int(arch["dim"]), int(arch["max_len"]), list(arch["hidden"]))

    @torch.no_grad()
    def logits(self, texts: Sequence[str], batch_size: int = 2048) -> np.ndarray:
        """Class scores (float32, (n, n_classes)) of raw strings; softmax gives p(y | text)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ids = self.encode(texts)
        was_training = self.training
        self.eval()
        try:
            out = np.empty((len(ids), self.n_classes), dtype=np.float32)
            for i in range(0, len(ids), batch_size):
                out[i : i + batch_size] = self(ids[i : i + batch_size]).float().numpy()
            return out
        finally:
            self.train(was_training)

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: multiply-adds of the Linear layers (the
        embedding lookup and mean are additions, not counted); one forward pass."""
        params = sum(t.numel() for t in self.state_dict().values())
        macs = sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        return {"params": int(params), "macs": int(macs), "forward_passes": 1}
