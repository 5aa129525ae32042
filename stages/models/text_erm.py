"""The discriminative text baseline `text_erm`: a bag-of-embeddings or BERT classifier over the text.

`encoder: bag` (the default): `TextClassifier` (stages/models/text.py) over the `text` column,
its vocabulary the train split's most frequent words. A mean of embeddings is blind to word
order, so on templated text with negations it can read the content only up to the negation
rate — the discriminative counterpart of an order-aware generative classifier over the same
text's bytes.

`encoder: bert`: `BertTextClassifier`, transformers' BERT sized by `layers`, `dim` (hidden
size), `heads`, `intermediate` and `max_len`, fine-tuned end to end. Its tokens are the same
train-split words (with a [CLS] id in front), or, with `vocab` (a local vocab.txt), BERT's own
WordPiece tokens; `weights` (a local safetensors BERT state_dict, which needs its `vocab`) starts
the encoder from a checkpoint, the classifier head always from scratch. Nothing downloads;
config.json records each file's path and sha256 (`weights`, `vocab`).

Either is trained with the shared loop `stages.models.training.fit_classifier` (selection,
history, checkpoints as for every epoch-trained method).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.core.registry import register_method
from stages.core.schema import Checks, option, train_and_selection_splits
from stages.core.text import build_vocab

if TYPE_CHECKING:
    from torch import nn

    from stages.core.checkpoint import Checkpointer
    from stages.models.training import FitResult


ENCODERS = ("bag", "bert")


@dataclass
class TextErmConfig:
    """Discriminative text baseline: ERM of a bag-of-embeddings classifier over the word tokens of
    a text dataset's `text` column (vocabulary from the train split); needs a text dataset."""

    kind: str = option("method family")
    encoder: str = option("bag (mean of word embeddings) | bert (transformers' BertModel, sized by the keys below)")
    vocab_size: int = option("most frequent train words given an embedding (others share the unknown token); unused with vocab")
    max_len: int = option("tokens read per example, bert: including [CLS] (and [SEP] with vocab); longer text is truncated")
    dim: int = option("embedding width; bert: hidden size")
    hidden: list[int] = option("ReLU layer widths between the text's vector (mean embedding / pooled [CLS]) and the linear head ([] = linear)")
    layers: int = option("bert: transformer layers")
    heads: int = option("bert: attention heads (must divide dim)")
    intermediate: int = option("bert: feed-forward width of each layer")
    weights: str | None = option("bert: local safetensors file of a BERT state_dict to start from (needs vocab; null = from scratch)")
    vocab: str | None = option("bert: BERT's vocab.txt, tokenised by BertTokenizerFast (null = the train split's words)")
    lr: float = option("AdamW learning rate")
    weight_decay: float = option("AdamW weight decay")
    epochs: int = option("training epochs")
    batch_size: int = option("minibatch size")
    selection: str = option("checkpoint selection: val_avg | val_worst_group | oracle")

    def reads_splits(self) -> tuple[str, ...]:
        """The splits whose rows can change the trained weights: train, and the selection split."""
        return train_and_selection_splits(self.selection)

    def check(self, c: Checks) -> None:
        c.require(self.vocab_size >= 1, "vocab_size", f"must be >= 1, got {self.vocab_size}")
        c.require(self.max_len >= 1, "max_len", f"must be >= 1, got {self.max_len}")
        c.require(self.dim >= 1, "dim", f"must be >= 1, got {self.dim}")
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.choice(self.encoder, "encoder", ENCODERS)
        c.minibatch(self)
        if self.encoder != "bert":
            for key in ("weights", "vocab"):
                c.require(getattr(self, key) is None, key, f"only encoder=bert reads it (encoder is '{self.encoder}'); set it to null")
            return
        c.require(self.max_len >= 2, "max_len", f"bert reads [CLS] and at least one token: must be >= 2, got {self.max_len}")
        c.require(self.layers >= 1, "layers", f"must be >= 1, got {self.layers}")
        c.require(self.heads >= 1 and self.dim % max(self.heads, 1) == 0, "heads",
                  f"must be >= 1 and divide dim={self.dim}, got {self.heads}")
        c.require(self.intermediate >= 1, "intermediate", f"must be >= 1, got {self.intermediate}")
        c.require(self.weights is None or self.vocab is not None, "weights",
                  "BERT weights come with their own vocabulary: set vocab to the checkpoint's vocab.txt too "
                  "(without vocab the word embeddings would be indexed by the train split's words)")


