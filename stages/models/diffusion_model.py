"""A class-conditional DDPM used as a classifier (method kind `diffusion`).

Model. Inputs are standardised with train statistics (buffers, as for every network here),
z = (x − mean) / std. The forward process is q(z_t | z) = N(√ᾱ_t z, (1 − ᾱ_t) I) for
t = 1..T with a `linear` (Ho et al. 2020, rescaled to T steps) or `cosine` (Nichol &
Dhariwal 2021) schedule of β_t. The denoiser ε_θ(z_t, t, y) predicts the noise: an MLP
with time and class embeddings for vectors, a small conv net for image-shaped inputs (the
prepared file's `shape`, e.g. [3, 8, 8]), or — `denoiser: unet`, the field's architecture at
scale — a class-conditional `diffusers.UNet2DModel` built from the `unet_*` keys, optionally
initialised from a local safetensors file (`weights`; see `UNetDenoiser`). It is trained with the simple loss
E‖ε_θ(z_t, t, y) − ε‖², t ~ U{1..T}; with `class_dropout` p a label is replaced by a
"null" class with probability p (classifier-free training; scoring always conditions).

Scoring. For every example, S = `draws` pairs (t_s, ε_s) are drawn — t_s stratified over
[1, T] (one draw per stratum, strata visited in van der Corput order so every prefix of the
draws is also spread over [1, T]) — and the SAME pairs are used for every class. All classes
× draws of a chunk of examples go through the denoiser in one batched forward. With
e_s(y) = ‖ε_θ(z_{t_s}, t_s, y) − ε_s‖²:

    simple:  score(y) = −(1/S) Σ_s e_s(y)
    elbo:    score(y) = −(T/S) Σ_s w(t_s) e_s(y),   w(t) = β_t / (2 α_t (1 − ᾱ_t))

`elbo` is a Monte-Carlo estimate of −Σ_t L_{t−1}, the y-dependent part of the negative
ELBO of log p(x | y) (decoder and reverse variances σ_t² = β_t); `simple` drops the weights
(Li et al. 2023 find it classifies better). **The logits written to predictions** are

    elbo:    score(y) + log π_y      (π from train label counts)
    simple:  score(y)                (no prior term)

`elbo` is a log-likelihood bound in nats, so adding log π_y is Bayes' rule and softmax of
the logits is the model's posterior with the ELBO standing in for log p(x | y). `simple` is
not on that scale: dropping w(t) rescales each timestep's term by 1/w(t), which varies with t
(about tenfold for `linear`, over four orders of magnitude for `cosine` at T = 100), so
−(1/S) Σ e_s(y) is no log-likelihood, and log π_y added to it would shift the argmax by an
arbitrary amount whenever the classes are imbalanced. `simple` therefore classifies by the error alone — the uniform-prior rule of Li et al. 2023, whose
code (github.com/diffusion-classifier/diffusion-classifier: `eval_prob_adaptive.py` keeps the
classes with the lowest mean ε-prediction error over shared (t, ε) draws, and
`scripts/print_dit_acc.py` takes the argmin of the mean error per class) has no prior term.
Softmax of `simple` logits is a uniform-prior posterior at an arbitrary temperature; ECE/NLL
of `simple` measure that temperature as well.

Adaptive pruning (`prune_keep` k > 0): every class is scored with the first `prune_draws`
draws, the k best are kept and scored with the remaining draws as well. A kept class's score
is then exactly its full-scoring score (same draws); a pruned class keeps its coarse score,
capped just below the lowest kept score so the prediction is always a kept class. Network
evaluations per example: K·S₁ + k·(S − S₁) instead of K·S.

Sequential elimination (`stop_se` k > 0; `prune_keep` > 0 takes its place): classes are dropped
per example as the draws go, once a test settles they would lose under full scoring
(stages/models/elimination.py: the rule, its tests, and what it fits on val).

`log_likelihood(x)` = log Σ_y exp(ELBO(x, y) + log π_y): the ELBO-weighted estimate of the
same draws plus the prior and decoder constants, in raw (unstandardised) units — a
stochastic lower-bound estimate of log p(x), comparable across examples of one model.

Determinism: the draws come from a generator seeded with `score_seed`, consumed in chunks
of a fixed number of examples (`score_rows` // (K·S)), so scores depend only on the model
and the inputs — not on the caller's batch size or the global RNG.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stages.core.registry import register_model
from stages.core.schema import Checks
from stages.models.diffusion import (
    IMAGE_DENOISERS,
    SCHEDULES,
    STOP_TESTS,
    UNET_HEAD_DIM,
    WEIGHTINGS,
    check_unet,
)
from stages.models.draw_order import draw_noise
from stages.models.elimination import SequentialElimination, fit_scoring
from stages.models.generative import LOG_2PI, log_priors, logsumexp_np
from stages.models.nets import Standardize

UNET_NETWORK = "diffusers.UNet2DModel"  # what arch() names for denoiser: unet


TIME_FEATURES = 32


MAX_BETA = 0.999


def noise_schedule(kind: str, steps: int) -> torch.Tensor:
    """β_1..β_T (float64, shape (T,)) of the `linear` or `cosine` schedule."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if kind == "linear":
        scale = 1000.0 / steps  # Ho et al.'s 1e-4..0.02 over 1000 steps, stretched to T steps
        return torch.linspace(scale * 1e-4, min(scale * 0.02, MAX_BETA), steps, dtype=torch.float64)
    if kind == "cosine":
        s = 0.008
        grid = torch.arange(steps + 1, dtype=torch.float64) / steps
        f = torch.cos((grid + s) / (1 + s) * math.pi / 2) ** 2
        alpha_bar = f / f[0]
        return (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=MAX_BETA)
    raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got '{kind}'")


