"""The text classifiers (model kind `text`, `input = "text"`): a bag of embeddings, or BERT.

`TextClassifier`: token ids (stages/core/text.py `encode`) → mean of their embeddings (padding
ignored) → optional ReLU layers (`hidden`) → linear head.

`BertTextClassifier`: transformers' `BertModel`, built from a `BertConfig` whose sizes come from
the method's config (nothing downloads), its pooled [CLS] output → dropout → the same `hidden`
ReLU layers → linear head (the shape of `BertForSequenceClassification`). Its tokens are either
the project's word tokens over a train-split vocabulary with a [CLS] id in front (`words`), or
BERT's own WordPiece tokens from a local vocab.txt through `transformers.BertTokenizerFast`
(`wordpiece`; needed for real BERT weights, whose embeddings are indexed by that vocabulary).

Both hold their vocabulary and store it in `arch()`, so `stages.models.load_model` rebuilds
either from model.safetensors alone (`TextClassifier.from_arch` dispatches on `encoder`);
evaluate and distill pass them the `text` column.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stages.core.registry import register_model
from stages.core.text import encode
from stages.models.nets import MLPEncoder


@register_model("text")
class TextClassifier(nn.Module):
    """Bag of embeddings: token ids → mean embedding → `hidden` ReLU layers → class logits.

    Ids are `encode(texts, vocab, max_len)`: 0 = padding (ignored by the mean), 1 = unknown
    word, 2+i = vocab[i]. A text with no tokens has the zero vector as its mean.
    """

    input = "text"  # evaluate / distill pass the prepared `text` column to `logits`
    on_accelerator = True  # every tensor it makes follows its inputs' device (training.place)

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
    def from_arch(cls, arch: dict[str, Any]) -> nn.Module:
        """Rebuild from `arch()` metadata (KeyError/TypeError/ValueError when it does not fit);
        metadata naming an `encoder` other than the bag (absent in it) is a BertTextClassifier's."""
        if arch.get("encoder", "bag") != "bag":
            return BertTextClassifier.from_arch(arch)
        vocab = arch["vocab"]
        if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab):
            raise ValueError("'vocab' must be a list of strings")
        if int(arch["in_dim"]) != int(arch["max_len"]):
            raise ValueError(f"'in_dim' ({arch['in_dim']}) must equal 'max_len' ({arch['max_len']})")
        return cls(vocab, int(arch["n_classes"]), int(arch["dim"]), int(arch["max_len"]), list(arch["hidden"]))

    @torch.no_grad()
    def logits(self, texts: Sequence[str], batch_size: int = 2048) -> np.ndarray:
        """Class scores (float32, (n, n_classes)) of raw strings; softmax gives p(y | text)."""
        return batched_logits(self, self.encode(texts), batch_size)

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: multiply-adds of the Linear layers (the
        embedding lookup and mean are additions, not counted); one forward pass."""
        params = sum(t.numel() for t in self.state_dict().values())
        macs = sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        return {"params": int(params), "macs": int(macs), "forward_passes": 1}


def batched_logits(model: nn.Module, ids: torch.Tensor, batch_size: int) -> np.ndarray:
    """`model(ids)` in eval mode and batches of `batch_size` rows, on the model's device (float32 numpy)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = np.empty((len(ids), model.n_classes), dtype=np.float32)
        for i in range(0, len(ids), batch_size):
            out[i : i + batch_size] = model(ids[i : i + batch_size].to(device)).float().cpu().numpy()
        return out
    finally:
        model.train(was_training)


# ---- BERT ------------------------------------------------------------------------------------

# The attention kernel, named rather than left to transformers' default (which may change with
# the installed versions): torch's scaled_dot_product_attention, deterministic on the CPU (the
# kernel of the project's own causal transformer). Saved in arch(), so a model is rebuilt as trained.
ATTENTION = "sdpa"
# BERT's special tokens; a vocab.txt must hold the first four (`read_bert_vocab`).
PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
TOKENIZERS = ("words", "wordpiece")