def train_text(
    prepared: Any, cfg: TextErmConfig, seed: int, desc: str = "train text_erm", checkpoint: Checkpointer | None = None,
    key: str = "method.text_erm",
) -> tuple[Any, FitResult]:
    """Fit a TextClassifier or, with `cfg.encoder` bert, a BertTextClassifier (TextErmConfig
    `cfg`) by ERM on the train split's `text`.

    The vocabulary is the `cfg.vocab_size` most frequent train words (`build_vocab`), or BERT's
    vocab.txt (`cfg.vocab`); every split's text is encoded to token ids and the shared loop
    `training.fit_classifier` trains with cross-entropy and selects the epoch by `cfg.selection`
    (with `checkpoint`, resumable byte-identically). Returns (model holding the selected weights,
    in eval mode, its `files` the local files it was built from; FitResult). A prepared dataset
    without a `text` column, or whose train text has no tokens, is an ArtifactError (stages.train
    checks the first before this, naming the method and dataset); so is a missing or unfitting
    weights or vocab file, naming it and the config key (`key`.weights / `key`.vocab).
    """
    from stages.core.io import ArtifactError
    from stages.core.runtime import setup_torch
    from stages.models.text import TextClassifier
    from stages.models.training import (
        FitOptions,
        SplitData,
        cross_entropy,
        fit_classifier,
        split_data,
    )

    dataset = prepared.meta.get("dataset", "?")
    if getattr(prepared, "text", None) is None:
        raise ArtifactError(f"prepared dataset '{dataset}' has no text column, which text_erm reads")
    generator = setup_torch(seed)
    words = None  # with BERT's vocab.txt, the train split's words are not needed
    if cfg.vocab is None:
        words = build_vocab(prepared.text[prepared.mask("train")], cfg.vocab_size)
        if not words:
            raise ArtifactError(f"prepared dataset '{dataset}': the train split's text has no word tokens to build a vocabulary from")
    model = (TextClassifier(words, prepared.n_classes, cfg.dim, cfg.max_len, cfg.hidden) if cfg.encoder == "bag"
             else bert_classifier(words, prepared.n_classes, cfg, key))
    # SplitData.x holds the int64 token ids; the loop only indexes it and feeds it to the model.
    splits = {
        name: SplitData(x=model.encode(prepared.text[prepared.mask(name)]), y=s.y, g=s.g)
        for name, s in split_data(prepared).items()
    }
    result = fit_classifier(model, splits, cross_entropy, FitOptions.from_config(cfg), generator, desc=desc,
                            checkpoint=checkpoint)
    model.load_state_dict(result.state_dict)
    return model.eval(), result


def bert_classifier(words: list[str] | None, n_classes: int, cfg: TextErmConfig, key: str) -> nn.Module:
    """A BertTextClassifier sized by `cfg`: over `words` (the train split's), or over BERT's
    vocab.txt `cfg.vocab`; started from `cfg.weights` when set (its position table as long as
    the file's, so a 512-position checkpoint fits whatever `max_len`). Its `files` attribute
    records {"weights"/"vocab": {"path", "sha256"}} of the files read, for config.json."""
    from stages.core.provenance import file_sha256
    from stages.models.external import file_shapes
    from stages.models.text import BertTextClassifier, read_bert_vocab

    files: dict[str, dict[str, str]] = {}
    tokenizer, lowercase = "words", True
    if cfg.vocab is not None:
        tokenizer = "wordpiece"
        words, lowercase = read_bert_vocab(cfg.vocab, f"{key}.vocab")
        files["vocab"] = {"path": str(cfg.vocab), "sha256": file_sha256(cfg.vocab)}
    assert words is not None  # the train split's, without vocab.txt
    positions = cfg.max_len
    if cfg.weights is not None:
        shapes = file_shapes(cfg.weights)
        table = shapes.get("bert.embeddings.position_embeddings.weight", shapes.get("embeddings.position_embeddings.weight"))
        positions = max(positions, table[0]) if table else positions
    model = BertTextClassifier(words, n_classes, cfg.dim, cfg.max_len, cfg.hidden, cfg.layers, cfg.heads,
                               cfg.intermediate, tokenizer, lowercase, positions)
    if cfg.weights is not None:
        files["weights"] = {"path": str(cfg.weights), "sha256": model.load_bert(cfg.weights, f"{key}.weights")}
    model.files = files
    return model


def train(job: Any) -> Any:
    """`train_text`; config.json records the architecture without the vocabulary (which lives
    in model.safetensors' metadata), only its size, and the path and sha256 of the weights and
    vocab files a BERT encoder was built from (`weights`, `vocab`)."""
    from stages.models.training import epoch_trained

    ckpt = job.checkpointer()
    model, result = train_text(job.prepared, job.cfg, job.seed, desc=job.desc, checkpoint=ckpt, key=job.key)
    arch = {k: v for k, v in model.arch().items() if k != "vocab"}
    return epoch_trained(model, result, job.cfg.selection, ckpt, architecture={**arch, "vocab_words": len(model.vocab)},
                         **getattr(model, "files", {}))


register_method("text_erm", TextErmConfig, train, reads_text=True, model="text")
