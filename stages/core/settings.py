"""The schemas of the stage sections of params.yaml (pretrain, distill, train, validate,
evaluate, phase, run). Methods and datasets declare theirs in their own modules
(stages/core/registry.py); every value lives in conf/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stages.core.schema import Checks, option


@dataclass
class PretrainConfig:
    """Denoising autoencoder fitted on train inputs only, without labels."""

    kind: str = option("pretraining objective")
    seed: int = option("seed")
    hidden: list[int] = option("encoder widths; the last is the embedding size")
    noise_std: float = option("std of the Gaussian corruption")
    lr: float = option("Adam learning rate")
    epochs: int = option("epochs")
    batch_size: int = option("minibatch size")

    def check(self, c: Checks) -> None:
        c.choice(self.kind, "kind", ["dae"])
        c.require(len(self.hidden) >= 1 and all(h > 0 for h in self.hidden), "hidden", f"need >= 1 width > 0, got {self.hidden}")
        c.non_negative(self.noise_std, "noise_std")
        c.minibatch(self)


@dataclass
class DistillConfig:
    """A student MLP trained on a teacher's temperature-softened predictions."""

    hidden: list[int] = option("student hidden widths")
    temperature: float = option("softmax temperature applied to the teacher's logits")
    alpha: float = option("weight of the soft (teacher) loss; 1-alpha goes to the hard labels")
    lr: float = option("Adam learning rate")
    epochs: int = option("epochs")
    batch_size: int = option("minibatch size")
    selection: str = option("checkpoint selection: val_avg | val_worst_group | oracle")

    def check(self, c: Checks) -> None:
        c.require(all(h > 0 for h in self.hidden), "hidden", f"widths must be > 0, got {self.hidden}")
        c.positive(self.temperature, "temperature")
        c.prob(self.alpha, "alpha")
        c.minibatch(self)


@dataclass
class TrainConfig:
    """Checkpoints of the minibatch training loop (scratch/checkpoints/<stage>/); outputs never depend on them."""

    checkpoint_every: int = option("write a resumable checkpoint every N epochs (0 = only on SIGINT/SIGTERM)")
    resume: bool = option("resume from the latest valid checkpoint of the same stage, params and code")

    def check(self, c: Checks) -> None:
        c.non_negative(self.checkpoint_every, "checkpoint_every")


DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class RuntimeConfig:
    """How the torch stages run: device, precision, CPU threads, determinism, streaming (stages/core/runtime.py)."""

    device: str = option("auto (CUDA when present, else the CPU) | cpu | cuda | cuda:<index>")
    precision: str = option("fp32 | bf16 | fp16: autocast dtype of forward passes (fp16 on CUDA adds a gradient scaler)")
    threads: int = option("intra-op CPU threads; 0 = every core this process may use (1 = the same bytes on any CPU)")
    deterministic: bool = option("deterministic algorithms (on CUDA: no cuDNN autotuning, fixed cuBLAS workspace)")
    stream: bool = option("read the prepared Parquet in row groups while training instead of all at once")
    shuffle_buffer: int = option("stream: rows shuffled together (whole row groups, in a shuffled row-group order)")
    workers: int = option("stream: row groups decoded ahead in background threads (0 = in the training thread)")

    def check(self, c: Checks) -> None:
        base, _, index = self.device.partition(":")
        c.require(
            base in DEVICES and (not index or (base == "cuda" and index.isdigit())),
            "device", f"must be one of {list(DEVICES)} or cuda:<index>, got '{self.device}'",
        )
        c.choice(self.precision, "precision", PRECISIONS)
        c.non_negative(self.threads, "threads")
        c.require(self.shuffle_buffer >= 1, "shuffle_buffer", f"must be >= 1, got {self.shuffle_buffer}")
        c.non_negative(self.workers, "workers")


