"""`autoregressive`: a class-conditional autoregressive model used as a classifier — its config
and registration.

The model, its tokenizers and its training: stages/models/autoregressive_model.py (imported only
when the method trains or a model is loaded, so validating a config never imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.registry import register_method
from stages.core.schema import Checks, option
from stages.models.schemas import GenerativeFitConfig


@dataclass
class AutoregressiveConfig(GenerativeFitConfig):
    """Class-conditional causal transformer over quantised features: class score = Σ log p(token | prefix, y) + log prior."""

    bins: int = option("quantisation bins per feature (the token vocabulary)")
    bin_edges: str = option("bin edges per feature: quantile (train quantiles) | uniform (over the train range)")
    d_model: int = option("transformer width")
    layers: int = option("transformer blocks")
    heads: int = option("attention heads (must divide d_model)")
    ff: int = option("hidden width of each block's MLP")
    input: str = option("tokens from: auto (text when the dataset has a text column, else x) | x (quantised features) | text (UTF-8 bytes)")
    max_len: int = option("text input: byte tokens per example incl. the end token (longer text is truncated)")
    net: str = option("the causal transformer: shiftlab (small pre-norm blocks) | gpt2 (transformers' GPT2LMHeadModel, same sizes)")
    weights: str | None = option("gpt2: local safetensors file of a GPT-2 state_dict to start from (null = from scratch)")

    def check(self, c: Checks) -> None:
        super().check(c)
        c.choice(self.net, "net", NETS)
        c.require(self.weights is None or self.net == "gpt2", "weights",
                  f"only net=gpt2 reads a weights file (net is '{self.net}'); set it to null")
        c.choice(self.input, "input", ["auto", "x", "text"])
        c.require(self.max_len >= 2, "max_len", f"must be >= 2, got {self.max_len}")
        c.require(self.bins >= 2, "bins", f"must be >= 2, got {self.bins}")
        c.choice(self.bin_edges, "bin_edges", ["quantile", "uniform"])
        c.require(self.d_model >= 1, "d_model", f"must be >= 1, got {self.d_model}")
        c.require(self.layers >= 1, "layers", f"must be >= 1, got {self.layers}")
        c.require(self.heads >= 1 and self.d_model % max(self.heads, 1) == 0, "heads",
                  f"must be >= 1 and divide d_model={self.d_model}, got {self.heads}")
        c.require(self.ff >= 1, "ff", f"must be >= 1, got {self.ff}")


BIN_EDGES = ("quantile", "uniform")


NETS = ("shiftlab", "gpt2")


register_method("autoregressive", AutoregressiveConfig, "stages.models.autoregressive_model:train", generative=True, model="autoregressive")