class BertTextClassifier(nn.Module):
    """transformers' BertModel over token ids → pooled [CLS] → dropout → `hidden` ReLU layers → logits.

    `tokenizer` "words": ids as `TextClassifier`'s (0 = padding, 1 = unknown, 2+i = vocab[i]) after
    a [CLS] id (len(vocab) + 2) in position 0; "wordpiece": `vocab` is BERT's vocab.txt, line i
    = id i, tokenised by `BertTokenizerFast` ([CLS] ... [SEP], lower-cased when `lowercase`).
    `positions` (≥ max_len) is the size of BERT's position table: a real checkpoint's (512) so its
    weights fit, while inputs are padded only to `max_len`. Attention ignores padding.
    """

    kind = "text"  # the registered model kind (`TextClassifier` rebuilds either)
    input = "text"
    on_accelerator = True

    def __init__(self, vocab: Sequence[str], n_classes: int, dim: int, max_len: int, hidden: Sequence[int],
                 layers: int, heads: int, intermediate: int, tokenizer: str = "words", lowercase: bool = True,
                 positions: int | None = None) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {list(TOKENIZERS)}, got {tokenizer!r}")
        if len(vocab) < 1 or len(set(vocab)) != len(vocab):
            raise ValueError(f"vocab must be non-empty with distinct tokens, got {len(vocab)} tokens")
        self.vocab = [str(w) for w in vocab]
        self.tokenizer, self.lowercase = tokenizer, bool(lowercase)
        self.n_classes, self.dim, self.max_len = int(n_classes), int(dim), int(max_len)
        self.layers, self.heads, self.intermediate = int(layers), int(heads), int(intermediate)
        self.positions = int(positions) if positions is not None else self.max_len
        if self.positions < self.max_len:
            raise ValueError(f"positions ({self.positions}) must be >= max_len ({self.max_len})")
        wordpiece = tokenizer == "wordpiece"
        if wordpiece:
            missing = [t for t in (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN) if t not in self.vocab]
            if missing:
                raise ValueError(f"a BERT vocabulary must hold {missing}")
        self.pad_id = self.vocab.index(PAD_TOKEN) if wordpiece else 0
        config = BertConfig(
            vocab_size=len(self.vocab) if wordpiece else len(self.vocab) + 3, hidden_size=self.dim,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, intermediate_size=self.intermediate,
            max_position_embeddings=self.positions, pad_token_id=self.pad_id, attn_implementation=ATTENTION,
        )
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.encoder = MLPEncoder(self.dim, [int(h) for h in hidden])
        self.head = nn.Linear(self.encoder.out_dim, self.n_classes)
        self._wordpiece: Any = None  # the BertTokenizerFast, built on first use

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (b, n_classes) of int64 token ids (b, max_len)."""
        pooled = self.bert(input_ids=ids, attention_mask=(ids != self.pad_id).long()).pooler_output
        return self.head(self.encoder(self.dropout(pooled)))

    def encode(self, texts: Iterable[str]) -> torch.Tensor:
        """int64 token ids (n, max_len) of raw strings."""
        texts = [str(t) for t in texts]
        if self.tokenizer == "words":
            ids = encode(texts, self.vocab, self.max_len - 1)
            return torch.from_numpy(np.concatenate([np.full((len(texts), 1), len(self.vocab) + 2), ids], axis=1))
        if self._wordpiece is None:
            from transformers import BertTokenizerFast

            # vocab= (a dict): transformers 5 ignores a vocab_file= argument
            self._wordpiece = BertTokenizerFast(vocab={w: i for i, w in enumerate(self.vocab)},
                                                do_lower_case=self.lowercase)
        if not texts:
            return torch.zeros(0, self.max_len, dtype=torch.int64)
        out = self._wordpiece(texts, max_length=self.max_len, truncation=True, padding="max_length",
                              return_attention_mask=False, return_token_type_ids=False)
        return torch.tensor(out["input_ids"], dtype=torch.int64)

    def arch(self) -> dict[str, Any]:
        """The architecture arguments `load_model` rebuilds this model from, vocabulary included."""
        return {"kind": self.kind, "encoder": "bert", "in_dim": self.max_len, "n_classes": self.n_classes,
                "dim": self.dim, "max_len": self.max_len, "hidden": self.encoder.hidden, "layers": self.layers,
                "heads": self.heads, "intermediate": self.intermediate, "positions": self.positions,
                "attention": ATTENTION, "tokenizer": self.tokenizer, "lowercase": self.lowercase, "vocab": self.vocab}

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> BertTextClassifier:
        """Rebuild from `arch()` metadata (KeyError/TypeError/ValueError when it does not fit)."""
        if arch["encoder"] != "bert":
            raise ValueError(f"unknown text encoder {arch['encoder']!r} (expected 'bag' or 'bert')")
        if arch["attention"] != ATTENTION:
            raise ValueError(f"attention {arch['attention']!r}: this version builds {ATTENTION!r}")
        vocab = arch["vocab"]
        if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab):
            raise ValueError("'vocab' must be a list of strings")
        if int(arch["in_dim"]) != int(arch["max_len"]):
            raise ValueError(f"'in_dim' ({arch['in_dim']}) must equal 'max_len' ({arch['max_len']})")
        return cls(vocab, int(arch["n_classes"]), int(arch["dim"]), int(arch["max_len"]), list(arch["hidden"]),
                   int(arch["layers"]), int(arch["heads"]), int(arch["intermediate"]), str(arch["tokenizer"]),
                   bool(arch["lowercase"]), int(arch["positions"]))

    @torch.no_grad()
    def logits(self, texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
        """Class scores (float32, (n, n_classes)) of raw strings; softmax gives p(y | text)."""
        return batched_logits(self, self.encode(texts), batch_size)

    def load_bert(self, path: str | os.PathLike[str], key: str) -> str:
        """Load a BERT state_dict from safetensors `path` (named by config key `key`) into `self.bert`;
        the sha256 of the file.

        The file is `BertModel.state_dict()` (names `embeddings.…`) or a model wrapping it
        (`bert.embeddings.…`, e.g. BertForSequenceClassification or BertForPreTraining; their
        heads are ignored); a file without the pooler leaves it initialised. Our head (`encoder`,
        `head`) always starts fresh. A missing file or a tensor of another shape (e.g. the word
        embeddings of another vocabulary) is a one-line ArtifactError naming the file and `key`.
        """
        from stages.models.external import file_shapes, load_external

        names = file_shapes(path)
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in names else ""
        skip = () if not names or f"{prefix}pooler.dense.weight" in names else ("pooler.",)
        return load_external(self.bert, path, key, skip=skip, prefix=prefix)

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: per layer and token the Q, K, V, output and
        feed-forward projections, plus QKᵀ and AV over all max_len² pairs (padding included, as
        computed), then the pooler and head; one forward pass."""
        n, d, f = self.max_len, self.dim, self.intermediate
        per_layer = n * (4 * d * d + 2 * d * f) + 2 * n * n * d
        head = sum(m.in_features * m.out_features for m in [*self.encoder.modules(), self.head] if isinstance(m, nn.Linear))
        params = sum(t.numel() for t in self.state_dict().values())
        return {"params": int(params), "macs": int(self.layers * per_layer + d * d + head), "forward_passes": 1}