@dataclass
class ValidateConfig:
    """Great Expectations suite thresholds."""

    min_group_count: int = option("minimum examples of every group in val, test_id and test_ood")
    rho_tolerance: float = option("allowed |observed - configured| train agreement rate")
    min_shift: float = option("test_ood agreement must differ from train's by at least this")

    def check(self, c: Checks) -> None:
        c.require(self.min_group_count >= 1, "min_group_count", f"must be >= 1, got {self.min_group_count}")
        c.prob(self.rho_tolerance, "rho_tolerance")
        c.prob(self.min_shift, "min_shift")


@dataclass
class EvaluateConfig:
    """Evaluation settings."""

    ece_bins: int = option("equal-width confidence bins for ECE and the reliability curve")
    batch_size: int = option("examples scored per forward pass")
    bootstrap_resamples: int = option("bootstrap resamples for 95% intervals and paired tests (0 = none)")
    bootstrap_seed: int = option("seed of the bootstrap resampling")
    shift_steps: int = option("points of the shift curve, training agreement to fully reversed")
    shift_regenerate_n: int = option("examples drawn per shift step for generated datasets (0 = off)")
    er_reference: list[str] = option(
        "effective robustness: models whose (model, seed) points fit the logit-linear ID→OOD baseline "
        "(standard training, no robustness intervention; the report reads it)"
    )
    evidence_reference: list[str] = option(
        "the discriminative reference family of the report's evidence: generative − these models' mean, "
        "in OOD worst-group accuracy and ID→OOD drop, over replicates (those in the run; the report reads it)"
    )
    evidence_matched: str = option(
        "the evidence's matched reference: each generative model against this model (same inputs, no group "
        "labels) is the headline comparison; the other evidence_reference models are the group-aware one"
    )
    learned_margin: float = option(
        "a run whose val balanced accuracy is within this of chance (1 / classes) failed to learn: "
        "it blocks every verdict it would enter"
    )

    def check(self, c: Checks) -> None:
        c.require(self.ece_bins >= 1, "ece_bins", f"must be >= 1, got {self.ece_bins}")
        c.require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        c.non_negative(self.bootstrap_resamples, "bootstrap_resamples")
        c.require(self.shift_steps >= 2, "shift_steps", f"must be >= 2, got {self.shift_steps}")
        c.require(
            self.shift_regenerate_n == 0 or self.shift_regenerate_n >= 8,
            "shift_regenerate_n",
            f"must be 0 or >= 8, got {self.shift_regenerate_n}",
        )
        c.require(bool(self.evidence_matched), "evidence_matched", "must name a model")
        c.require(0.0 <= self.learned_margin < 0.5, "learned_margin", f"must be in [0, 0.5), got {self.learned_margin}")
        for key in ("er_reference", "evidence_reference"):
            names = getattr(self, key)
            c.require(len(set(names)) == len(names), key, f"has duplicates: {names}")
            c.require(all(m for m in names), key, f"names must not be empty: {names}")


PHASE_KNOBS = ("sigma", "spurious_scale", "rho_train", "d_noise", "noise_std", "cue_dims", "n_train")


@dataclass
class PhasePanel:
    """One heatmap of the phase diagram: two knobs of `phase.base` on the axes."""

    x: str = option("knob on the x axis (one of PHASE_KNOBS)")
    x_values: list[float] = option("values of the x knob")
    y: str = option("knob on the y axis (one of PHASE_KNOBS)")
    y_values: list[float] = option("values of the y knob")


