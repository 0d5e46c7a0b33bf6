"""CUDA graphs: a training step with a group update captures and replays.

The planned update (d9d_kernels/core/plan.py) makes no allocation
and no host read after warm-up and writes into buffers whose addresses never
change, so ``torch.cuda.graph`` can capture it: each replay adds the step's
batch exactly as an eager update does (compared with an eager group and with
plain-torch references on the same batches)."""

from __future__ import annotations

import pytest
import torch

import d9d_kernels as dk

pytestmark = pytest.mark.gpu

C, B, D = 10, 256, 32


def _group(dev):
    kw = dict(task="multiclass", num_classes=C)
    return dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "acc": dk.Accuracy(**kw),
        "top5": dk.Accuracy(**kw, top_k=5),
        "f1": dk.F1Score(**kw, average="macro"),
        "cm": dk.ConfusionMatrix(**kw),
    }, device=dev)


def _batches(n, dev):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, D, generator=g).to(dev), torch.randint(0, C, (B,), generator=g).to(dev)) for _ in range(n)]


def test_training_step_with_group_update_captures_and_replays():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(D, C).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every replay sees the same weights as the eager copy
    g, ref = _group(dev), _group(dev)
    static_x, static_y = torch.zeros(B, D, device=dev), torch.zeros(B, dtype=torch.int64, device=dev)
    n_tokens = torch.tensor(float(B), device=dev)

    def step(x, y, grp):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        grp["loss"].update(values=loss.detach(), weights=n_tokens)
        grp.update(preds=logits.detach(), target=y)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: plans, autograd and optimizer state
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            step(static_x, static_y, g)
    torch.cuda.current_stream().wait_stream(s)
    g.reset()
    assert g._storage.plans, "the update runs through its recorded plans"
    ptrs = {k: v.data_ptr() for k, v in g._storage.local.items()}

    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        step(static_x, static_y, g)
    g.reset()  # capture does not run the kernels; the state stays empty until the replays

    batches = _batches(4, dev)
    losses = []
    for x, y in batches:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        with torch.no_grad():
            losses.append(torch.nn.functional.cross_entropy(model(x), y))
        opt.zero_grad(set_to_none=False)
        step(x, y, ref)
    torch.cuda.synchronize()
    assert {k: v.data_ptr() for k, v in g._storage.local.items()} == ptrs, "stable addresses"

    g._storage.dirty = True  # replays run no Python: the storage is told its local state changed
    got, want = g.compute(), ref.compute()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=0, msg=name)
    logits = torch.cat([model(x) for x, _ in batches]).detach()
    target = torch.cat([y for _, y in batches])
    assert got["acc"].item() == pytest.approx((logits.argmax(1) == target).double().mean().item(), abs=1e-12)
    assert got["loss"].item() == pytest.approx(torch.stack(losses).double().mean().item(), rel=1e-6)
    cm = torch.bincount(target * C + logits.argmax(1), minlength=C * C).reshape(C, C)
    assert torch.equal(got["cm"].to(torch.int64).cpu(), cm.cpu())


def test_group_update_makes_no_host_sync_after_warmup():
    dev = torch.device("cuda")
    g = _group(dev)
    (x, y), = _batches(1, dev)
    logits, loss, n = torch.randn(B, C, device=dev), torch.rand((), device=dev), torch.tensor(float(B), device=dev)
    for _ in range(2):
        g["loss"].update(values=loss, weights=n)
        g.update(preds=logits, target=y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            g["loss"].update(values=loss, weights=n)
            g.update(preds=logits, target=y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
