"""Pretrain a denoising-autoencoder encoder on the train inputs only — no labels are read.

    python -m stages.pretrain <dataset> [key=value ...]

Reads the `id`, `split` and `x` columns of data/prepared/<dataset>.parquet (never y, a or g)
and the `pretrain` section of params.yaml. Inputs are standardised with the train split's
statistics, corrupted with N(0, noise_std²) noise, and the encoder + mirrored decoder learn
to reconstruct the clean standardised input (MSE). Writes, as one atomic folder,
data/pretrained/<dataset>/encoder.safetensors (standardisation + encoder; metadata: in_dim,
hidden) and embeddings.parquet (id, split, z = encoder output for every split); both record
their `provenance` (stages/core/provenance.py; model `pretrain`), which the methods reading them check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from omegaconf import DictConfig

from stages.core.cli import stage_main
from stages.core.config import configure_runtime, section, section_help
from stages.core.settings import PretrainConfig

if TYPE_CHECKING:
    import torch

    from stages.models.nets import DenoisingAutoencoder


@dataclass
class UnlabelledInputs:
    """The only columns pretraining may see."""

    id: np.ndarray
    split: np.ndarray
    x: np.ndarray


def read_inputs(dataset: str) -> UnlabelledInputs:
    """id, split and x of the prepared file — the label columns are never read — with the
    checks every reader of prepared rows makes (metadata, schema, finite x), before any work."""
    from stages.core.artifacts import finite_x, prepared_meta, prepared_path
    from stages.core.io import ArtifactError, read_parquet

    path = prepared_path(dataset)
    if not path.is_file():
        raise ArtifactError(
            f"{path}: prepared data not found; it is made by the prepare stage "
            f"(`python -m stages.prepare {dataset}` or `dvc repro prepare@{dataset}`)"
        )
    meta, schema = prepared_meta(path)
    table = read_parquet(path, schema, columns=["id", "split", "x"])
    ids = table.column("id").to_numpy()
    x = finite_x(table.column("x"), ids, meta, path)  # NaN would train to NaN weights and embeddings
    split = np.asarray(table.column("split").to_pylist(), dtype=object)
    if not (split == "train").any():
        raise ArtifactError(f"{path}: split 'train' has no rows")
    return UnlabelledInputs(ids, split, x)


def fit_dae(
    x_train: np.ndarray, cfg: PretrainConfig, generator: torch.Generator
) -> tuple[DenoisingAutoencoder, float]:
    """Train a DenoisingAutoencoder on `x_train`; returns (model, last-epoch mean MSE)."""
    import torch
    import torch.nn.functional as F

    from stages.core.runtime import progress
    from stages.models.nets import DenoisingAutoencoder
    from stages.models.training import NonFiniteLoss, run_epoch

    x = torch.tensor(np.asarray(x_train, dtype=np.float32))
    dae = DenoisingAutoencoder(x.shape[1], cfg.hidden)
    dae.standardize.fit(x)
    with torch.no_grad():
        clean = dae.standardize(x)
    optimizer = torch.optim.AdamW(dae.parameters(), lr=cfg.lr, weight_decay=0.0)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        noise = torch.randn(batch["x"].shape, generator=generator) * cfg.noise_std
        return F.mse_loss(dae(batch["x"] + noise), batch["x"])

    mse = float("nan")
    dae.train()
    for epoch in progress(range(1, cfg.epochs + 1), desc="pretrain dae", total=cfg.epochs, unit="epoch"):
        try:
            mse = run_epoch({"x": clean}, step, optimizer, cfg.batch_size, generator)
        except NonFiniteLoss as e:  # the stage names itself; the key is this section's lr
            e.epoch, e.key, e.lr = epoch, "pretrain.lr", cfg.lr
            raise
    return dae.eval(), mse


def run(params: DictConfig, dataset: str) -> str:
    import pyarrow as pa

    from stages.core import provenance
    from stages.core.artifacts import embeddings_schema, prepared_path, pretrained_dir
    from stages.core.io import PROVENANCE, check_writable, numpy_to_fixed_list, write_parquet
    from stages.core.runtime import setup_torch
    from stages.models import EMBEDDINGS, ENCODER, atomic_dir, save_encoder
    from stages.models.training import NonFiniteLoss

    cfg = section(params, "pretrain", PretrainConfig)
    configure_runtime(params)  # before any data is read: a device this machine lacks stops it now
    inputs = read_inputs(dataset)
    check_writable(folders=[pretrained_dir(dataset)])  # before any work, not after it
    generator = setup_torch(cfg.seed)
    try:
        dae, mse = fit_dae(inputs.x[inputs.split == "train"], cfg, generator)
    except NonFiniteLoss as e:
        e.where = f"pretrain@{dataset}"
        raise
    z = dae.embed(inputs.x)
    table = pa.table(
        {"id": pa.array(inputs.id, pa.int64()), "split": pa.array(inputs.split.tolist(), pa.string()), "z": numpy_to_fixed_list(z)}
    )
    made = provenance.record(
        dataset=dataset, model="pretrain", kind=cfg.kind, seed=cfg.seed, stage=f"pretrain@{dataset}", config=cfg,
        inputs=[prepared_path(dataset)],
    )
    out = pretrained_dir(dataset)
    with atomic_dir(out) as tmp:
        save_encoder(tmp / ENCODER, dae, provenance=made)
        meta = {"dataset": dataset, "hidden": cfg.hidden, PROVENANCE: made}
        write_parquet(table, tmp / EMBEDDINGS, embeddings_schema(z.shape[1]), metadata=meta)
    n_train = int((inputs.split == "train").sum())
    return f"pretrained dae on {dataset} ({n_train} train inputs, no labels): denoising MSE {mse:.3f}, embeddings dim {z.shape[1]} -> {out}"


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("pretrain", __doc__, ["dataset"], section_help("pretrain", PretrainConfig), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