@dataclass
class PhaseConfig:
    """experiment=toy_phase_diagram: a generative classifier (`generative`, a closed-form method)
    vs logistic regression fitted to convergence (stages/phase.py `fit_logistic`) over the knobs
    of a generated dataset (`base`); both are validated by their own kind's schema.

    Every panel sweeps two knobs with the others at `base`; no panels = nothing to compute.
    """

    panels: list[PhasePanel] = field(metadata={"help": "heatmaps to compute (empty = none)"})
    base: dict[str, Any] = field(metadata={"help": "the generated dataset's config: the other knobs"})
    seeds: list[int] = option("data/training seeds per cell; the cell reports the mean")
    generative: dict[str, Any] = field(metadata={"help": "the generative classifier: a method config (its `kind` registered a closed-form `fit`)"})
    lr_l2: float = option(
        "logistic regression: λ of mean cross-entropy + λ/2 ‖w‖² (bias unpenalised; scikit-learn's "
        "C = 1/(λ n_train)); tiny = near-unregularised, > 0 so a separable fit converges"
    )
    lr_tol: float = option("logistic regression: Newton stops when the gradient's largest |entry| is below this")
    l2_lines: list[float] = option("λ of extra, regularised logistic regressions recorded beside it ([] = none)")

    def check(self, c: Checks) -> None:
        for i, p in enumerate(self.panels):
            for axis in ("x", "y"):
                c.choice(getattr(p, axis), f"panels[{i}].{axis}", PHASE_KNOBS)
                c.require(len(getattr(p, f"{axis}_values")) >= 1, f"panels[{i}].{axis}_values", "must not be empty")
            c.require(p.x != p.y, f"panels[{i}]", f"x and y must be different knobs, both are '{p.x}'")
        c.require(len(self.seeds) >= 1, "seeds", "must not be empty")
        c.positive(self.lr_l2, "lr_l2")
        c.positive(self.lr_tol, "lr_tol")
        c.require(all(v > 0 and math.isfinite(v) for v in self.l2_lines), "l2_lines", f"every λ must be a finite number > 0, got {self.l2_lines}")


@dataclass
class RunConfig:
    """What `dvc repro` runs: the matrix over datasets × methods × seeds."""

    add_datasets: list[str] = option("datasets appended to conf/'s run.datasets (one more without restating the list)")
    add_methods: list[str] = option("methods appended to conf/'s run.methods (one more without restating the list)")
    datasets: list[str] = option("datasets to prepare (names under `dataset`)")
    methods: list[str] = option("methods to train (names under `method`)")
    teachers: list[str] = option("methods distilled into a student named <teacher>_student")
    models: list[str] = option("models to evaluate: methods and <teacher>_student names")
    seeds: list[int] = option("training seeds")
    redraw_data: bool = option(
        "replicates redraw the data too: each generated dataset gets one instance per seed, "
        "<dataset>_seed<k>, and seed k trains and evaluates on instance k only (stages/core/replicates.py); "
        "real datasets keep their fixed splits"
    )

    def check(self, c: Checks) -> None:
        for key in ("datasets", "methods", "models", "seeds"):
            c.require(len(getattr(self, key)) > 0, key, "must not be empty")
            values = getattr(self, key)
            c.require(len(set(values)) == len(values), key, f"has duplicates: {values}")
        for key, into in (("add_datasets", "datasets"), ("add_methods", "methods")):
            for name in getattr(self, key):  # an experiment or override that sets the list itself drops the addition
                c.require(name in getattr(self, into), key, f"'{name}' is not in run.{into} {getattr(self, into)}: "
                          f"run.{into} was replaced (by an experiment or an override); name it there instead")
        for t in self.teachers:
            c.require(t in self.methods, "teachers", f"teacher '{t}' is not in run.methods {self.methods}")
        producible = set(self.methods) | {student_name(t) for t in self.teachers}
        for m in self.models:
            c.require(m in producible, "models", f"'{m}' is neither a trained method nor a student of run.teachers")
        for m in self.methods:
            c.require(m in self.models, "models", f"trained method '{m}' is not evaluated; add it to run.models")


# conf/'s `run.models` resolver (hydra_plugins/shiftlab) and dvc.yaml's distill outs spell it
# too; tests/test_registry.py checks they agree.
STUDENT_SUFFIX = "_student"


def student_name(teacher: str) -> str:
    """The model name of the student distilled from `teacher`."""
    return f"{teacher}{STUDENT_SUFFIX}"
