"""The baselines trained as their authors' public code trains them (issue 27 item 1), one test per
recipe point: GroupDRO's group-balanced sampling (kohpangwei/group_DRO `--reweight_groups`) and
generalization adjustment (loss.py), JTT's upsampling by copies (anniesch/jtt run_expt.py
`--up_weight`), DFR's base model = ERM's final checkpoint (deep_feature_reweighting
train_classifier.py `final_checkpoint.pt`), and DFR's warning when its tuning has too little data.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages import train
from stages.core.artifacts import model_dir, prepared_path, read_prepared
from stages.core.config import defaults
from stages.core.io import PROVENANCE, load_weights, read_json, read_weights_meta, save_weights
from stages.core.runtime import setup_torch
from stages.models import CONFIG, FINAL_WEIGHTS, WEIGHTS, load_model
from stages.models.dfr import Embedded, fit_dfr
from stages.models.groupdro import GroupDROLoss
from stages.models.jtt import jtt_copies
from stages.models.mlp import MLPClassifier
from stages.models.nets import MLPEncoder, Standardize
from stages.models.robust import copies_sampler, group_balanced_sampler
from stages.models.training import FitOptions, SplitData, cross_entropy, fit_classifier
from tests.test_train import DS, SIZES, write_prepared

# gaussian_shortcut's default train split: the minority groups hold 5 % of the rows each.
TRAIN_COUNTS = (1900, 100, 100, 1900)


def groups(counts: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.full((n,), k, dtype=torch.int64) for k, n in enumerate(counts)])


# ---- GroupDRO: group-balanced sampling --------------------------------------------------------


def test_the_group_balanced_sampler_draws_every_group_equally_often():
    """10 epochs of len(train) draws with replacement: each group's count is within 5 binomial
    standard deviations (5·sqrt(N·¼·¾) = 433 of 10,000) of an even split."""
    g = groups(TRAIN_COUNTS)
    draw = group_balanced_sampler(g, 4)
    gen = torch.Generator().manual_seed(0)
    epochs = [draw(gen) for _ in range(10)]
    assert all(len(e) == len(g) for e in epochs)  # an epoch is len(train) draws
    rows = torch.cat(epochs)
    counts = torch.bincount(g[rows], minlength=4)
    tolerance = 5 * math.sqrt(len(rows) * 0.25 * 0.75)
    assert all(abs(int(c) - len(rows) / 4) <= tolerance for c in counts), counts
    # With replacement: the 100 rows of a minority group fill a quarter of each epoch (repeats),
    # while a majority row is drawn about a quarter of the time.
    assert torch.bincount(epochs[0], minlength=len(g))[1900:2000].max() > 1


def test_the_sampler_is_the_published_weighted_random_sampler():
    """data/dro_dataset.py: WeightedRandomSampler(len(self) / group_counts[g], len(self),
    replacement=True); drawn from the same generator state, the rows are the same."""
    from torch.utils.data import WeightedRandomSampler

    g = groups((50, 7, 3, 40))
    weights = len(g) / torch.bincount(g).double()
    ours = group_balanced_sampler(g, 4)(torch.Generator().manual_seed(5))
    published = list(WeightedRandomSampler(weights[g], len(g), replacement=True, generator=torch.Generator().manual_seed(5)))
    assert ours.tolist() == published


def tiny_splits(counts: tuple[int, ...], seed: int = 0) -> dict[str, SplitData]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, cs in (("train", counts), ("val", (40, 10, 10, 40))):
        g = groups(cs)
        y = g // 2
        x = torch.from_numpy(np.column_stack([(2 * y.numpy() - 1) + rng.standard_normal(len(g)),
                                              rng.standard_normal(len(g))]).astype(np.float32))
        out[name] = SplitData(x, y, g)
    return out


class Recorder:
    """cross-entropy that records the groups of every training batch (not the val objective)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        self.seen.append(batch["g"].clone())
        return cross_entropy(logits, batch)

    def held_out(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return cross_entropy(logits, batch)


def test_the_training_loop_trains_on_the_rows_the_sampler_draws():
    """fit_loop with the group-balanced sampler: an epoch is len(train) rows, groups near even
    (within 5 binomial SDs over 4 epochs); without a sampler it is one permutation of train."""
    counts = (380, 20, 20, 380)
    splits = tiny_splits(counts)
    g = splits["train"].g
    for sampler in (group_balanced_sampler(g, 4), None):
        gen = setup_torch(0)
        model = MLPClassifier(MLPEncoder(2, [4]), 2, Standardize(2).fit(splits["train"].x))
        loss = Recorder()
        fit_classifier(model, splits, loss, FitOptions(0.01, 4, 50), gen, sampler=sampler)
        seen = torch.cat(loss.seen)
        assert len(seen) == 4 * len(g)
        per_group = torch.bincount(seen, minlength=4)
        if sampler is None:
            assert per_group.tolist() == [4 * n for n in counts]
        else:
            tolerance = 5 * math.sqrt(len(seen) * 0.25 * 0.75)
            assert all(abs(int(c) - len(seen) / 4) <= tolerance for c in per_group), per_group


# ---- GroupDRO: the generalization adjustment --------------------------------------------------


def test_the_adjustment_adds_c_over_root_n_to_the_group_losses_of_the_weight_update():
    """loss.py `compute_robust_loss`: adjusted_g = loss_g + C/sqrt(n_g) (n_g: train counts),
    q ← q·exp(eta·adjusted) renormalised, loss = adjusted @ q (the gradient of loss @ q)."""
    counts = torch.tensor([400, 100, 25, 0])
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.5], [-1.0, 1.0], [1.0, 0.0], [0.0, 3.0]])
    batch = {"y": torch.tensor([0, 1, 1, 1, 0]), "g": torch.tensor([0, 1, 1, 2, 0])}
    eta, c = 0.5, 2.0
    loss = GroupDROLoss(4, eta, adjustment=c, group_counts=counts)
    value = loss(logits, batch)
    per = torch.nn.functional.cross_entropy(logits, batch["y"], reduction="none")
    group_loss = torch.tensor([per[[0, 4]].mean(), per[[1, 2]].mean(), per[3], 0.0])
    adjust = torch.tensor([c / 20, c / 10, c / 5, 0.0])  # no train row in group 3: no adjustment
    q = torch.full((4,), 0.25) * torch.exp(eta * (group_loss + adjust))
    q = q / q.sum()
    assert torch.allclose(loss.q, q) and torch.isclose(value, (group_loss + adjust) @ q)
    # The gradient is that of the unadjusted loss under the same q.
    plain = GroupDROLoss(4, eta)
    plain.q = torch.full((4,), 0.25)
    assert torch.allclose(loss.group_losses(logits, batch) - plain.group_losses(logits, batch), adjust)
    # C = 0 (every README command) is the unadjusted update; the held-out objective never has it.
    zero = GroupDROLoss(4, eta, adjustment=0.0, group_counts=counts)
    zero(logits, batch)
    q0 = torch.full((4,), 0.25) * torch.exp(eta * group_loss)
    assert torch.allclose(zero.q, q0 / q0.sum())
    assert torch.equal(loss.held_out(logits, batch), zero.held_out(logits, batch))


