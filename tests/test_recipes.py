"""The published-scale recipes (conf/experiment/{waterbirds,celeba,camelyon17,civilcomments}.yaml)
build the networks they name, at the recipe's resolution and sizes, and run one forward pass:
a recipe that composes but could not train (a resolution a network cannot take, attention
groups that do not divide the channels, a BERT longer than its position table) fails here,
not after a download and an hour on a GPU. Weights are not loaded (the files are the user's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from stages.core import config, registry

ROOT = Path(__file__).resolve().parents[1]
IMAGE_RECIPES = {"waterbirds": 2, "celeba": 2, "camelyon17": 2}  # recipe -> classes


def composed(recipe: str, tmp_path: Path):
    out = tmp_path / "params.yaml"
    config.compose(ROOT / "conf", out, [f"experiment={recipe}"])
    return OmegaConf.load(out)


@pytest.mark.parametrize("recipe", sorted(IMAGE_RECIPES))
def test_image_recipes_build_their_networks_at_the_published_resolution(recipe, tmp_path):
    from stages.models.backbone import TimmClassifier
    from stages.models.diffusion_model import UNetDenoiser

    params = composed(recipe, tmp_path)
    assert params.runtime.device == "auto" and params.runtime.stream is True
    res = int(params.dataset[recipe].resolution)
    shape = [3, res, res]
    built = set()
    torch.manual_seed(0)
    for name in params.run.methods:
        cfg = config.method_config(params, name)
        backbone = getattr(cfg, "backbone", None)
        if backbone not in (None, "mlp") and backbone not in built:
            net = TimmClassifier(backbone, shape, IMAGE_RECIPES[recipe]).eval()
            with torch.no_grad():
                assert net(torch.rand(1, 3 * res * res)).shape == (1, IMAGE_RECIPES[recipe])
            built.add(backbone)
        if getattr(cfg, "denoiser", None) == "unet":
            unet = UNetDenoiser(shape, IMAGE_RECIPES[recipe], cfg.unet_channels, cfg.unet_layers_per_block,
                                cfg.unet_attention, cfg.unet_norm_groups).eval()
            with torch.no_grad():
                eps = unet(torch.rand(1, 3 * res * res), torch.tensor([cfg.steps]), torch.tensor([1]))
            assert eps.shape == (1, 3 * res * res) and torch.isfinite(eps).all()
            built.add("unet")
    expected = {"camelyon17": {"densenet121", "unet"}}.get(recipe, {"resnet50", "unet"})
    assert built == expected
    # ERM, GroupDRO and JTT train with SGD as the papers' code does; the ResNet-50s start from ImageNet weights
    for name in set(params.run.methods) & {"erm", "groupdro", "jtt"}:
        cfg = config.method_config(params, name)
        assert cfg.optimizer == "sgd" and (cfg.weights is not None) == (recipe != "camelyon17")


def test_civilcomments_recipe_builds_bert_base_and_a_gpt2_small_byte_model(tmp_path):
    from stages.models.autoregressive_model import gpt2_network
    from stages.models.text import BertTextClassifier

    params = composed("civilcomments", tmp_path)
    text = config.method_config(params, "text_erm")
    assert text.encoder == "bert" and text.weights and text.vocab
    bert = BertTextClassifier(["[PAD]", "[UNK]", "[CLS]", "a"], 2, text.dim, text.max_len, text.hidden, text.layers,
                              text.heads, text.intermediate, positions=512).eval()
    assert sum(p.numel() for p in bert.bert.parameters()) > 85_000_000  # BERT-base's encoder, not a toy
    ar = config.method_config(params, "autoregressive")
    network, _ = gpt2_network(256, ar.max_len, 2, ar.d_model, ar.layers, ar.heads, ar.ff)
    assert network.config.n_layer == 12 and network.config.n_embd == 768
    assert registry.method(ar.kind).generative and registry.method(text.kind).reads_text
