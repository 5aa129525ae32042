"""A class-conditional autoregressive model used as a classifier (method kind `autoregressive`).

An input becomes a sequence of discrete tokens (a `Tokenizer`); a causal transformer
reads [class token y, tok_1, ..., tok_{L−1}] and predicts tok_1..tok_L, so

    log p(x̃ | y) = Σ_j log p(tok_j | tok_<j, y)        (x̃ = the tokenised input)

is exact. The class score is log p(x̃ | y) + log π_y (π from train label counts), and **the
logits written to predictions are these joint log-probabilities** (nats): softmax of them
is the model's posterior p(y | x̃). All classes of a batch go through one forward (n·K
sequences). `log_likelihood(x)` = log Σ_y exp(logits) = log p(x̃), the model's likelihood of
the tokenised input (a discrete distribution over bins, so it is ≤ 0).

Tokenizers (the `Tokenizer` protocol: `encode(x) -> (tokens, mask)`, `vocab_size`,
`seq_len`, `arch()`; their parameters are buffers saved with the model):

- `QuantileTokenizer` — vectors/pixels: feature j becomes bin index 0..bins−1, with
  bins−1 edges per feature either at the train split's quantiles (`quantile`) or evenly
  over its train range (`uniform`). L = number of features.
- `ByteTokenizer` — text: UTF-8 bytes (0..255) then an end token (256), truncated to
  `max_len` tokens, padding masked out of the sum. Used on a prepared text dataset's `text`
  column when `method.autoregressive.input` is `text` (or `auto`, the default, and the
  dataset has text); such a model's `input` is "text" and evaluate passes it the strings.

The network (`net`): `shiftlab`, the small pre-norm transformer below (`CausalBlock`), or
`gpt2`, transformers' `GPT2LMHeadModel` built from a `GPT2Config` of the same sizes (d_model,
layers, heads, ff; vocabulary = the tokenizer's, positions = its sequence length), fed the
class embedding in place of the first token's — the same conditioning. Its output head is not
tied to the token embedding. `weights` starts a gpt2 net from a local safetensors GPT-2
state_dict (`GPT2Model`'s names, or `GPT2LMHeadModel`'s under `transformer.`): every block and
the final norm must fit, while the token embedding, position table and output head are loaded
only where they fit — a real GPT-2's 50257 BPE embeddings do not index our bytes or bins, so
they keep their fresh initialisation (the output head is copied from a loaded token embedding,
GPT-2's tying, when the file has none); its position table is kept whole (1024 rows), inputs
still use the first `seq_len`. The class embedding always starts fresh.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stages.core.registry import register_model
from stages.models.autoregressive import BIN_EDGES, NETS
from stages.models.generative import log_priors, logsumexp_np

# The attention kernel of the gpt2 net, named rather than left to transformers' default (which
# may change with the installed versions): torch's scaled_dot_product_attention, as CausalBlock
# uses, deterministic on the CPU.
ATTENTION = "sdpa"


class Tokenizer(Protocol):
    """Turns raw inputs into fixed-width token ids plus a mask of the real tokens."""

    kind: str
    vocab_size: int
    seq_len: int

    def encode(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 (n, seq_len), mask bool (n, seq_len)); masked-out tokens are padding."""
        ...

    def arch(self) -> dict[str, Any]:
        """Constructor arguments, saved in the model's metadata."""
        ...