def test_the_groupdro_defaults_are_the_published_recipe():
    cfg = defaults("method", "groupdro")
    assert (cfg.sampling, cfg.eta, cfg.adjustment) == ("balanced", 0.01, 0.0)
    # On the built-ins groupdro trains with erm's optimiser and decay: the two differ only in the method.
    erm = defaults("method", "erm")
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.epochs, cfg.batch_size, cfg.hidden) == \
        (erm.optimizer, erm.lr, erm.weight_decay, erm.epochs, erm.batch_size, erm.hidden)
    jtt = defaults("method", "jtt")
    assert (jtt.upsample, jtt.upweight) == ("copies", 100.0)
    assert defaults("method", "dfr").base == "final"


# ---- JTT: upsampling by copies ----------------------------------------------------------------


def test_jtt_copies_make_an_error_count_lambda_plus_one_times_and_the_epoch_longer():
    errors = torch.zeros(50, dtype=torch.bool)
    errors[[3, 7, 11, 20, 41]] = True
    copies = jtt_copies(errors, 6)
    assert int(copies.sum()) == 50 + 6 * 5  # n + λ·|errors|
    epoch = copies_sampler(copies)(torch.Generator().manual_seed(0))
    seen = torch.bincount(epoch, minlength=50)
    assert len(epoch) == 80 and seen[errors].tolist() == [7] * 5 and seen[~errors].tolist() == [1] * 45
    # Through the loop: every epoch trains on the 80 rows.
    splits = tiny_splits((20, 5, 5, 20))
    copies = jtt_copies(splits["train"].g == 1, 6)  # group 1's 5 rows as the errors
    model = MLPClassifier(MLPEncoder(2, [4]), 2, Standardize(2).fit(splits["train"].x))
    loss = Recorder()
    fit_classifier(model, splits, loss, FitOptions(0.01, 3, 16), setup_torch(0), sampler=copies_sampler(copies))
    assert len(torch.cat(loss.seen)) == 3 * int(copies.sum()) == 3 * (50 + 6 * 5)