def read_bert_vocab(path: str | os.PathLike[str], key: str) -> tuple[list[str], bool]:
    """BERT's vocab.txt (one token a line, line i = id i) named by config key `key`: (tokens,
    lowercase). An uncased vocabulary (no token but the [SPECIAL] ones with an upper-case
    letter) is read lower-cased, as BERT-uncased was trained. One-line ArtifactError naming the
    file and `key` when it is missing, unreadable, or lacks [PAD], [UNK], [CLS] or [SEP]."""
    from stages.core.io import ArtifactError

    path = Path(path)
    try:
        tokens = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        what = "not found" if isinstance(e, FileNotFoundError) else f"unreadable ({e})"
        raise ArtifactError(f"{path}: vocabulary file {what} ({key}); name BERT's vocab.txt, one token a line") from None
    if tokens and tokens[-1] == "":
        tokens.pop()  # the final newline
    tokens = [t.rstrip("\r") for t in tokens]
    missing = [t for t in (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN) if t not in tokens]
    if missing:
        raise ArtifactError(f"{path}: not a BERT vocab.txt ({key}): it lacks {missing} ({len(tokens)} lines)")
    if len(set(tokens)) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if t in tokens[:i])
        raise ArtifactError(f"{path}: not a BERT vocab.txt ({key}): token {dup!r} is on two lines")
    cased = any(c.isupper() for t in tokens if not (t.startswith("[") and t.endswith("]")) for c in t)
    return tokens, not cased