class QuantileTokenizer(nn.Module):
    """Per-feature quantisation into `bins` bins; `edges` (d, bins − 1) is a buffer."""

    kind = "quantile"

    def __init__(self, dim: int, bins: int, edges: str = "quantile") -> None:
        super().__init__()
        if bins < 2:
            raise ValueError(f"bins must be >= 2, got {bins}")
        if edges not in BIN_EDGES:
            raise ValueError(f"edges must be one of {list(BIN_EDGES)}, got '{edges}'")
        self.dim, self.bins, self.edge_rule = int(dim), int(bins), edges
        self.vocab_size, self.seq_len = self.bins, self.dim
        self.register_buffer("edges", torch.zeros(self.dim, self.bins - 1))

    def arch(self) -> dict[str, Any]:
        return {"tokenizer": self.kind, "bins": self.bins, "bin_edges": self.edge_rule}

    @torch.no_grad()
    def fit(self, x: torch.Tensor) -> QuantileTokenizer:
        """Set the edges from train inputs `x` (n, d)."""
        x64 = x.double()
        inner = torch.arange(1, self.bins, dtype=torch.float64) / self.bins  # (bins − 1,)
        if self.edge_rule == "quantile":
            edges = torch.quantile(x64, inner, dim=0).T  # (d, bins − 1)
        else:
            lo, hi = x64.min(0).values, x64.max(0).values
            edges = lo[:, None] + (hi - lo)[:, None] * inner[None, :]
        self.edges.copy_(edges.float())
        return self

    def encode(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float() if isinstance(x, torch.Tensor) else torch.tensor(np.asarray(x, dtype=np.float32))
        x = x.to(self.edges.device)
        # Bin = number of edges <= value, so equal (degenerate) edges just leave bins empty.
        tokens = torch.searchsorted(self.edges, x.T.contiguous(), right=True).T
        return tokens.contiguous(), torch.ones_like(tokens, dtype=torch.bool)


class ByteTokenizer(nn.Module):
    """UTF-8 bytes + an end token, truncated/padded to `max_len`."""

    kind = "bytes"
    END = 256

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.vocab_size, self.seq_len = 257, int(max_len)

    def arch(self) -> dict[str, Any]:
        return {"tokenizer": self.kind, "max_len": self.seq_len}

    def pack(self, texts: Sequence[str]) -> torch.Tensor:
        """Pre-encoded ids (int64, (n, seq_len)) with −1 for padding: a tensor `encode` accepts
        back and training can index by rows (strings cannot be)."""
        tokens, mask = self.encode(texts)
        return tokens.masked_fill(~mask, -1)

    def encode(self, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, torch.Tensor) and x.dtype == torch.int64:  # from `pack`
            return x.clamp(min=0), x >= 0
        texts: Sequence[str] = list(x)
        tokens = torch.zeros(len(texts), self.seq_len, dtype=torch.int64)
        mask = torch.zeros(len(texts), self.seq_len, dtype=torch.bool)
        for i, text in enumerate(texts):
            ids = [*text.encode("utf-8")[: self.seq_len - 1], self.END]
            tokens[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = True
        return tokens, mask


def build_tokenizer(arch: dict[str, Any], dim: int) -> nn.Module:
    """The tokenizer described by a model's metadata (`tokenizer` and its arguments)."""
    if arch.get("tokenizer") == "quantile":
        return QuantileTokenizer(dim, int(arch["bins"]), str(arch["bin_edges"]))
    if arch.get("tokenizer") == "bytes":
        return ByteTokenizer(int(arch["max_len"]))
    raise ValueError(f"unknown tokenizer {arch.get('tokenizer')!r} (expected 'quantile' or 'bytes')")


class CausalBlock(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, ff), nn.GELU(), nn.Linear(ff, d_model))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return h + self.mlp(self.ln2(h))


@register_model("autoregressive")
class AutoregressiveClassifier(nn.Module):
    """Tokenizer + class-conditional causal transformer; scores as in the module docstring."""

    on_accelerator = True  # every tensor it makes follows its inputs' or buffers' device (training.place)

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        tokenizer: nn.Module,
        d_model: int = 32,
        layers: int = 2,
        heads: int = 2,
        ff: int = 64,
        score_rows: int = 2048,
        net: str = "shiftlab",
        positions: int | None = None,
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        if net not in NETS:
            raise ValueError(f"net must be one of {list(NETS)}, got {net!r}")
        self.in_dim, self.n_classes = int(in_dim), int(n_classes)
        self.d_model, self.n_layers, self.heads, self.ff = int(d_model), int(layers), int(heads), int(ff)
        self.score_rows = int(score_rows)
        self.tokenizer = tokenizer
        self.net = net
        seq_len = tokenizer.seq_len
        self.positions = int(positions) if positions is not None else seq_len
        if self.positions < seq_len:
            raise ValueError(f"positions ({self.positions}) must be >= the sequence length ({seq_len})")
        if net == "gpt2":
            self.gpt2, self.class_embedding = gpt2_network(tokenizer.vocab_size, self.positions, self.n_classes,
                                                           self.d_model, self.n_layers, self.heads, self.ff)
        else:
            self.token_embedding = nn.Embedding(tokenizer.vocab_size, self.d_model)
            self.class_embedding = nn.Embedding(self.n_classes, self.d_model)
            self.position = nn.Parameter(torch.randn(seq_len, self.d_model) * 0.02)
            self.blocks = nn.ModuleList([CausalBlock(self.d_model, self.heads, self.ff) for _ in range(self.n_layers)])
            self.ln_f = nn.LayerNorm(self.d_model)
            self.head = nn.Linear(self.d_model, tokenizer.vocab_size)
        self.register_buffer(
            "log_priors", torch.full((self.n_classes,), -math.log(self.n_classes), dtype=torch.float64)
        )
        self._cache: tuple[bytes, np.ndarray] | None = None

    @property
    def input(self) -> str:
        """What `logits`/`log_likelihood` take: "text" (strings, the prepared `text` column) or "x"."""
        return "text" if self.tokenizer.kind == "bytes" else "x"

    def arch(self) -> dict[str, Any]:
        """The architecture arguments `load_model` rebuilds this model from (a shiftlab net's
        metadata has no `net` key: files written before gpt2 existed read as they were)."""
        net = {} if self.net == "shiftlab" else {"net": self.net, "positions": self.positions, "attention": ATTENTION}
        return {
            "kind": self.kind, "in_dim": self.in_dim, "n_classes": self.n_classes, "d_model": self.d_model,
            "layers": self.n_layers, "heads": self.heads, "ff": self.ff, "score_rows": self.score_rows,
            **net, **self.tokenizer.arch(),
        }

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> AutoregressiveClassifier:
        """Rebuild from `arch()` metadata (KeyError/ValueError when it does not fit)."""
        in_dim = int(arch["in_dim"])
        net = str(arch.get("net", "shiftlab"))
        if net != "shiftlab" and arch["attention"] != ATTENTION:
            raise ValueError(f"attention {arch['attention']!r}: this version builds {ATTENTION!r}")
        return cls(
            in_dim, int(arch["n_classes"]), build_tokenizer(arch, in_dim), int(arch["d_model"]),
            int(arch["layers"]), int(arch["heads"]), int(arch["ff"]), int(arch["score_rows"]),
            net, int(arch["positions"]) if net != "shiftlab" else None,
        )

    def load_gpt2(self, path: str | os.PathLike[str], key: str) -> str:
        """Start the gpt2 net from safetensors `path` (named by config key `key`; see the module
        docstring for what must fit and what is skipped); the file's sha256. A missing file or an
        unfitting block is a one-line ArtifactError naming the file and `key`."""
        from stages.models.external import file_shapes, load_external

        if self.net != "gpt2":
            raise ValueError(f"{key}: only a gpt2 net loads GPT-2 weights (this one is {self.net})")
        shapes = file_shapes(path)
        prefix = "transformer." if any(k.startswith("transformer.") for k in shapes) else ""
        body = self.gpt2.transformer.state_dict()
        optional = ("wte.", "wpe.")
        skip = [k for k in body if k.startswith(optional) and shapes.get(prefix + k) != tuple(body[k].shape)]
        digest = load_external(self.gpt2.transformer, path, key, skip=skip, prefix=prefix)
        head = self.gpt2.lm_head.weight
        source = "lm_head.weight" if shapes.get("lm_head.weight") == tuple(head.shape) else None
        with torch.no_grad():
            if source is not None:
                load_external(self.gpt2, path, key, skip=[k for k in self.gpt2.state_dict() if k != source])
            elif "wte.weight" not in skip and self.gpt2.transformer.wte.weight.shape == head.shape:
                head.copy_(self.gpt2.transformer.wte.weight)  # GPT-2 ties its output head to wte
        return digest

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: one sequence per class through the
        blocks (projections, causal attention, MLP) and the output head (either net); forward_passes: K."""
        n, d, f, v = self.tokenizer.seq_len, self.d_model, self.ff, self.tokenizer.vocab_size
        attention = n * (n + 1) // 2 * d * 2  # QKᵀ and AV over the causal triangle
        per_seq = self.n_layers * (n * (4 * d * d + 2 * d * f) + attention) + n * d * v
        params = sum(t.numel() for t in self.state_dict().values())
        return {"params": int(params), "macs": int(per_seq * self.n_classes), "forward_passes": self.n_classes}

    def sequence_log_prob(self, tokens: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Σ_j log p(tok_j | tok_<j, y) over the real tokens (float32, (B,))."""
        if self.net == "gpt2":
            inp = torch.cat([self.class_embedding(y)[:, None], self.gpt2.transformer.wte(tokens[:, :-1])], dim=1)
            logits = self.gpt2(inputs_embeds=inp, use_cache=False).logits
        else:
            inp = torch.cat([self.class_embedding(y)[:, None], self.token_embedding(tokens[:, :-1])], dim=1)
            h = inp + self.position[: tokens.shape[1]]
            for block in self.blocks:
                h = block(h)
            logits = self.head(self.ln_f(h))
        logp = F.log_softmax(logits, dim=-1)
        return (logp.gather(2, tokens.unsqueeze(2)).squeeze(2) * mask).sum(1)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean negative log-likelihood per real token of a batch of raw inputs given their labels."""
        tokens, mask = self.tokenizer.encode(batch["x"])
        return -self.sequence_log_prob(tokens, mask, batch["y"]).sum() / mask.sum()

    @torch.no_grad()
    def token_nll(self, x: Any, y: torch.Tensor, chunk: int = 1024) -> float:
        """The training loss (`loss`) over a whole split given its labels: negative log-likelihood per
        real token, Σ over the split / its tokens (the val objective in history; one sequence per
        example, no per-class scoring)."""
        total, count = 0.0, 0.0
        device = self.log_priors.device
        for i in range(0, len(y), chunk):
            tokens, mask = self.tokenizer.encode(x[i : i + chunk])
            tokens, mask = tokens.to(device), mask.to(device)
            total -= float(self.sequence_log_prob(tokens, mask, y[i : i + chunk].to(device)).double().sum())
            count += float(mask.sum())
        return total / max(count, 1.0)

    def class_log_probs(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """log p(x̃ | y) for every class (float64, (n, K)): all n·K sequences in one forward."""
        n, k = len(tokens), self.n_classes
        rows_y = torch.arange(k, device=tokens.device).repeat(n)
        lp = self.sequence_log_prob(tokens.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), rows_y)
        return lp.view(n, k).double()

    @torch.no_grad()
    def joint(self, x: Any) -> np.ndarray:
        """log p(x̃, y) = log p(x̃ | y) + log π_y (float64, (n, K))."""
        was_training = self.training
        self.eval()
        try:
            device = self.log_priors.device
            tokens, mask = self.tokenizer.encode(x.to(device) if isinstance(x, torch.Tensor) else x)
            tokens, mask = tokens.to(device), mask.to(device)
            chunk = max(1, self.score_rows // self.n_classes)
            out = [self.class_log_probs(tokens[i : i + chunk], mask[i : i + chunk]) for i in range(0, len(tokens), chunk)]
            scores = torch.cat(out) if out else torch.zeros(0, self.n_classes, dtype=torch.float64, device=device)
            return (scores + self.log_priors).cpu().numpy()
        finally:
            self.train(was_training)

    def train(self, mode: bool = True) -> AutoregressiveClassifier:
        self._cache = None  # weights are about to change (or just did)
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._cache = None

    def _cached_joint(self, x: Any) -> np.ndarray:
        """`joint(x)`, remembered for the last input so logits + log_likelihood score once."""
        if isinstance(self.tokenizer, QuantileTokenizer):
            x = np.ascontiguousarray(x, dtype=np.float32)
            if x.ndim != 2 or x.shape[1] != self.in_dim:
                from stages.core.io import ArtifactError

                raise ArtifactError(f"model expects inputs of shape (n, {self.in_dim}), got {x.shape}")
            key = hashlib.sha256(x.tobytes()).digest() + str(x.shape).encode()
        else:
            key = hashlib.sha256("\0".join(map(str, x)).encode()).digest()
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.joint(x))
        return self._cache[1]

    def logits(self, x: Any, batch_size: int = 2048) -> np.ndarray:
        """log p(x̃, y) (float32, (n, K)); softmax gives p(y | x̃). Scored in chunks of `score_rows` sequences."""
        return self._cached_joint(x).astype(np.float32)

    def log_likelihood(self, x: Any) -> np.ndarray:
        """log p(x̃) = log Σ_y p(x̃, y) per example (float64, (n,))."""
        return logsumexp_np(self._cached_joint(x))


def gpt2_network(vocab_size: int, positions: int, n_classes: int, d_model: int, layers: int, heads: int,
                 ff: int) -> tuple[nn.Module, nn.Embedding]:
    """transformers' GPT2LMHeadModel of these sizes (output head untied, no special tokens: the
    tokenizer has none) and a class embedding initialised as GPT-2 initialises its embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=positions, n_embd=d_model, n_layer=layers, n_head=heads,
                        n_inner=ff, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                        attn_implementation=ATTENTION)
    network = GPT2LMHeadModel(config)
    classes = nn.Embedding(n_classes, d_model)
    nn.init.normal_(classes.weight, std=config.initializer_range)
    return network, classes