@pytest.fixture
def workdir(workdir):
    """conftest's workdir with a small prepared file (tests/test_train.py)."""
    write_prepared(workdir)
    return workdir


def test_the_jtt_stage_records_its_upsampled_epoch(workdir):
    fast = ["method.jtt.epochs=2", "method.jtt.id_epochs=1", "method.jtt.id_epochs_grid=[]", "method.jtt.hidden=[8]", "method.jtt.upweight=10"]
    assert train.main([DS, "jtt", "0", *fast]) == 0
    record = read_json(model_dir(DS, "jtt", 0) / CONFIG)["jtt"]
    assert record["upsample"] == "copies" and record["n_train"] == SIZES["train"]
    assert record["epoch_rows"] == SIZES["train"] + 10 * record["n_errors"] and record["n_errors"] > 0


def test_a_streamed_split_trains_on_the_same_sampled_rows(workdir):
    """runtime.stream: the rows a sampler draws, with their repeats, in the stream's windowed
    shuffle: one epoch of copies gives every row its count; group-balanced epochs through the
    loop are near even (5 binomial SDs over 4 epochs); both stages run streamed."""
    from stages.core.stream import PreparedFile
    from stages.models.training import split_data

    splits = split_data(PreparedFile.open(prepared_path(DS)))
    train_split = splits["train"]
    copies = jtt_copies(train_split.g == 1, 4)
    rows = torch.cat([b["index"] for b in train_split.epoch(64, torch.Generator().manual_seed(0), 100, 0,
                                                            counts=copies.numpy())])
    assert torch.equal(torch.bincount(rows, minlength=len(train_split)), copies)

    x = torch.from_numpy(read_prepared(prepared_path(DS)).subset("train").x)
    model = MLPClassifier(MLPEncoder(4, [4]), 2, Standardize(4).fit(x))
    loss = Recorder()
    fit_classifier(model, splits, loss, FitOptions(0.01, 4, 50), setup_torch(0),
                   sampler=group_balanced_sampler(train_split.g, 4))
    seen = torch.cat(loss.seen)
    assert len(seen) == 4 * len(train_split)
    tolerance = 5 * math.sqrt(len(seen) * 0.25 * 0.75)
    assert all(abs(int(c) - len(seen) / 4) <= tolerance for c in torch.bincount(seen, minlength=4))
    for method in ("groupdro", "jtt"):
        extra = ["method.jtt.id_epochs=1", "method.jtt.id_epochs_grid=[]", "method.jtt.upweight=5"] if method == "jtt" else []
        assert train.main([DS, method, "0", "runtime.stream=true", f"method.{method}.epochs=2", *extra]) == 0
        assert read_json(model_dir(DS, method, 0) / CONFIG)["runtime"]["stream"] is True


# ---- DFR: the base model is ERM's final checkpoint --------------------------------------------


def test_fit_loop_returns_the_last_epochs_weights_beside_the_selected_ones():
    splits = tiny_splits((60, 10, 10, 60))
    model = MLPClassifier(MLPEncoder(2, [4]), 2, Standardize(2).fit(splits["train"].x))
    result = fit_classifier(model, splits, cross_entropy, FitOptions(0.05, 6, 16, "val_worst_group"), setup_torch(0))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in result.final_state_dict.items())  # the model holds its last epoch
    if result.selected_epoch != 6:
        assert any(not torch.equal(v, result.state_dict[k]) for k, v in result.final_state_dict.items())


