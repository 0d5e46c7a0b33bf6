"""Dice / GeneralizedDiceScore / MeanIoU vs torchmetrics.segmentation 1.9
(DiceScore, GeneralizedDiceScore, MeanIoU) over several updates, every
input format (one-hot ints, one-hot float scores, index, mixed), with
absent classes and empty samples; MeanIoU's ignore_index vs torchmetrics on
the kept pixels; bad input names metric and argument, state intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics import segmentation as tms

import d9d_kernels as dk
from tests.metrics._catalogue_utils import quiet

C = 4


def _batch(rng, fmt, n=3, hw=(5, 6), absent=True):
    """(preds, target) in ``fmt``; class C-1 absent from some samples' targets,
    one sample all background (empty foreground)."""
    hi = C - 1 if absent else C
    p = rng.integers(0, C, size=(n, *hw))
    t = rng.integers(0, hi, size=(n, *hw))
    t[0] = 0
    p, t = torch.tensor(p), torch.tensor(t)
    hot = lambda x: torch.nn.functional.one_hot(x, C).movedim(-1, 1)  # noqa: E731
    if fmt == "index":
        return p, t
    if fmt == "mixed":
        return hot(p), t
    if fmt == "mixed_t":
        return p, hot(t)
    if fmt == "scores":  # float one-hot: argmax over dim 1
        return torch.tensor(rng.normal(0, 1, size=(n, C, *hw))), hot(t)
    if fmt == "bool":
        return hot(p).bool(), hot(t).bool()
    if fmt == "multihot":  # independent 0/1 channels, as torchmetrics' docstrings use
        return torch.tensor(rng.integers(0, 2, size=(n, C, *hw))), torch.tensor(rng.integers(0, 2, size=(n, C, *hw)))
    return hot(p), hot(t)


def _fmt_arg(fmt):
    return {"index": "index", "mixed": "mixed", "mixed_t": "mixed"}.get(fmt, "one-hot")


FORMATS = ["one-hot", "bool", "multihot", "scores", "index", "mixed", "mixed_t"]


def _run(ours, ref, rng, fmt, updates=3):
    for _ in range(updates):
        preds, target = _batch(rng, fmt)
        ours.update(preds, target)
        quiet(ref.update, preds, target)
    a, e = ours.compute(), quiet(ref.compute)
    np.testing.assert_allclose(a.double().numpy().reshape(-1), e.double().numpy().reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
@pytest.mark.parametrize("level", ["samplewise", "global"])
@pytest.mark.parametrize("background", [True, False])
def test_dice_matches_torchmetrics(fmt, average, level, background):
    rng = np.random.default_rng(len(fmt) + len(average))
    kw = dict(num_classes=C, include_background=background, average=average, aggregation_level=level,
              input_format=_fmt_arg(fmt))
    _run(dk.Dice(**kw), quiet(tms.DiceScore, **kw), rng, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("weight_type", ["square", "simple", "linear"])
@pytest.mark.parametrize("per_class", [False, True])
@pytest.mark.parametrize("background", [True, False])
def test_generalized_dice_matches_torchmetrics(fmt, weight_type, per_class, background):
    rng = np.random.default_rng(len(fmt) * 3 + len(weight_type))
    kw = dict(num_classes=C, include_background=background, per_class=per_class, weight_type=weight_type,
              input_format=_fmt_arg(fmt))
    _run(dk.GeneralizedDiceScore(**kw), tms.GeneralizedDiceScore(**kw), rng, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("per_class", [False, True])
@pytest.mark.parametrize("background", [True, False])
def test_mean_iou_matches_torchmetrics(fmt, per_class, background):
    rng = np.random.default_rng(len(fmt) * 5)
    kw = dict(num_classes=C, include_background=background, per_class=per_class, input_format=_fmt_arg(fmt))
    _run(dk.MeanIoU(**kw), tms.MeanIoU(**kw), rng, fmt)


def test_mean_iou_num_classes_inferred_and_2d_index_is_one_sample():
    rng = np.random.default_rng(11)
    _run(dk.MeanIoU(), tms.MeanIoU(), rng, "one-hot")
    p, t = torch.tensor(rng.integers(0, C, (6, 7))), torch.tensor(rng.integers(0, C, (6, 7)))
    ours = dk.MeanIoU(num_classes=C, input_format="index", per_class=True)
    ours.update(p, t)
    ref = tms.MeanIoU(num_classes=C, input_format="index", per_class=True)
    np.testing.assert_allclose(ours.compute().numpy(), ref(p, t).numpy(), rtol=1e-6)


@pytest.mark.parametrize("per_class", [False, True])
def test_mean_iou_ignore_index_equals_torchmetrics_on_kept_pixels(per_class):
    """torchmetrics has no ignore_index: the reference maps void pixels of the
    target to a spare class C (absent from preds) and drops that column."""
    rng = np.random.default_rng(2)
    ours = dk.MeanIoU(num_classes=C, input_format="index", per_class=per_class, ignore_index=255)
    inter = np.zeros((0, C)); union = np.zeros((0, C))
    for _ in range(3):
        p, t = rng.integers(0, C, (2, 8, 8)), rng.integers(0, C, (2, 8, 8))
        void = rng.random(t.shape) < 0.3
        t_void = np.where(void, 255, t)
        ours.update(torch.tensor(p), torch.tensor(t_void))
        ph = np.eye(C)[p] * ~void[..., None]  # void pixels leave preds too
        th = np.eye(C)[t] * ~void[..., None]
        inter = np.concatenate([inter, (ph * th).sum((1, 2))])
        union = np.concatenate([union, ((ph + th) > 0).sum((1, 2))])
    valid = union > 0
    iou = np.where(valid, inter / np.where(valid, union, 1), 0)
    if per_class:
        exp = np.where(valid.sum(0) > 0, iou.sum(0) / np.maximum(valid.sum(0), 1), -1)
    else:
        exp = iou.sum() / valid.sum()
    np.testing.assert_allclose(ours.compute().numpy(), exp, rtol=1e-12)


@pytest.mark.parametrize("cls", [dk.Dice, dk.GeneralizedDiceScore, dk.MeanIoU])
def test_bad_input_names_metric_and_argument_state_intact(cls):
    m = cls(num_classes=C, input_format="index")
    p, t = torch.randint(0, C, (2, 4, 4)), torch.randint(0, C, (2, 4, 4))
    m.update(p, t)
    before = m.compute().clone()
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"{name}.*'target'"):
        m.update(p, t[:, :3])
    with pytest.raises(TypeError, match=rf"{name}.*'preds'"):
        m.update(p.double(), t)
    torch.testing.assert_close(m.compute(), before, equal_nan=True)
    hot = cls(num_classes=C)
    with pytest.raises(ValueError, match=rf"{name}.*'num_classes'"):
        hot.update(torch.nn.functional.one_hot(p, C + 1).movedim(-1, 1), torch.nn.functional.one_hot(t, C + 1).movedim(-1, 1))
    with pytest.raises(ValueError, match=rf"{name}.*'input_format'"):
        cls(num_classes=C, input_format="onehot")
    # an index outside [0, C): counted on the device, raised by compute with the count
    m.update(p, torch.full_like(t, C))
    with pytest.raises(ValueError, match=rf"{name}: 32 pixel"):
        m.compute()


def test_group_of_segmentation_metrics_one_update():
    rng = np.random.default_rng(4)
    g = dk.MetricGroup({"dice": dk.Dice(num_classes=C, input_format="index"),
                        "gds": dk.GeneralizedDiceScore(num_classes=C, input_format="index"),
                        "miou": dk.MeanIoU(num_classes=C, input_format="index", per_class=True)})
    refs = {"dice": tms.DiceScore(num_classes=C, input_format="index"),
            "gds": tms.GeneralizedDiceScore(num_classes=C, input_format="index"),
            "miou": tms.MeanIoU(num_classes=C, input_format="index", per_class=True)}
    for _ in range(2):
        p, t = _batch(rng, "index")
        g.update(preds=p, target=t)
        for r in refs.values():
            quiet(r.update, p, t)
    out = g.compute()
    for k, r in refs.items():
        np.testing.assert_allclose(out[k].numpy().reshape(-1), quiet(r.compute).numpy().reshape(-1), rtol=1e-5)


def test_group_members_share_one_counting_pass(monkeypatch):
    from d9d_kernels.metrics import segmentation as seg

    calls = []
    real = seg.segmentation_counts
    monkeypatch.setattr(seg, "segmentation_counts", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = dk.MetricGroup({"dice": dk.Dice(num_classes=C, input_format="index"),
                        "gds": dk.GeneralizedDiceScore(num_classes=C, input_format="index"),
                        "miou": dk.MeanIoU(num_classes=C, input_format="index"),
                        "miou_bg": dk.MeanIoU(num_classes=C, input_format="index", include_background=False)})
    p, t = torch.randint(0, C, (2, 5, 5)), torch.randint(0, C, (2, 5, 5))
    g.update(preds=p, target=t)
    assert len(calls) == 2  # one per configuration (with / without background)
    t[0, 0, 0] = (t[0, 0, 0] + 1) % C  # in-place change: counted afresh
    g.update(preds=p, target=t)
    assert len(calls) == 4
    # results equal standalone metrics fed the two batches (the first one before the in-place change)
    solo = {k: type(m)(num_classes=C, input_format="index", **({"include_background": False} if k == "miou_bg" else {}))
            for k, m in g.items()}
    t0 = t.clone()
    t0[0, 0, 0] = (t0[0, 0, 0] - 1) % C
    for k, m in solo.items():
        m.update(p, t0)
        m.update(p, t)
        torch.testing.assert_close(g[k].compute(), m.compute())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["dice", "dice_global", "gds", "gds_per_class", "miou"])
def test_masked_padding_samples_equal_torchmetrics_on_the_real_ones(fmt, which):
    """DistributedSampler-style padding: duplicated samples masked out with a
    per-sample mask [N, 1, 1] leave the value of the real samples unchanged
    (GDS's infinite-weight layout included)."""
    rng = np.random.default_rng(len(fmt) + len(which))
    f = _fmt_arg(fmt)
    make = {
        "dice": lambda m: m.Dice(num_classes=C, input_format=f) if m is dk else m.DiceScore(num_classes=C, input_format=f),
        "dice_global": lambda m: getattr(m, "Dice" if m is dk else "DiceScore")(
            num_classes=C, input_format=f, aggregation_level="global", average="none"),
        "gds": lambda m: m.GeneralizedDiceScore(num_classes=C, input_format=f),
        "gds_per_class": lambda m: m.GeneralizedDiceScore(num_classes=C, input_format=f, per_class=True,
                                                          weight_type="simple"),
        "miou": lambda m: m.MeanIoU(num_classes=C, input_format=f, per_class=True),
    }[which]
    ours, ref = make(dk), quiet(make, tms)
    for _ in range(2):
        preds, target = _batch(rng, fmt, n=5)
        pad = torch.tensor([0, 1])  # two real samples duplicated as padding
        p2, t2 = torch.cat([preds, preds[pad]]), torch.cat([target, target[pad]])
        keep = torch.arange(7) < 5
        ours.update(p2, t2, mask=keep[:, None, None])
        quiet(ref.update, preds, target)
    np.testing.assert_allclose(ours.compute().numpy().reshape(-1), quiet(ref.compute).double().numpy().reshape(-1),
                               rtol=1e-5, atol=1e-6)


def test_pixel_mask_equals_ignored_void_pixels():
    """A pixel mask drops those pixels from preds and target: the same numbers
    as ignore_index on the masked pixels (checked against numpy there)."""
    rng = np.random.default_rng(9)
    by_mask = dk.MeanIoU(num_classes=C, input_format="index", per_class=True)
    by_void = dk.MeanIoU(num_classes=C, input_format="index", per_class=True, ignore_index=255)
    for _ in range(3):
        p, t = torch.tensor(rng.integers(0, C, (2, 8, 8))), torch.tensor(rng.integers(0, C, (2, 8, 8)))
        void = torch.tensor(rng.random((2, 8, 8)) < 0.3)
        by_mask.update(p, t, mask=~void)
        by_void.update(p, torch.where(void, 255, t))
    torch.testing.assert_close(by_mask.compute(), by_void.compute(), rtol=0, atol=0)
