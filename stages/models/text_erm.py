"""The discriminative text baseline `text_erm`: a bag-of-embeddings classifier over word tokens.

`TextClassifier` (stages/models/text.py) over the `text` column, its vocabulary the train
split's most frequent words. `train_text` trains it with the shared loop
`stages.models.training.fit_classifier` (selection, history, checkpoints as for every
epoch-trained method). A mean of embeddings is blind to word order, so on templated text with
negations it can read the content only up to the negation rate — the discriminative
counterpart of an order-aware generative classifier over the same text's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.models.text import TextClassifier
from stages.registry import register_method
from stages.schema import Checks, option, train_and_selection_splits
from stages.text import build_vocab

if TYPE_CHECKING:
    from stages.checkpoint import Checkpointer
    from stages.models.training import FitResult


@dataclass
class TextErmConfig:
    """Discriminative text baseline: ERM of a bag-of-embeddings classifier over the word tokens of
    a text dataset's `text` column (vocabulary from the train split); needs a text dataset."""

    kind: str = option("method family")
    vocab_size: int = option("most frequent train words given an embedding (others share the unknown token)")
    max_len: int = option("word tokens read per example (longer text is truncated)")
    dim: int = option("embedding width")
    hidden: list[int] = option("ReLU layer widths between the mean embedding and the linear head ([] = linear)")
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
        c.minibatch(self)



def train_text(
    prepared: Any, cfg: TextErmConfig, seed: int, desc: str = "train text_erm", checkpoint: Checkpointer | None = None
) -> tuple[Any, FitResult]:
    """Fit a TextClassifier (TextErmConfig `cfg`) by ERM on the train split's `text`.

    The vocabulary is the `cfg.vocab_size` most frequent train words (`build_vocab`); every
    split's text is encoded to token ids and the shared loop `training.fit_classifier` trains
    with cross-entropy and selects the epoch by `cfg.selection` (with `checkpoint`, resumable
    byte-identically). Returns (model holding the selected weights, in eval mode; FitResult). A prepared
    dataset without a `text` column, or whose train text has no tokens, is an ArtifactError
    (stages.train checks the first before this, naming the method and dataset).
    """
    from stages.io import ArtifactError
    from stages.models.training import (
        FitOptions,
        SplitData,
        cross_entropy,
        fit_classifier,
        split_data,
    )
    from stages.runtime import setup_torch

    dataset = prepared.meta.get("dataset", "?")
    if getattr(prepared, "text", None) is None:
        raise ArtifactError(f"prepared dataset '{dataset}' has no text column, which text_erm reads")
    generator = setup_torch(seed)
    vocab = build_vocab(prepared.text[prepared.mask("train")], cfg.vocab_size)
    if not vocab:
        raise ArtifactError(f"prepared dataset '{dataset}': the train split's text has no word tokens to build a vocabulary from")
    model = TextClassifier(vocab, prepared.n_classes, cfg.dim, cfg.max_len, cfg.hidden)
    # SplitData.x holds the int64 token ids; the loop only indexes it and feeds it to the model.
    splits = {
        name: SplitData(x=model.encode(prepared.text[prepared.mask(name)]), y=s.y, g=s.g)
        for name, s in split_data(prepared).items()
    }
    result = fit_classifier(model, splits, cross_entropy, FitOptions.from_config(cfg), generator, desc=desc,
                            checkpoint=checkpoint)
    model.load_state_dict(result.state_dict)
    return model.eval(), result


def train(job: Any) -> Any:
    """`train_text`; config.json records the architecture without the vocabulary (which lives
    in model.safetensors' metadata), only its size."""
    from stages.models.training import epoch_trained

    ckpt = job.checkpointer()
    model, result = train_text(job.prepared, job.cfg, job.seed, desc=job.desc, checkpoint=ckpt)
    arch = {k: v for k, v in model.arch().items() if k != "vocab"}
    return epoch_trained(model, result, job.cfg.selection, ckpt, architecture={**arch, "vocab_words": len(model.vocab)})


register_method("text_erm", TextErmConfig, train, reads_text=True, model="text")