def timestep_features(steps: int, dim: int = TIME_FEATURES) -> torch.Tensor:
    """Sinusoidal features of t = 0..T (float32, (T + 1, dim))."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(steps + 1, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class _Conditioning(nn.Module):
    """time_mlp(sinusoid(t)) + class_embedding(y), y == n_classes being the null class."""

    def __init__(self, steps: int, n_classes: int, width: int) -> None:
        super().__init__()
        self.register_buffer("features", timestep_features(steps), persistent=False)
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FEATURES, width), nn.SiLU(), nn.Linear(width, width))
        self.class_embedding = nn.Embedding(n_classes + 1, width)
        # While scoring (no gradients, fixed weights) the table is computed once per `score` call,
        # not once per forward: sequential elimination makes many small forwards.
        self.table: torch.Tensor | None = None

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The time MLP runs once over the T + 1 table, then rows index it.
        table = self.time_mlp(self.features) if self.table is None else self.table
        return table[t] + self.class_embedding(y)


class MLPDenoiser(nn.Module):
    """ε_θ for vectors: in-projection + conditioning, `depth` residual SiLU layers, out-projection."""

    def __init__(self, in_dim: int, n_classes: int, steps: int, width: int, depth: int) -> None:
        super().__init__()
        self.cond = _Conditioning(steps, n_classes, width)
        self.inp = nn.Linear(in_dim, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.out = nn.Linear(width, in_dim)

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(z_t) + self.cond(t, y)
        for layer in self.layers:
            h = h + layer(F.silu(h))
        return self.out(F.silu(h))


class ConvDenoiser(nn.Module):
    """ε_θ for (C, H, W) images: 3×3 convs with `width` channels, conditioning added per channel."""

    def __init__(self, shape: list[int], n_classes: int, steps: int, width: int, depth: int) -> None:
        super().__init__()
        self.shape = [int(s) for s in shape]
        c = self.shape[0]
        self.cond = _Conditioning(steps, n_classes, width)
        self.inp = nn.Conv2d(c, width, 3, padding=1)
        self.layers = nn.ModuleList([nn.Conv2d(width, width, 3, padding=1) for _ in range(depth)])
        self.out = nn.Conv2d(width, c, 3, padding=1)
        # oneDNN's CPU convolutions run ~2x faster channels-last (weights and activations);
        # load_state_dict copies into these tensors, so the layout survives loading.
        self.to(memory_format=torch.channels_last)

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = z_t.view(-1, *self.shape).contiguous(memory_format=torch.channels_last)
        h = self.inp(x) + self.cond(t, y)[:, :, None, None]
        for layer in self.layers:
            h = h + layer(F.silu(h))
        return self.out(F.silu(h)).flatten(1)


class UNetDenoiser(nn.Module):
    """ε_θ for (C, H, W) images: a class-conditional `diffusers.UNet2DModel`.

    One resolution block per `channels` entry (`AttnDownBlock2D`/`AttnUpBlock2D` where
    `attention` says so, else `DownBlock2D`/`UpBlock2D`); the middle block has attention when
    the deepest block has. The class embedding (`num_class_embeds`) is added to the timestep
    embedding, with one more row, the null class, when trained with class dropout. diffusers
    counts timesteps from 0 (its `alphas_cumprod[k]` is our ᾱ at t = k + 1), so the UNet sees
    t − 1: a UNet trained with diffusers' `DDPMScheduler` over the same schedule (linear
    β 1e-4..0.02 at T = 1000, or squaredcos_cap_v2 for `cosine`) means the same thing here.
    H and W are zero-padded (bottom, right) to a multiple of 2^(blocks − 1), the downsampling
    the UNet needs, and the output cropped back, so any image size works.
    """

    def __init__(
        self, shape: list[int], class_embeds: int, channels: list[int], layers_per_block: int,
        attention: list[bool], norm_groups: int,
    ) -> None:
        super().__init__()
        from diffusers.models.unets.unet_2d import UNet2DModel  # ~5 s to import: only on this path

        c = Checks()
        check_unet(c, channels, layers_per_block, attention, norm_groups)
        if c.errors:
            raise ValueError("; ".join(f"{k}: {m}" for k, m in c.errors))
        self.shape = [int(s) for s in shape]
        ch, h, w = self.shape
        m = 2 ** (len(channels) - 1)
        self.pad = ((-h) % m, (-w) % m)
        self.unet = UNet2DModel(
            sample_size=(h + self.pad[0], w + self.pad[1]), in_channels=ch, out_channels=ch,
            down_block_types=tuple("AttnDownBlock2D" if a else "DownBlock2D" for a in attention),
            up_block_types=tuple("AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention)),
            block_out_channels=tuple(channels), layers_per_block=layers_per_block, norm_num_groups=norm_groups,
            attention_head_dim=UNET_HEAD_DIM, add_attention=bool(attention[-1]), num_class_embeds=class_embeds,
        )

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, w = self.shape[1:]
        x = z_t.view(-1, *self.shape)
        if any(self.pad):
            x = F.pad(x, (0, self.pad[1], 0, self.pad[0]))
        out = self.unet(x, t - 1, class_labels=y).sample
        return out[:, :, :h, :w].reshape(len(z_t), -1)


def denoiser_flops(arch: dict[str, Any]) -> float:
    """Multiply-add FLOPs (2 per MAC) of one mlp or conv denoiser row, conditioning lookup excluded."""
    d, w, depth = arch["in_dim"], arch["width"], arch["depth"]
    if arch["denoiser"] == "conv":
        c, hgt, wid = arch["shape"]
        return 2.0 * hgt * wid * 9 * (c * w + depth * w * w + w * c)
    return 2.0 * (d * w + depth * w * w + w * d)


def counted_flops(denoiser: nn.Module, in_dim: int) -> int:
    """FLOPs of one denoiser row as torch's FlopCounterMode counts them (matrix products,
    convolutions and attention; 2 per multiply-add), at t = 1, class 0."""
    from torch.utils.flop_counter import FlopCounterMode

    p = next(denoiser.parameters())
    one = torch.ones(1, dtype=torch.long, device=p.device)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        denoiser(torch.zeros(1, in_dim, dtype=p.dtype, device=p.device), one, one - 1)
    return int(counter.get_total_flops())


def resolve_denoiser(denoiser: str, shape: list[int]) -> str:
    """`auto` → conv for (C, H, W) shapes, mlp otherwise."""
    if denoiser == "auto":
        return "conv" if len(shape) == 3 else "mlp"
    if denoiser in IMAGE_DENOISERS and len(shape) != 3:
        raise ValueError(f"denoiser '{denoiser}' needs a (C, H, W) input shape, the data has shape {shape}")
    return denoiser


@register_model("diffusion")
class DiffusionClassifier(SequentialElimination, nn.Module):
    """Standardisation + denoiser + schedule, and the scoring rule of the module docstring."""

    # Runs on runtime.device (training.place): its noise is drawn on CPU generators and moved to
    # the device of its buffers or inputs, so the draws, and on the CPU the bytes, do not change.
    on_accelerator = True

    def __init__(
        self,
        in_dim: int,
        n_classes: int,
        shape: list[int] | None = None,
        denoiser: str = "mlp",
        width: int = 128,
        depth: int = 2,
        steps: int = 100,
        schedule: str = "cosine",
        weighting: str = "simple",
        draws: int = 32,
        prune_draws: int = 8,
        prune_keep: int = 0,
        score_seed: int = 0,
        score_rows: int = 8192,
        unet_channels: list[int] | None = None,
        unet_layers_per_block: int = 1,
        unet_attention: list[bool] | None = None,
        unet_norm_groups: int = 8,
        null_class: bool = True,
        stop_se: float = 0.0,
        stop_first: int = 2,
        stop_every: int = 1,
        draw_perm: list[int] | None = None,
        stop_test: str = "z",
        stop_profile: list[float] | None = None,
        stop_prior: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.in_dim, self.n_classes = int(in_dim), int(n_classes)
        self.shape = [int(s) for s in shape] if shape else [self.in_dim]
        if math.prod(self.shape) != self.in_dim:
            raise ValueError(f"shape {self.shape} does not hold {self.in_dim} features")
        self.denoiser_kind = resolve_denoiser(denoiser, self.shape)
        self.width, self.depth, self.steps = int(width), int(depth), int(steps)
        self.schedule, self.weighting = schedule, weighting
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {list(WEIGHTINGS)}, got '{weighting}'")
        self.draws, self.prune_draws, self.prune_keep = int(draws), int(prune_draws), int(prune_keep)
        if self.prune_keep and not (1 <= self.prune_draws < self.draws and self.prune_keep < self.n_classes):
            raise ValueError(
                f"pruning needs 1 <= prune_draws < draws ({self.prune_draws}, {self.draws}) "
                f"and prune_keep < n_classes ({self.prune_keep}, {self.n_classes})"
            )
        self.stop_se, self.stop_first, self.stop_every = float(stop_se), int(stop_first), int(stop_every)
        if self.stop_se and (self.stop_first < 2 or self.stop_every < 1):
            raise ValueError(f"sequential elimination needs stop_first >= 2 ({self.stop_first}) and stop_every >= 1 ({self.stop_every})")
        if stop_test not in STOP_TESTS:
            raise ValueError(f"stop_test must be one of {list(STOP_TESTS)}, got '{stop_test}'")
        self.stop_test = stop_test
        self._t_quantiles: np.ndarray | None = None
        self._profile_q: dict[float, float] = {}
        self.score_seed, self.score_rows = int(score_seed), int(score_rows)
        self.draw_perm = [int(j) for j in draw_perm] if draw_perm is not None else None
        if self.draw_perm is not None and sorted(self.draw_perm) != list(range(self.draws)):
            raise ValueError(f"draw_perm must be a permutation of 0..{self.draws - 1}, got {self.draw_perm}")
        # stop_test profile: the difference profile over the draw positions and the variance prior
        # [s0², ν0], fitted on val at the end of training (draw_order.difference_profile).
        self.stop_profile = [float(a) for a in stop_profile] if stop_profile is not None else None
        self.stop_prior = [float(p) for p in stop_prior] if stop_prior is not None else None
        if self.stop_profile is not None and (len(self.stop_profile) != self.draws or not all(map(math.isfinite, self.stop_profile))):
            raise ValueError(f"stop_profile must hold {self.draws} finite numbers (one per draw), got {self.stop_profile}")
        if self.stop_prior is not None and (len(self.stop_prior) != 2 or not all(p > 0 and math.isfinite(p) for p in self.stop_prior)):
            raise ValueError(f"stop_prior must be [s0^2, nu0], two positive numbers, got {self.stop_prior}")
        self.standardize = Standardize(self.in_dim)
        # The mlp and conv nets always have the null class's row; the UNet only when trained
        # with class dropout, so a class-conditional diffusers UNet of K classes loads as is.
        self.null_class = bool(null_class) or self.denoiser_kind != "unet"
        self.unet: dict[str, Any] = {}
        self.init_weights: dict[str, Any] | None = None  # the `weights` file it started from (config.json)
        if self.denoiser_kind == "unet":
            if unet_channels is None:
                raise ValueError("denoiser 'unet' needs unet_channels")
            self.unet = {
                "unet_channels": [int(c) for c in unet_channels],
                "unet_layers_per_block": int(unet_layers_per_block),
                "unet_attention": [bool(a) for a in unet_attention or [False] * len(unet_channels)],
                "unet_norm_groups": int(unet_norm_groups),
            }
            self.denoiser: nn.Module = UNetDenoiser(
                self.shape, self.n_classes + self.null_class, self.unet["unet_channels"],
                self.unet["unet_layers_per_block"], self.unet["unet_attention"], self.unet["unet_norm_groups"],
            )
        elif self.denoiser_kind == "conv":
            self.denoiser = ConvDenoiser(self.shape, self.n_classes, self.steps, self.width, self.depth)
        else:
            self.denoiser = MLPDenoiser(self.in_dim, self.n_classes, self.steps, self.width, self.depth)
        self.register_buffer(
            "log_priors", torch.full((self.n_classes,), -math.log(self.n_classes), dtype=torch.float64)
        )
        # Schedule tables, indexed by t = 0..T (row 0 unused); derived, so not saved.
        betas = noise_schedule(schedule, self.steps)
        alpha_bar = torch.cumprod(1 - betas, 0)
        pad = torch.zeros(1, dtype=torch.float64)
        self.register_buffer("sqrt_ab", torch.cat([pad + 1, alpha_bar.sqrt()]).float(), persistent=False)
        self.register_buffer("sqrt_1m_ab", torch.cat([pad, (1 - alpha_bar).sqrt()]).float(), persistent=False)
        elbo_w = betas / (2 * (1 - betas) * (1 - alpha_bar))
        self.register_buffer("elbo_w", torch.cat([pad, elbo_w]), persistent=False)
        # x-independent parts of the negative ELBO: the decoder's normaliser and the KL
        # variance mismatch of reverse steps with σ_t² = β_t against the posterior's β̃_t.
        ab_prev = torch.cat([pad + 1, alpha_bar[:-1]])
        ratio = (betas * (1 - ab_prev) / (1 - alpha_bar) / betas)[1:]  # β̃_t / β_t, t >= 2
        self.nelbo_const = float(
            self.in_dim * (0.5 * (LOG_2PI + math.log(betas[0])) + 0.5 * (ratio - 1 - ratio.log()).sum())
        )
        self.alpha_bar_T = float(alpha_bar[-1])
        self._cache: tuple[bytes, np.ndarray, np.ndarray] | None = None
        self._row_flops: int | None = None

    def arch(self) -> dict[str, Any]:
        """The architecture and scoring arguments `load_model` rebuilds this model from (a UNet's
        whole configuration too: the `weights` file is not needed to load a trained model)."""
        out = {
            "kind": self.kind, "in_dim": self.in_dim, "n_classes": self.n_classes, "shape": self.shape,
            "denoiser": self.denoiser_kind, "width": self.width, "depth": self.depth, "steps": self.steps,
            "schedule": self.schedule, "weighting": self.weighting, "draws": self.draws,
            "prune_draws": self.prune_draws, "prune_keep": self.prune_keep,
            "score_seed": self.score_seed, "score_rows": self.score_rows,
        }
        if self.stop_se:  # (off: the arch stays as it was, same bytes on disk)
            out.update(stop_se=self.stop_se, stop_first=self.stop_first, stop_every=self.stop_every)
            if self.stop_test != "z":  # (z: the arch stays as it was before the key, same bytes on disk)
                out["stop_test"] = self.stop_test
        if self.draw_perm is not None:
            out["draw_perm"] = self.draw_perm
        if self.stop_profile is not None:
            out.update(stop_profile=self.stop_profile, stop_prior=self.stop_prior)
        if self.denoiser_kind == "unet":  # (the mlp and conv arch stays as it was: same bytes on disk)
            del out["width"], out["depth"]
            out.update(network=UNET_NETWORK, **self.unet, null_class=self.null_class)
        return out

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> DiffusionClassifier:
        """Rebuild from `arch()` metadata (TypeError/ValueError when it does not fit)."""
        network = arch.get("network", UNET_NETWORK)
        if network != UNET_NETWORK:
            raise ValueError(f"network {network!r} is not {UNET_NETWORK!r}")
        return cls(**{k: v for k, v in arch.items() if k not in ("kind", "network")})

    def rows_per_example(self) -> int:
        """Denoiser evaluations to score one example against every class (with pruning if on; with
        sequential elimination, which depends on the example, the most it can use: K·S)."""
        k, s = self.n_classes, self.draws
        if self.prune_keep and self.prune_keep < k and s > self.prune_draws:
            return k * self.prune_draws + self.prune_keep * (s - self.prune_draws)
        return k * s

    def cost_per_example(self) -> dict[str, int]:
        """params: numbers in the state_dict; macs: denoiser multiply-adds over all the
        (class, draw) rows of one example; forward_passes: those rows (network evaluations).

        A row's multiply-adds are counted in closed form for the mlp and conv nets (their layers'
        products), and by torch's FlopCounterMode on one row for the UNet (its convolutions,
        linear layers and attention products; norms and activations are not multiply-adds)."""
        params = sum(t.numel() for t in self.state_dict().values())
        rows = self.rows_per_example()
        if self.denoiser_kind == "unet":
            if self._row_flops is None:
                self._row_flops = counted_flops(self.denoiser, self.in_dim)
            flops = float(self._row_flops)
        else:
            flops = denoiser_flops(self.arch())
        macs = int(flops // 2) * rows
        return {"params": int(params), "macs": macs, "forward_passes": rows}

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._cache = None

    def train(self, mode: bool = True) -> DiffusionClassifier:
        self._cache = None  # weights are about to change (or just did)
        return super().train(mode)

    # -- training --

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator, class_dropout: float = 0.0) -> torch.Tensor:
        """The simple loss mean ‖ε_θ(z_t, t, y) − ε‖² / d of a batch of raw inputs and labels."""
        z = self.standardize(batch["x"])
        n, device = len(z), z.device
        # drawn on the (CPU) generator, then moved: the same draws on every device
        t = torch.randint(1, self.steps + 1, (n,), generator=generator).to(device)
        eps = torch.randn(z.shape, generator=generator).to(device)
        y = batch["y"].to(device)
        if class_dropout > 0:
            drop = (torch.rand(n, generator=generator) < class_dropout).to(device)
            y = torch.where(drop, torch.full_like(y, self.n_classes), y)
        z_t = self.sqrt_ab[t, None] * z + self.sqrt_1m_ab[t, None] * eps
        return F.mse_loss(self.denoiser(z_t, t, y), eps)

    @torch.no_grad()
    def denoising_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The training loss (`loss`, no class dropout) over a whole split given its labels, on fixed
        draws: one (t, ε) per example from a generator seeded with `score_seed`, in chunks of
        `score_rows` examples — the same draws at every call, so values of successive epochs compare
        (the val objective in history). One denoiser row per example: no per-class scoring."""
        generator = torch.Generator().manual_seed(self.score_seed)
        device = self.sqrt_ab.device
        total = 0.0
        for i in range(0, len(x), self.score_rows):
            xb = x[i : i + self.score_rows].to(device)
            total += float(self.loss({"x": xb, "y": y[i : i + self.score_rows]}, generator)) * len(xb)
        return total / max(len(x), 1)

    # -- scoring --

    def noisy_inputs(self, z: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """z_t for every (example, draw): float32 (n, S, d)."""
        return torch.addcmul(self.sqrt_ab[t].unsqueeze(-1) * z.unsqueeze(1), self.sqrt_1m_ab[t].unsqueeze(-1), eps)

    def errors(self, z: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """e_s(y) = ‖ε_θ(z_t, t_s, y) − ε_s‖² for each example's `classes` (n, C): float32 (n, C, S).

        The draws (t, ε) are shared by every class; all n·C·S rows go through one forward.
        """
        n, c = classes.shape
        s, d = eps.shape[1], eps.shape[2]
        z_t = self.noisy_inputs(z, t, eps)
        rows_x = z_t.unsqueeze(1).expand(n, c, s, d).reshape(-1, d)
        rows_t = t.unsqueeze(1).expand(n, c, s).reshape(-1)
        rows_y = classes.unsqueeze(2).expand(n, c, s).reshape(-1)
        eps_hat = self.denoiser(rows_x, rows_t, rows_y).view(n, c, s, d)
        return (eps_hat - eps.unsqueeze(1)).square_().sum(-1)

    def weighted(self, err: torch.Tensor, t: torch.Tensor, weighting: str) -> torch.Tensor:
        """score(y) (float64, (n, C)) of errors (n, C, S) at timesteps t (n, S)."""
        if weighting == "elbo":
            return -self.steps * (err.double() * self.elbo_w[t].unsqueeze(1)).mean(-1)
        return -err.double().mean(-1)

    def score_prior(self) -> torch.Tensor:
        """What the logits add to score(y): log π_y for `elbo` (a log-likelihood bound), zeros
        for `simple` (not on the scale of log π_y; see the module docstring). float64 (K,)."""
        return self.log_priors if self.weighting == "elbo" else torch.zeros_like(self.log_priors)

    def score_draws(self, z: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, full: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(logits float32 (n, K), ELBO score float64 (n, K), network rows) of one chunk of examples.

        logits = score + `score_prior()`; with `prune_keep`, pruned classes keep their coarse
        score, capped (in float32, as stored) just below the lowest kept class's.
        """
        n, k, s = len(z), self.n_classes, t.shape[1]
        every = torch.arange(k, device=z.device).expand(n, k)
        prior = self.score_prior()
        if self.stop_se and not self.prune_keep and not full and s == self.draws and s > self.stop_first:
            return self.score_sequential(z, t, eps)
        if not self.prune_keep or self.prune_keep >= k or s <= self.prune_draws:
            err = self.errors(z, t, eps, every)
            joint = self.weighted(err, t, self.weighting) + prior
            return joint.float(), self.weighted(err, t, "elbo"), n * k * s
        s1, keep = self.prune_draws, self.prune_keep
        err1 = self.errors(z, t[:, :s1], eps[:, :s1], every)
        joint = self.weighted(err1, t[:, :s1], self.weighting) + prior
        kept = torch.sort(joint, dim=1, descending=True, stable=True).indices[:, :keep]  # (n, keep)
        err2 = self.errors(z, t[:, s1:], eps[:, s1:], kept)
        err_kept = torch.cat([err1.gather(1, kept.unsqueeze(2).expand(n, keep, s1)), err2], dim=2)
        fine = (self.weighted(err_kept, t, self.weighting) + prior[kept]).float()
        cap = torch.nextafter(fine.min(1).values, torch.tensor(-math.inf, device=fine.device))
        logits = torch.minimum(joint.float(), cap[:, None]).scatter_(1, kept, fine)
        elbo = self.weighted(err1, t[:, :s1], "elbo").scatter_(1, kept, self.weighted(err_kept, t, "elbo"))
        return logits, elbo, n * k * s1 + n * keep * (s - s1)

    @torch.no_grad()
    def score(
        self, x: np.ndarray | torch.Tensor, draws: int | None = None, seed: int | None = None, full: bool = False
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(logits float32 (n, K), log-likelihood float64 (n,), network rows evaluated) of raw inputs.

        `draws`/`seed` override the stored `draws`/`score_seed` (selection during training);
        `full` scores every class on every draw whatever the sequential keys (selection during
        training, before `fit_scoring` has fitted what `stop_test: profile` needs).
        """
        x = x.float() if isinstance(x, torch.Tensor) else torch.tensor(np.asarray(x, dtype=np.float32))
        s = int(draws or self.draws)
        generator = torch.Generator().manual_seed(self.score_seed if seed is None else seed)
        device = self.sqrt_ab.device  # the draws are made on the CPU and moved: the same on every device
        chunk = max(1, self.score_rows // (self.n_classes * s))
        was_training = self.training
        self.eval()
        cond = getattr(self.denoiser, "cond", None)
        if isinstance(cond, _Conditioning):
            cond.table = cond.time_mlp(cond.features)
        try:
            logits = np.empty((len(x), self.n_classes), dtype=np.float32)
            loglik = np.empty(len(x), dtype=np.float64)
            rows = 0
            for i in range(0, len(x), chunk):
                z = self.standardize(x[i : i + chunk].to(device))
                t, eps = draw_noise(len(z), s, self.in_dim, self.steps, generator)
                scores, elbo, r = self.score_draws(z, t.to(device), eps.to(device), full)
                rows += r
                logits[i : i + len(z)] = scores.cpu().numpy()
                loglik[i : i + len(z)] = self.elbo_loglik(z, elbo)
            return logits, loglik, rows
        finally:
            if isinstance(cond, _Conditioning):
                cond.table = None
            self.train(was_training)

    def elbo_loglik(self, z: torch.Tensor, elbo: torch.Tensor) -> np.ndarray:
        """log Σ_y exp(ELBO(x, y) + log π_y) in raw units, from the y-dependent ELBO terms."""
        joint = (elbo + self.log_priors).cpu().numpy()
        z64 = z.double()
        ab = self.alpha_bar_T
        prior_kl = 0.5 * (ab * z64.square().sum(1) - self.in_dim * (ab + math.log(1 - ab))).cpu().numpy()
        log_det = float(torch.log(self.standardize.std.double()).sum())
        return logsumexp_np(joint) - prior_kl - self.nelbo_const - log_det

    def _cached(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_dim:
            from stages.core.io import ArtifactError

            raise ArtifactError(f"model expects inputs of shape (n, {self.in_dim}), got {x.shape}")
        key = hashlib.sha256(x.tobytes()).digest() + str(x.shape).encode()
        if self._cache is None or self._cache[0] != key:
            logits, loglik, _ = self.score(x)
            self._cache = (key, logits, loglik)
        return self._cache[1], self._cache[2]

    def logits(self, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
        """score(y), plus log π_y with `elbo` weighting (float32, (n, K)); see the module docstring.

        `batch_size` is not used: examples are scored in chunks of `score_rows` network rows,
        so the noise draws (and the scores) do not depend on it.
        """
        return self._cached(x)[0].copy()

    def target_logits(self, x: np.ndarray) -> np.ndarray:
        """Full scoring's logits (every class on every draw; `stages.models.target_logits`): what a
        distilled student matches. Sequential elimination's logits agree with them on the argmax
        only; a dropped class keeps a capped stand-in, a softer target the fewer draws it had."""
        return self.score(np.ascontiguousarray(x, dtype=np.float32), full=True)[0]

    def log_likelihood(self, x: np.ndarray) -> np.ndarray:
        """Per-example ELBO estimate of log p(x) (float64, (n,)); see the module docstring."""
        return self._cached(x)[1].copy()


def build_classifier(prepared: Any, cfg: Any, key: str = "method.diffusion") -> DiffusionClassifier:
    """The untrained classifier `cfg` (DiffusionConfig) describes for `prepared`'s data, its UNet
    initialised from `cfg.weights` when given (the file and its sha256 then in `init_weights`).

    Draws its initial weights from torch's global RNG (seeded by the caller)."""
    denoiser = resolve_denoiser(cfg.denoiser, prepared.shape)
    unet = {}
    if denoiser == "unet":
        unet = {"unet_channels": list(cfg.unet_channels), "unet_layers_per_block": cfg.unet_layers_per_block,
                "unet_attention": list(cfg.unet_attention), "unet_norm_groups": cfg.unet_norm_groups,
                "null_class": cfg.class_dropout > 0}
    model = DiffusionClassifier(
        prepared.x.shape[1], prepared.n_classes, prepared.shape, denoiser,
        cfg.channels if denoiser == "conv" else cfg.width, cfg.depth,
        cfg.steps, cfg.schedule, cfg.weighting, cfg.draws, cfg.prune_draws, cfg.prune_keep, cfg.score_seed,
        cfg.score_rows, **unet,
        **({"stop_se": cfg.stop_se, "stop_first": cfg.stop_first, "stop_every": cfg.stop_every,
            "stop_test": getattr(cfg, "stop_test", "z")}
           if getattr(cfg, "stop_se", 0) else {}),
    )
    if denoiser == "unet" and cfg.weights is not None:
        model.init_weights = load_unet_weights(model.denoiser.unet, cfg.weights, f"{key}.weights")
    return model


def load_unet_weights(unet: nn.Module, path: str, key: str) -> dict[str, Any]:
    """Load a diffusers UNet2DModel state_dict from the safetensors file `path` into `unet`:
    {"path", "sha256"} of the file, and "fresh": the tensors the file lacks and the UNet keeps.

    A file without a class embedding (an unconditional UNet, e.g. a DDPM trained without
    labels) is accepted: the class embedding starts at zero, so the classifier starts as that
    unconditional model. Any other missing or misshapen tensor is a one-line error naming the
    file and `key` (stages/models/external.py)."""
    from stages.models.external import load_external

    skip = ("class_embedding.",) if _lacks_class_embedding(path) else ()
    sha = load_external(unet, path, key, skip=skip)
    record: dict[str, Any] = {"path": str(path), "sha256": sha}
    if skip:
        with torch.no_grad():
            unet.class_embedding.weight.zero_()
        record["fresh"] = ["class_embedding.weight"]
    return record


def _lacks_class_embedding(path: str) -> bool:
    """Whether `path` is a readable safetensors file with no class embedding (unreadable: False,
    and `load_external` says why)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return "class_embedding.weight" not in set(f.keys())
    except Exception:  # any failure to read is reported by load_external
        return False


def train_diffusion(
    prepared: Any, cfg: Any, seed: int, desc: str = "train diffusion", checkpoint: Any = None,
    key: str = "method.diffusion",
) -> tuple[DiffusionClassifier, Any]:
    """Fit a DiffusionClassifier (DiffusionConfig `cfg`) on the train split; select by `cfg.selection`.

    Returns (model holding the selected weights, training.FitResult). Raises ValueError for
    a config that does not fit the data (e.g. `prune_keep` >= n_classes), ArtifactError for a
    `weights` file that is missing or does not fit (naming it and `key`, the config section). With `checkpoint`
    (a `stages.core.checkpoint.Checkpointer`) training resumes byte-identically: the loss draws
    t, ε and the class dropout from the loop's generator, which the checkpoint carries, and
    selection scoring seeds its own generator from `score_seed` on every call.
    """
    from stages.core.runtime import setup_torch
    from stages.models.generative import GenerativeFitOptions, fit_generative
    from stages.models.training import split_data

    generator = setup_torch(seed)
    splits = split_data(prepared)
    train = splits["train"]
    model = build_classifier(prepared, cfg, key)
    model.standardize.fit(train.x)
    with torch.no_grad():
        model.log_priors.copy_(log_priors(train.y, prepared.n_classes))

    def batch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model.loss(batch, generator, cfg.class_dropout)

    def scorer(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(model.score(x, draws=cfg.select_draws, full=True)[0])

    opts = GenerativeFitOptions.from_config(cfg)
    result = fit_generative(model, splits, batch_loss, scorer, opts, generator, desc, checkpoint=checkpoint,
                            val_objective=lambda s: model.denoising_loss(s.x, s.y))
    fit_scoring(model, cfg, splits["val"], key)
    return model, result


def train(job: Any) -> Any:
    """Check the config against the data (before any work), then `train_diffusion`."""
    from stages.models.training import epoch_trained

    job.cfg.check_data(job.key, job.prepared.n_classes, job.prepared.shape)
    ckpt = job.checkpointer()
    model, result = train_diffusion(job.prepared, job.cfg, job.seed, desc=job.desc, checkpoint=ckpt, key=job.key)
    record = {"weights": model.init_weights} if model.init_weights is not None else {}
    return epoch_trained(model, result, job.cfg.selection, ckpt, **record)
