"""`diffusion`: a class-conditional DDPM used as a classifier — its config and registration.

The model, its scoring and its training: stages/models/diffusion_model.py (imported only when
the method trains or a model is loaded, so validating a config never imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.registry import register_method
from stages.core.schema import Checks, ConfigError, option
from stages.models.schemas import GenerativeFitConfig


@dataclass
class DiffusionConfig(GenerativeFitConfig):
    """Class-conditional DDPM classifier: class score = −mean w(t)·‖ε_θ(x_t, t, y) − ε‖², plus log prior with `elbo`."""

    denoiser: str = option("auto (conv for C×H×W data, else mlp) | mlp | conv | unet (diffusers UNet2DModel, C×H×W data)")
    width: int = option("hidden width of the mlp denoiser")
    channels: int = option("channels of the conv denoiser")
    depth: int = option("residual hidden layers of the mlp and conv denoisers")
    unet_channels: list[int] = option("unet: output channels of each resolution block (one block per entry; each but the last halves H and W)")
    unet_layers_per_block: int = option("unet: resnet layers per down block (up blocks have one more, as in diffusers)")
    unet_attention: list[bool] = option("unet: self-attention in each block (one per unet_channels entry); the middle block has it if the last does")
    unet_norm_groups: int = option("unet: GroupNorm groups (must divide every entry of unet_channels)")
    weights: str | None = option("unet: local safetensors file of a diffusers UNet2DModel state_dict to start from (null = fresh init)")
    steps: int = option("T: diffusion timesteps")
    schedule: str = option("noise schedule: cosine | linear")
    class_dropout: float = option("P(label replaced by the null class) in training (classifier-free), in [0, 1)")
    weighting: str = option("score weighting w(t): simple (1; logits = score, no prior) | elbo (logits = ELBO + log prior)")
    draws: int = option("(t, ε) draws per example when scoring, shared by every class")
    select_draws: int = option("draws per example when scoring the splits for checkpoint selection")
    prune_keep: int = option("adaptive pruning: classes kept after the first prune_draws draws (0 = off)")
    prune_draws: int = option("draws that score every class before pruning")
    stop_se: float = option(
        "sequential elimination (per example): drop a class once `stop_test` settles, at the one-sided level "
        "Phi(-stop_se), that its total error difference to the leader over all `draws` is above 0 (full scoring's "
        "decision); stop when one class is left or at `draws` (0 = off; "
        "prune_keep > 0 takes its place; draws <= stop_first scores every class on every draw)"
    )
    stop_first: int = option("sequential elimination: draws every class gets before the first test (>= 2)")
    stop_every: int = option("sequential elimination: draws per round after the first test")
    stop_test: str = option(
        "sequential elimination's test: profile (predicts full scoring's total difference from the draws seen, with "
        "the differences' profile over t and an empirical-Bayes variance prior fitted on val without labels; "
        "Student-t quantile of the one-sided level Phi(-stop_se)) | t_pooled (sd pooled over the classes still in, "
        "t quantile at the pooled degrees of freedom; the rule before profile) | t (each class's own sd, t quantile) | "
        "z (each class's own sd, stop_se itself: the first rule; too eager after few draws)"
    )
    draw_order: str = option(
        "sequential elimination: the order it takes the draws in: strata (as drawn, spread over t) | profile "
        "(half by half, each half's strata with the largest val difference profile first; no labels) | informative "
        "(the strata that separate the classes best on labelled val first; fails under shift: "
        "stages/models/draw_order.py)"
    )
    score_seed: int = option("seed of the scoring draws (scores depend only on it, the model and x)")
    score_rows: int = option("denoiser rows per scoring forward pass (memory; fixes the draw chunks)")

    def check(self, c: Checks) -> None:
        super().check(c)
        c.choice(self.denoiser, "denoiser", list(DENOISERS))
        c.require(self.width >= 1, "width", f"must be >= 1, got {self.width}")
        c.require(self.channels >= 1, "channels", f"must be >= 1, got {self.channels}")
        c.require(self.depth >= 0, "depth", f"must be >= 0, got {self.depth}")
        check_unet(c, list(self.unet_channels), self.unet_layers_per_block, list(self.unet_attention), self.unet_norm_groups)
        c.require(self.weights is None or self.denoiser == "unet", "weights",
                  f"only the unet denoiser loads weights from a file, denoiser is '{self.denoiser}'")
        c.require(self.weights is None or bool(str(self.weights).strip()), "weights", "must name a .safetensors file, or be null")
        c.require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        c.choice(self.schedule, "schedule", ["cosine", "linear"])
        c.require(0 <= self.class_dropout < 1, "class_dropout", f"must be in [0, 1), got {self.class_dropout}")
        c.choice(self.weighting, "weighting", ["simple", "elbo"])
        c.require(self.draws >= 1, "draws", f"must be >= 1, got {self.draws}")
        c.require(self.select_draws >= 1, "select_draws", f"must be >= 1, got {self.select_draws}")
        c.require(self.prune_keep >= 0, "prune_keep", f"must be >= 0 (0 = no pruning), got {self.prune_keep}")
        if self.prune_keep:
            c.require(1 <= self.prune_draws < self.draws, "prune_draws",
                      f"must be in [1, draws={self.draws}) when prune_keep > 0, got {self.prune_draws}")
        c.require(self.stop_se >= 0, "stop_se", f"must be >= 0 (0 = no sequential elimination), got {self.stop_se}")
        if self.stop_se:
            c.require(self.stop_first >= 2, "stop_first", f"must be >= 2 when stop_se > 0 (a standard error needs 2 draws), got {self.stop_first}")
            c.require(self.stop_every >= 1, "stop_every", f"must be >= 1, got {self.stop_every}")
            c.choice(self.stop_test, "stop_test", list(STOP_TESTS))
        c.choice(self.draw_order, "draw_order", list(DRAW_ORDERS))
        c.require(self.score_rows >= 1, "score_rows", f"must be >= 1, got {self.score_rows}")

    def check_data(self, key: str, n_classes: int, shape: list[int] | None = None) -> None:
        """Checks that need the dataset: pruning must keep fewer classes than there are, and
        the conv and unet denoisers need (C, H, W) images."""
        if self.prune_keep and self.prune_keep >= n_classes:
            raise ConfigError(
                f"params.yaml: {key}.prune_keep: must be < the dataset's n_classes ({n_classes}) "
                f"when pruning, got {self.prune_keep}"
            )
        if shape is not None and self.denoiser in IMAGE_DENOISERS and len(shape) != 3:
            raise ConfigError(
                f"params.yaml: {key}.denoiser: '{self.denoiser}' needs (C, H, W) images, the dataset's "
                f"inputs have shape {list(shape)} (use auto or mlp)"
            )


SCHEDULES = ("linear", "cosine")


WEIGHTINGS = ("simple", "elbo")
STOP_TESTS = ("profile", "t_pooled", "t", "z")  # sequential elimination's test (DiffusionClassifier.stop_threshold, profile_settled)


DRAW_ORDERS = ("strata", "profile", "informative")  # the order sequential elimination takes the draws in (draw_order.py)


DENOISERS = ("auto", "mlp", "conv", "unet")


IMAGE_DENOISERS = ("conv", "unet")


UNET_HEAD_DIM = 8  # diffusers' attention_head_dim default: heads = channels / 8 in an attention block


def check_unet(c: Checks, channels: list[int], layers_per_block: int, attention: list[bool], norm_groups: int) -> None:
    """The `unet_*` keys' constraints (those diffusers would otherwise fail on deep inside)."""
    c.require(len(channels) >= 1 and all(ch >= 1 for ch in channels), "unet_channels",
              f"must be a non-empty list of positive channel counts, got {channels}")
    c.require(layers_per_block >= 1, "unet_layers_per_block", f"must be >= 1, got {layers_per_block}")
    c.require(len(attention) == len(channels), "unet_attention",
              f"needs one entry per unet_channels block ({len(channels)}), got {attention}")
    c.require(norm_groups >= 1 and all(ch % norm_groups == 0 for ch in channels), "unet_norm_groups",
              f"must divide every entry of unet_channels {channels}, got {norm_groups}")
    c.require(all(ch % UNET_HEAD_DIM == 0 for ch, a in zip(channels, attention, strict=False) if a), "unet_attention",
              f"a block with attention needs a multiple of {UNET_HEAD_DIM} channels (heads of {UNET_HEAD_DIM}), "
              f"got channels {channels} with attention {attention}")


register_method(
    "diffusion", DiffusionConfig, "stages.models.diffusion_model:train", generative=True, model="diffusion",
    not_on_discrete=(
        "Gaussian diffusion models continuous data: on binary attributes or one-hot categories its ELBO "
        "is not a likelihood of the data, so its class scores would not be the classifier it is named for"
    ),
)
