"""Image classifiers from timm (model kind `backbone`): a timm network, built by name from the
config of an MLP-trained discriminative method (its keys `backbone` and `weights`,
stages/models/discriminative.py) in place of the hand-written MLP.

The network sees the prepared image as it is: flat `x` is reshaped to (n, C, H, W) by the
file's `shape`, each channel normalised, then `timm.create_model(name, pretrained=False,
num_classes=<classes>, in_chans=C)` runs at the prepared H × W (plus `img_size=(H, W)` for the
models whose input size is fixed, e.g. ViTs). Nothing is resized and nothing downloads.

- Normalisation: a per-channel mean and std kept as buffers, so model.safetensors is
  self-contained. With `weights`, the ones those weights were trained with (timm's
  `pretrained_cfg`: ImageNet's for most names; a tagged name such as `resnet50.a1_in1k` takes
  that tag's); without, the train split's own per-channel statistics.
- Global average pools (AdaptiveAvgPool2d to 1×1) are computed as a mean over H and W
  (`GlobalMean`, no tensors): under runtime.deterministic, AdaptiveAvgPool2d's backward raises
  on CUDA.
- `weights`: a local safetensors file of the timm network's state_dict, e.g. written where the
  weights can be had with `safetensors.torch.save_file(timm.create_model(name,
  pretrained=True).state_dict(), path)`. Every tensor except the classifier head
  (`pretrained_cfg["classifier"]`, which keeps its seeded initialisation for the task's
  classes) is loaded through `stages.models.external.load_external`; a missing file, a pickle,
  a tensor of another shape or a tensor this network lacks is a one-line error naming the file.
  Where the weights depend on the input size (a ViT's position embeddings) the dataset's image
  size must be theirs. config.json records `weights: {path, sha256}`.
- model.safetensors holds the whole network; its metadata (`arch()`: the timm name, the input
  shape, the classes) rebuilds it, so evaluate and distill never need the weights file.

- Last-layer retraining (DFR, `features: <a method training this kind>`) reads `embed` (the
  pooled features the classifier head reads) and puts its head in place of the network's own
  (`with_head`): the DFR model is then a model of this kind too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from stages.core.registry import register_model
from stages.core.schema import ConfigError
from stages.models.nets import Standardize, batched_logits
from stages.models.timm_catalog import LIBRARY, MLP, name_problem

if TYPE_CHECKING:
    from stages.core.artifacts import Prepared
    from stages.core.stream import PreparedFile

STATS_ROWS = 256  # train images per batch when the normalisation statistics are computed (150 MB at 3×224×224)


def image_shape(prepared: Prepared | PreparedFile, name: str, key: str) -> tuple[int, int, int]:
    """The prepared images' (C, H, W); ConfigError naming `key`.backbone on a dataset of other inputs."""
    shape = prepared.meta.get("shape")
    if not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(s, int) and s > 0 for s in shape):
        dataset = prepared.meta.get("dataset", "?")
        raise ConfigError(
            f"params.yaml: {key}.backbone: the timm model '{name}' needs an image dataset (prepared `shape` "
            f"[C, H, W]), dataset '{dataset}' has shape {shape}; use {key}.backbone={MLP} there"
        )
    c, h, w = shape
    return c, h, w


def create_network(name: str, in_chans: int, size: tuple[int, int], n_classes: int) -> nn.Module:
    """`timm.create_model` with no download: `n_classes` outputs, `in_chans` input channels, and
    `img_size=size` where the model's input size is fixed (its default pretrained config says so)."""
    import timm
    from timm.models import get_pretrained_cfg

    kwargs: dict[str, Any] = {"pretrained": False, "num_classes": int(n_classes), "in_chans": int(in_chans)}
    cfg = get_pretrained_cfg(name, allow_unregistered=True)
    if cfg is not None and getattr(cfg, "fixed_input_size", False):
        kwargs["img_size"] = tuple(size)
    net = timm.create_model(name, **kwargs)
    _global_means(net)
    return net