def uses_text(prepared: Any, cfg: Any) -> bool:
    """Whether `cfg.input` (auto | x | text; auto = text when the dataset has a text column) picks text."""
    choice = getattr(cfg, "input", "auto")
    has_text = getattr(prepared, "text", None) is not None
    if choice == "text" and not has_text:
        raise ValueError("method.autoregressive.input=text but the prepared dataset has no text column")
    return choice == "text" or (choice == "auto" and has_text)


def train_autoregressive(
    prepared: Any, cfg: Any, seed: int, desc: str = "train autoregressive", checkpoint: Any = None,
    key: str = "method.autoregressive",
) -> tuple[AutoregressiveClassifier, Any]:
    """Fit an AutoregressiveClassifier (AutoregressiveConfig `cfg`) on the train split's
    quantised features, or on the UTF-8 bytes of its `text` column (`uses_text`; truncated to
    `cfg.max_len` tokens); select by `cfg.selection`. Returns (model with the selected weights,
    its `files` the {"weights": {"path", "sha256"}} it started from, if any; FitResult). With
    `checkpoint` (a `stages.core.checkpoint.Checkpointer`) training resumes byte-identically. A missing
    or unfitting weights file is an ArtifactError naming it and `key`.weights."""
    from stages.core.runtime import setup_torch
    from stages.models.generative import GenerativeFitOptions, fit_generative
    from stages.models.training import SplitData, split_data

    generator = setup_torch(seed)
    splits = split_data(prepared)
    train = splits["train"]
    dim = prepared.x.shape[1]
    tokenizer: nn.Module
    if uses_text(prepared, cfg):
        tokenizer = ByteTokenizer(cfg.max_len)
        splits = {
            name: SplitData(x=tokenizer.pack(prepared.text[prepared.mask(name)]), y=s.y, g=s.g)
            for name, s in splits.items()
        }
    else:
        tokenizer = QuantileTokenizer(dim, cfg.bins, cfg.bin_edges).fit(train.x)
    # a config built by hand without these keys (as `input` above) is the shiftlab net from scratch
    net, weights = getattr(cfg, "net", "shiftlab"), getattr(cfg, "weights", None)
    positions = None
    if weights is not None:  # keep the file's whole position table, so it fits
        from stages.models.external import file_shapes

        shapes = file_shapes(weights)
        rows = shapes.get("transformer.wpe.weight", shapes.get("wpe.weight", (0,)))[0]
        positions = max(tokenizer.seq_len, rows)
    model = AutoregressiveClassifier(dim, prepared.n_classes, tokenizer, cfg.d_model, cfg.layers, cfg.heads, cfg.ff,
                                     net=net, positions=positions)
    model.files = {}
    if weights is not None:
        model.files["weights"] = {"path": str(weights), "sha256": model.load_gpt2(weights, f"{key}.weights")}
    with torch.no_grad():
        model.log_priors.copy_(log_priors(train.y, prepared.n_classes))

    def scorer(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(model.joint(x))

    opts = GenerativeFitOptions.from_config(cfg)
    result = fit_generative(model, splits, model.loss, scorer, opts, generator, desc, checkpoint=checkpoint,
                            val_objective=lambda s: model.token_nll(s.x, s.y))
    return model, result


def train(job: Any) -> Any:
    """`train_autoregressive`, resumable like every epoch-trained method; config.json records the
    path and sha256 of the GPT-2 weights file a gpt2 net started from (`weights`)."""
    from stages.models.training import epoch_trained

    ckpt = job.checkpointer()
    model, result = train_autoregressive(job.prepared, job.cfg, job.seed, desc=job.desc, checkpoint=ckpt, key=job.key)
    return epoch_trained(model, result, job.cfg.selection, ckpt, **model.files)
