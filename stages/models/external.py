"""Weights of the field's networks (timm, diffusers, transformers) from a local safetensors file.

Nothing downloads: a config names the file (`weights: path/to/file.safetensors`), and
`load_external` reads it with safetensors (never unpickling), checks every tensor against the
network built from config and loads it, returning the file's sha256 for config.json. A missing
file, a file that is not safetensors, or tensors that do not fit are one-line errors naming the
file and the config key. The file is the library's own state_dict (e.g. timm's
`resnet50.a1_in1k` converted with `safetensors.torch.save_file(model.state_dict(), path)`);
heads that differ from the task's (an ImageNet classifier's 1000 outputs) are listed in `skip`
and keep their fresh initialisation.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from stages.core.io import ArtifactError
from stages.core.schema import LOCAL_FILES

if TYPE_CHECKING:
    from torch import nn



def local_files(cfg: object) -> list[Path]:
    """The files a method config's LOCAL_FILES keys name (unset keys left out)."""
    return [Path(v) for v in (getattr(cfg, k, None) for k in LOCAL_FILES) if v]


def load_external(
    module: nn.Module, path: str | os.PathLike[str], key: str, skip: Iterable[str] = (), prefix: str = ""
) -> str:
    """Load `path` into `module` (names under `prefix` in the file; tensors whose name starts with one
    of `skip` are left as initialised) and return the file's sha256.

    Every other tensor of `module` must be in the file with the same shape; a tensor of another
    dtype is cast to the module's. Errors name the file and `key` (the config key that named it).
    """
    import torch
    from safetensors import SafetensorError, safe_open

    from stages.core.provenance import file_sha256

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(
            f"{path}: weights file not found ({key}); shiftlab never downloads weights: save the "
            f"network's state_dict with safetensors.torch.save_file and name that file in {key}"
        )
    skip = tuple(skip)
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            want = {k: v for k, v in module.state_dict().items() if not k.startswith(skip)}
            missing = sorted(k for k in want if prefix + k not in names)
            if missing:
                raise ArtifactError(
                    f"{path}: not weights of this network ({key}): {len(missing)} tensor(s) missing, e.g. "
                    f"{missing[:3]}; the file holds e.g. {sorted(names)[:3]}"
                )
            state = {}
            for k, v in want.items():
                t = f.get_tensor(prefix + k)
                if tuple(t.shape) != tuple(v.shape):
                    raise ArtifactError(
                        f"{path}: tensor '{prefix + k}' is {tuple(t.shape)}, the network this method's config builds "
                        f"needs {tuple(v.shape)} ({key})"
                    )
                state[k] = t.to(v.dtype)
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{path}: not a valid safetensors file ({key}): {e}") from None
    with torch.no_grad():
        module.load_state_dict(state, strict=False)
    return file_sha256(path)


def file_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of a safetensors file, read from its header only; {} when the file is
    missing or not safetensors (`external.load_external` then reports it, naming the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no items())
    except (SafetensorError, OSError, ValueError):
        return {}
