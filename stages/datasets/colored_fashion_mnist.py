"""`colored_fashion_mnist`: IRM's Colored MNIST construction (stages/datasets/coloured_idx.py) on
Fashion-MNIST's real images (Xiao et al. 2017, Zalando's release).

The label is the class index < 5, as MNIST's is the digit < 5: y = 1 for T-shirt/top (0),
Trouser (1), Pullover (2), Dress (3) and Coat (4); y = 0 for Sandal (5), Shirt (6), Sneaker (7),
Bag (8) and Ankle boot (9) — then flipped with probability `label_noise`, and coloured as IRM
colours MNIST. Everything else (splits, ρ, seeds, ids) is the shared construction's. The Debian
package ships the IDX files gzipped (`*-ubyte.gz`; their decompressed bytes are Zalando's
published ones). Data: stage fetch@fashion_mnist. See docs/datasets.md.
"""

from __future__ import annotations

from stages.core.registry import register_dataset
from stages.datasets import Generated
from stages.datasets.coloured_idx import ColouredIdxConfig, generate

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def generate_fashion(cfg: ColouredIdxConfig) -> Generated:
    return generate(cfg, [" / ".join(CLASSES[5:]), " / ".join(CLASSES[:5])])


register_dataset("colored_fashion_mnist", ColouredIdxConfig, generate=generate_fashion)