def test_dfr_reads_the_final_erm_checkpoint_not_the_selected_one(workdir):
    """ERM's folder keeps both weights with one provenance; dfr (base: final) re-trains the head of
    final.safetensors — here made to differ from model.safetensors — and records that file as
    its input; base: selected reads model.safetensors."""
    fast = ["method.erm.epochs=4", "method.erm.hidden=[8]"]
    assert train.main([DS, "erm", "0", *fast]) == 0
    folder = model_dir(DS, "erm", 0)
    final, final_meta = load_weights(folder / FINAL_WEIGHTS)
    selected, selected_meta = load_weights(folder / WEIGHTS)
    provenance = read_weights_meta(folder / FINAL_WEIGHTS)[PROVENANCE]
    assert final_meta == selected_meta and set(final) == set(selected)
    assert provenance == read_weights_meta(folder / WEIGHTS)[PROVENANCE] == read_json(folder / CONFIG)[PROVENANCE]
    assert read_json(folder / CONFIG)["final_epoch"] == 4
    # Make the last epoch's encoder unmistakable (same architecture and provenance).
    marked = {k: v * 2 if k.startswith("encoder.") else v for k, v in final.items()}
    save_weights(marked, folder / FINAL_WEIGHTS, meta=final_meta, provenance=provenance)

    for base, expected, name in (("final", marked, FINAL_WEIGHTS), ("selected", selected, WEIGHTS)):
        assert train.main([DS, "dfr", "0", *fast, f"method.dfr.base={base}", "method.dfr.n_refits=2"]) == 0  # erm's settings too
        dfr = load_model(model_dir(DS, "dfr", 0)).state_dict()
        assert all(torch.equal(dfr[k], v) for k, v in expected.items() if k.startswith("encoder."))
        config = read_json(model_dir(DS, "dfr", 0) / CONFIG)
        assert config["dfr"]["base"] == base and config["dfr"]["features_from"] == str(folder / name)
        assert str(folder / name) in config["provenance"]["inputs"]


def test_dfr_base_final_of_a_model_without_epochs_is_an_error_naming_the_key(workdir, capsys):
    assert train.main([DS, "lda", "0"]) == 0
    assert not (model_dir(DS, "lda", 0) / FINAL_WEIGHTS).exists()  # fitted once: no last epoch
    assert train.main([DS, "dfr", "0", "method.dfr.features=lda"]) == 2
    err = capsys.readouterr().err
    assert "method.dfr.base" in err and "set method.dfr.base=selected" in err


# ---- DFR: tuning on a tiny validation set warns --------------------------------------------------


def embedded(rng: np.random.Generator, per_group: int) -> Embedded:
    g = np.repeat(np.arange(4), per_group)
    y = g // 2
    z = np.column_stack([(2 * y - 1) + rng.standard_normal(len(g)), rng.standard_normal((len(g), 3))])
    return Embedded(z, y, g)


def test_dfr_tuning_on_a_tiny_val_split_warns_instead_of_picking_silently():
    """~12 fit rows (3 per group): L1 with small C zeroes every weight — the issue's case."""
    rng = np.random.default_rng(0)
    cfg = defaults("method", "dfr", scaler="val")
    val = embedded(rng, 8)
    tiny = fit_dfr(val, 2, cfg, seed=0)
    warning = tiny.summary["warning"]
    fit_rows = 4 * int(np.bincount(val.g[tiny.halvings[0][0]]).min())  # the fit half, balanced
    assert warning is not None and "all-zero head" in warning
    assert f"fitted on {fit_rows} val rows" in warning and fit_rows <= 12
    zero = [row["c"] for row, cand in zip(tiny.summary["grid"], tiny.candidates, strict=True)
            if all(not np.any(w) for w, _ in cand.heads)]
    assert zero and f"C in {zero}" in warning
    # A val split with room to tune: no warning.
    assert fit_dfr(embedded(rng, 300), 2, cfg, seed=0).summary["warning"] is None


def test_the_dfr_stage_prints_the_warning_in_one_line_and_keeps_it_in_config_json(workdir, capsys):
    assert train.main([DS, "erm", "0", "method.erm.epochs=2", "method.erm.hidden=[8]"]) == 0
    capsys.readouterr()
    # C values this small zero every weight of an L1 fit on any val split.
    assert train.main([DS, "dfr", "0", "method.erm.epochs=2", "method.erm.hidden=[8]", "method.dfr.c_grid=[0.001,0.0001]",
                       "method.dfr.n_refits=2"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    config = read_json(model_dir(DS, "dfr", 0) / CONFIG)
    assert len(lines) == 1 and lines[0] == f"method.dfr on {DS} seed 0: warning: {config['dfr']['warning']}"
    assert "all-zero head" in lines[0]