class GlobalMean(nn.Module):
    """`nn.AdaptiveAvgPool2d(1)` as a mean over H and W: the same numbers, and a backward pass
    that is deterministic on CUDA too (AdaptiveAvgPool2d's raises under deterministic algorithms,
    runtime.deterministic)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(-2, -1), keepdim=True)


def _global_means(net: nn.Module) -> None:
    """Swap every global average pool (AdaptiveAvgPool2d to 1×1, e.g. a ResNet's) for `GlobalMean`;
    it holds no tensors, so the state_dict is unchanged."""
    for name, module in list(net.named_modules()):
        if isinstance(module, nn.AdaptiveAvgPool2d) and module.output_size in (1, (1, 1)):
            parent, _, attr = name.rpartition(".")
            setattr(net.get_submodule(parent), attr, GlobalMean())


def head_prefixes(net: nn.Module) -> tuple[str, ...]:
    """State-dict name prefixes of the classifier head (`pretrained_cfg["classifier"]`), which a
    weights file made for other classes cannot fill."""
    names = getattr(net, "pretrained_cfg", {}).get("classifier")
    if not names:  # no declared head: the module timm's get_classifier() returns
        head = net.get_classifier()  # type: ignore[operator]
        names = [n for n, m in net.named_modules() if m is head]
    return tuple(f"{n}." for n in ([names] if isinstance(names, str) else names))


class ChannelNormalize(nn.Module):
    """x ↦ (x − mean_c) / std_c per channel of (n, C, H, W) images, statistics kept as buffers."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("std", torch.ones(channels))

    @torch.no_grad()
    def fit_batches(self, batches: Iterable[torch.Tensor], shape: Sequence[int]) -> ChannelNormalize:
        """Mean and std of each channel over every image and pixel of `batches` (flat rows of
        `shape`): `Standardize.fit_batches` over the pixels as rows of C values (float64, one
        pass); a constant channel keeps std 1."""
        c = int(shape[0])
        pixels = (x.reshape(x.shape[0], c, -1).transpose(1, 2).reshape(-1, c) for x in batches)
        fitted = Standardize(c).fit_batches(pixels)
        return self.set(fitted.mean, fitted.std)

    @torch.no_grad()
    def set(self, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> ChannelNormalize:
        """Use the given per-channel statistics (e.g. the ones pretrained weights expect)."""
        self.mean.copy_(torch.as_tensor(mean, dtype=torch.float64).float())
        self.std.copy_(torch.as_tensor(std, dtype=torch.float64).float())
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean[:, None, None]) / self.std[:, None, None]


def train_images(prepared: Prepared | PreparedFile) -> Iterator[torch.Tensor]:
    """The train split's inputs as float32 batches of flat rows: from memory, or one pass over the stream."""
    from stages.core.stream import PreparedFile, to_input

    if isinstance(prepared, PreparedFile):
        from stages.core.runtime import current

        yield from (to_input(x) for x in prepared.splits(["train"])["train"].x_batches(STATS_ROWS, current().workers))
        return
    x = prepared.subset("train").x
    for i in range(0, len(x), STATS_ROWS):
        yield torch.from_numpy(np.ascontiguousarray(x[i : i + STATS_ROWS], dtype=np.float32))


@register_model("backbone")
class TimmClassifier(nn.Module):
    """flat x → (n, C, H, W) → per-channel normalisation → a timm network with `n_classes` outputs."""

    on_accelerator = True  # runs on runtime.device (stages/models/training.py `place`)

    def __init__(self, name: str, shape: Sequence[int], n_classes: int) -> None:
        super().__init__()
        c, h, w = (int(s) for s in shape)
        self.model_name = str(name)
        self.shape = [c, h, w]
        self.in_dim = c * h * w
        self.n_classes = int(n_classes)
        self.normalize = ChannelNormalize(c)
        self.net = create_network(self.model_name, c, (h, w), self.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalize(x.reshape(x.shape[0], *self.shape)))

    @classmethod
    def from_arch(cls, meta: dict) -> TimmClassifier:
        """An untrained network of the architecture `arch()` recorded (ValueError when it does not fit)."""
        if meta.get("library") != LIBRARY:
            raise ValueError(f"metadata 'library' must be '{LIBRARY}', got {meta.get('library')!r}")
        name = meta.get("name")
        if not isinstance(name, str) or name == MLP or name_problem(name) is not None:
            raise ValueError(f"metadata 'name' must be a model name the installed timm knows, got {name!r}")
        shape = meta.get("shape")
        if not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            raise ValueError(f"metadata 'shape' must be [C, H, W] of positive integers, got {shape!r}")
        if int(np.prod(shape)) != meta["in_dim"]:
            raise ValueError(f"metadata 'in_dim' {meta['in_dim']} is not C·H·W of shape {shape}")
        return cls(name, shape, int(meta["n_classes"]))

    def arch(self) -> dict:
        """The architecture arguments `load_model` rebuilds this network from."""
        return {
            "kind": self.kind, "library": LIBRARY, "name": self.model_name, "shape": list(self.shape),
            "in_dim": self.in_dim, "n_classes": self.n_classes,
        }

    def logits(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """Class scores (float32, (n, n_classes)); softmax gives p(y | x)."""
        return batched_logits(self, x, self.in_dim, self.n_classes, batch_size)

    @torch.no_grad()
    def embed(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """The last hidden layer, what the classifier head reads (timm's `forward_head(...,
        pre_logits=True)`: the pooled features), float32 (n, num_features); in eval mode, on the
        model's device, in batches of at most 64 MB of input."""
        from stages.core.stream import batch_rows
        from stages.models.nets import model_device

        was_training = self.training
        self.eval()
        device, rows = model_device(self), batch_rows(self.in_dim, batch_size)
        try:
            out = []
            for i in range(0, len(x), rows):
                xb = torch.from_numpy(np.ascontiguousarray(x[i : i + rows], dtype=np.float32)).to(device)
                images = self.normalize(xb.reshape(xb.shape[0], *self.shape))
                out.append(self.net.forward_head(self.net.forward_features(images), pre_logits=True).float().cpu())
            dim = int(self.net.num_features)
            return torch.cat(out).numpy() if out else np.zeros((0, dim), dtype=np.float32)
        finally:
            self.train(was_training)

    def with_head(self, weight: np.ndarray, bias: np.ndarray) -> TimmClassifier:
        """A copy whose classifier head is (weight, bias) on the `embed` features (last-layer retraining)."""
        import copy

        model = copy.deepcopy(self)
        head = model.net.get_classifier()
        with torch.no_grad():
            head.weight.copy_(torch.from_numpy(np.asarray(weight)).float())
            head.bias.copy_(torch.from_numpy(np.asarray(bias)).float())
        return model.eval()

    @torch.no_grad()
    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: multiply-adds of the matrix products and
        convolutions (torch's FlopCounterMode, flops / 2: attention products included, elementwise
        operations and normalisations not) of one forward pass on one image of the input shape."""
        from torch.utils.flop_counter import FlopCounterMode

        params = sum(t.numel() for t in self.state_dict().values())
        was_training = self.training
        self.eval()
        try:
            with FlopCounterMode(display=False) as counter:
                self(torch.zeros(1, self.in_dim, device=self.normalize.mean.device))
        finally:
            self.train(was_training)
        return {"params": int(params), "macs": int(counter.get_total_flops() // 2), "forward_passes": 1}


def build(
    prepared: Prepared | PreparedFile, name: str, weights: str | os.PathLike[str] | None, key: str
) -> tuple[TimmClassifier, dict[str, Any]]:
    """A fresh TimmClassifier for `prepared` (timm initialisation from torch's seeded RNG), with
    `weights` loaded when given; and the keys it adds to config.json: `backbone` (library, name,
    timm version, normalisation) and, with weights, `weights: {path, sha256}`. `key` is the
    method's params key, for errors."""
    import timm

    from stages.models.external import load_external

    shape = image_shape(prepared, name, key)
    model = TimmClassifier(name, shape, prepared.n_classes)
    record: dict[str, Any] = {"library": LIBRARY, "name": name, "timm_version": timm.__version__}
    added: dict[str, Any] = {}
    if weights is None:
        model.normalize.fit_batches(train_images(prepared), shape)
        record["normalization"] = "train split, per channel"
    else:
        skip = head_prefixes(model.net)
        sha256 = load_external(model.net, weights, f"{key}.weights", skip=skip)
        _no_extra_tensors(model.net, weights, f"{key}.weights", skip)
        cfg = model.net.pretrained_cfg
        if len(cfg.get("mean") or ()) == shape[0] and len(cfg.get("std") or ()) == shape[0]:
            model.normalize.set(cfg["mean"], cfg["std"])
            record["normalization"] = f"the weights' (timm pretrained_cfg of {name})"
        else:  # e.g. weights adapted to one channel: timm's statistics are for three
            model.normalize.fit_batches(train_images(prepared), shape)
            record["normalization"] = f"train split, per channel (timm's pretrained_cfg of {name} has no {shape[0]}-channel statistics)"
        added["weights"] = {"path": str(weights), "sha256": sha256}
    record["mean"], record["std"] = model.normalize.mean.tolist(), model.normalize.std.tolist()
    return model, {"backbone": record, **added}


def _no_extra_tensors(net: nn.Module, path: str | os.PathLike[str], key: str, skip: tuple[str, ...]) -> None:
    """ArtifactError when the file holds tensors, outside the head, that `net` lacks: the weights
    of another network (a resnet34's file holds every tensor of a resnet18, and more)."""
    from safetensors import safe_open

    from stages.core.io import ArtifactError

    own = net.state_dict()
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())  # a safe_open handle is not iterable
    extra = sorted(k for k in names if not k.startswith(skip) and k not in own)
    if extra:
        raise ArtifactError(
            f"{path}: not weights of this network ({key}): {len(extra)} tensor(s) it lacks, e.g. {extra[:3]}"
        )
