"""A d9d train task whose metrics are one ``dk.MetricGroup``: ``python examples/d9d_task.py``.

``LMTask`` is a ``d9d.loop.control.TrainTask`` for a causal language model:

* ``create_metrics`` returns ``{"train": g}``, one ``dk.MetricGroup`` of the
  loss (``WeightedMeanMetric``, weighted by the microbatch's token count), the
  token count (``SumMetric``), accuracy, top-5 accuracy and perplexity. d9d's
  loop wraps the dict in its ``ComposeMetric``.
* ``compute_loss`` writes the loss, the logits and the token count into the
  microbatch's state (d9d's ``PipelineStateHandler`` keeps tensors written
  there and detaches them when the microbatch ends).
* ``update_metrics`` feeds the group from that state: the two aggregation
  members one by one, then ``g.update(preds=logits, target=labels)``, one
  fused kernel call for accuracy, top-5 and perplexity. Labels equal to
  ``IGNORE_INDEX`` (-100) are left out by every member; nothing reads a
  tensor on the host.

d9d's own loop (``d9d.loop.run``) needs CUDA (docs/d9d.md lists where). So
that this file runs on any machine, ``main`` drives the same calls the loop
makes, in the loop's order, on CPU with a tiny random model:
``build_forward_inputs`` -> model -> ``compute_loss`` -> backward ->
``update_metrics`` per microbatch, and on logging steps what
``AsyncMetricCollector.schedule_collection`` / ``collect_results`` do:
``metrics.sync(dist_context)`` when the context is distributed, a copy of
``metrics.compute()``, ``metrics.reset()``. The context is a non-distributed
d9d ``DistributedContext`` from ``DeviceMeshParameters().build()`` (see
``local_dist_context``), so, as in d9d's collector, no sync runs. d9d's real
trainer runs this task in ``tests/d9d/test_d9d_trainer.py``.

    python examples/d9d_task.py [--steps 6] [--microbatches 2] [--log-every 3] [--vocab 50]
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

import torch
import torch.nn.functional as F
from d9d.core import pytree
from d9d.core.dist_context import DeviceMeshParameters, DistributedContext
from d9d.loop.control import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    CreateMetricsContext,
    CreateMetricsResult,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.metric.impl.container import ComposeMetric

import d9d_kernels as dk

IGNORE_INDEX = -100


class LMTask(TrainTask):
    """Next-token prediction; batches are ``{"input_ids": [B, T], "labels": [B, T]}``."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def build_forward_inputs(self, ctx: BuildForwardInputsContext) -> BuildForwardInputsResult:
        return BuildForwardInputsResult(input={"input_ids": ctx.batch["input_ids"]}, shared={},
                                        state={"labels": ctx.batch["labels"]})

    def compute_loss(self, ctx: ComputeLossContext) -> ComputeLossResult:
        logits, labels = ctx.pipeline_results["logits"], ctx.state["labels"]
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)
        tokens = (labels != IGNORE_INDEX).sum()  # a 0-d tensor: counting on the device reads nothing on the host
        # update_metrics only sees the state: the loss, logits and count travel in it
        ctx.state.update(loss=loss.detach(), logits=logits.detach(), tokens=tokens)
        # weight = token count: d9d's gradient sync then averages the loss over tokens, as the metric does
        return ComputeLossResult(loss=loss, loss_weight=tokens.to(loss.dtype))

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        V = self.vocab_size
        kw: dict[str, Any] = dict(task="multiclass", num_classes=V, ignore_index=IGNORE_INDEX)
        g = dk.MetricGroup({
            "loss": dk.WeightedMeanMetric(),
            "tokens": dk.SumMetric(),
            "acc": dk.Accuracy(**kw),
            "top5": dk.Accuracy(**kw, top_k=min(5, V)),
            # num_classes: perplexity shares the accuracies' kernel call (one pass over the logits)
            "ppl": dk.Perplexity(ignore_index=IGNORE_INDEX, num_classes=V),
        })
        return CreateMetricsResult(metrics={"train": g})

    def update_metrics(self, ctx: UpdateMetricsContext) -> None:
        g, s = cast(dk.MetricGroup, ctx.metrics["train"]), ctx.state  # d9d types the children as its Metric
        g["loss"].update(values=s["loss"], weights=s["tokens"])
        g["tokens"].update(values=s["tokens"])
        g.update(preds=s["logits"], target=s["labels"])  # acc, top5, ppl: the members taking (preds, target)


def loss_and_lse(hidden, weight, bias, labels):
    """The LM loss and the per-token logsumexp without logits: d9d's fused
    linear cross-entropy (``d9d.kernel.cce``, cut-cross-entropy: ``pip install
    d9d[cce]``, CUDA) where it runs; elsewhere the same two values from plain
    torch (this example's CPU fallback, which does make the small logits)."""
    h, y = hidden.flatten(0, -2), labels.flatten()
    if h.is_cuda:
        try:
            from d9d.kernel.cce import linear_cross_entropy
        except ImportError:
            linear_cross_entropy = None
        if linear_cross_entropy is not None:
            return linear_cross_entropy(h, weight, y, bias=bias, ignore_index=IGNORE_INDEX, return_lse=True)
    logits = F.linear(h, weight, bias).float()
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX), torch.logsumexp(logits, -1)


class HiddenLMTask(LMTask):
    """``LMTask`` for a model whose logits never exist (the LM head is fused
    into the loss): accuracy, top-5 and perplexity come from the hidden states
    and the head's weight through ``dk.LinearLogits``, the loss kernel's
    logsumexp reused (no exp pass in the metrics).

    ``every`` = 1 updates them at every microbatch: one more pass over the
    vocabulary per microbatch, about one LM-head forward (docs/d9d.md). With
    ``every`` = k they are updated only on the microbatches of every k-th
    step (``microbatches`` per step, counted here: d9d calls
    ``update_metrics`` once per microbatch), so they describe those steps'
    tokens, a sample, for a k-th of the cost; the loss and the token count
    are still fed at every microbatch."""

    def __init__(self, vocab_size: int, every: int = 1, microbatches: int = 1):
        super().__init__(vocab_size)
        self.every, self.microbatches, self._calls = every, microbatches, 0

    def compute_loss(self, ctx: ComputeLossContext) -> ComputeLossResult:
        out, labels = ctx.pipeline_results, ctx.state["labels"]
        loss, lse = loss_and_lse(out["hidden"], out["weight"], out["bias"], labels)
        tokens = (labels != IGNORE_INDEX).sum()
        ctx.state.update(loss=loss.detach(), tokens=tokens, hidden=out["hidden"].detach(), lse=lse.detach(),
                         weight=out["weight"].detach(), bias=out["bias"].detach())
        return ComputeLossResult(loss=loss, loss_weight=tokens.to(loss.dtype))

    def update_metrics(self, ctx: UpdateMetricsContext) -> None:
        g, s = cast(dk.MetricGroup, ctx.metrics["train"]), ctx.state  # d9d types the children as its Metric
        g["loss"].update(values=s["loss"], weights=s["tokens"])
        g["tokens"].update(values=s["tokens"])
        step = self._calls // self.microbatches + 1
        self._calls += 1
        if step % self.every == 0:  # acc, top5, ppl: one pass over the vocabulary, no [N, V] tensor
            g.update(preds=dk.LinearLogits(s["hidden"], s["weight"], s["bias"]), target=s["labels"].flatten(),
                     lse=s["lse"])


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int = 32, hidden_out: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.hidden_out = hidden_out

    def forward(self, input_ids):
        h = torch.tanh(self.emb(input_ids))
        if self.hidden_out:  # the head is applied inside the loss
            return {"hidden": h.flatten(0, -2), "weight": self.head.weight, "bias": self.head.bias}
        return {"logits": self.head(h)}


def local_dist_context() -> DistributedContext:
    """A non-distributed d9d ``DistributedContext``, built by d9d's own constructor.

    On a machine without CUDA, the constructor's two CUDA calls are held off
    while it runs: it divides the rank by ``torch.cuda.device_count()`` (0
    there) and calls ``torch.cuda.set_device`` (d9d/core/dist_context/configured.py).
    Nothing else of the context touches CUDA in a non-distributed run."""
    params = DeviceMeshParameters()
    if torch.cuda.is_available():
        return params.build()
    with mock.patch.object(torch.cuda, "device_count", return_value=1), mock.patch.object(torch.cuda, "set_device"):
        return params.build(log_level=logging.WARNING)


def make_batch(gen: torch.Generator, vocab: int, batch: int, seq: int) -> dict:
    """Random tokens; labels are the next token, padding (a random tail per row) is IGNORE_INDEX."""
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    labels = ids[:, 1:].clone()
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    labels[torch.arange(seq)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels}


@dataclass
class Run:
    """What ``run`` returns: per logging step, the computed values and the microbatches they cover."""

    logged: list  # [(step, {"train": {name: tensor}})]
    microbatches: list  # [[{"logits", "labels", "loss", "tokens"}, ...]] one list per logging step


def run(steps: int = 6, microbatches: int = 2, log_every: int = 3, vocab: int = 50, batch: int = 4, seq: int = 16,
        seed: int = 0, hidden: bool = False, every: int = 1) -> Run:
    """``hidden``: the ``HiddenLMTask`` (metrics from hidden states), its
    token metrics updated at every ``every``-th step."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    dist_context = local_dist_context()
    task = HiddenLMTask(vocab, every, microbatches) if hidden else LMTask(vocab)
    model = TinyLM(vocab, hidden_out=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # d9d.loop.run.train: metrics = ComposeMetric(task.create_metrics(CreateMetricsContext()).metrics)
    metrics = ComposeMetric(task.create_metrics(CreateMetricsContext()).metrics)
    out, window = Run([], []), []
    for step in range(1, steps + 1):
        opt.zero_grad()
        for _ in range(microbatches):  # one step's pack
            inputs = task.build_forward_inputs(BuildForwardInputsContext(batch=make_batch(gen, vocab, batch, seq)))
            state = inputs.state
            result = task.compute_loss(ComputeLossContext(pipeline_results=model(**inputs.input), state=state,
                                                          schedule=None))  # type: ignore[arg-type]  # no JobSchedule outside d9d's loop
            # d9d's LossComputer backpropagates loss * weight; its gradient manager divides by the total weight
            assert result.loss_weight is not None  # the tasks above always give the token count
            (result.loss * result.loss_weight).backward()
            task.update_metrics(UpdateMetricsContext(state=state, metrics=metrics.children))
            if hidden:  # what the logits were, for the caller's checks (never made by the metrics)
                state["logits"] = F.linear(state["hidden"], state["weight"], state["bias"]).detach()
            window.append({k: state[k] for k in ("logits", "labels", "loss", "tokens")})
        total = sum(float(mb["tokens"]) for mb in window[-microbatches:])
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= max(total, 1.0)
        opt.step()
        if step % log_every == 0 or step == steps:
            # AsyncMetricCollector.schedule_collection + collect_results, on the current stream
            if dist_context.mesh_params.is_distributed:
                metrics.sync(dist_context)
            values = pytree.tree_map(lambda x: cast(torch.Tensor, x).clone(), metrics.compute())
            metrics.reset()
            out.logged.append((step, values))
            out.microbatches.append(window)
            window = []
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python examples/d9d_task.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--log-every", type=int, default=3)
    p.add_argument("--vocab", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", action="store_true",
                   help="the model's logits never exist: metrics from hidden states x the LM head (dk.LinearLogits)")
    p.add_argument("--every", type=int, default=1, help="with --hidden: token metrics at every k-th step only")
    a = p.parse_args(argv)
    if min(a.steps, a.microbatches, a.log_every, a.every) < 1 or a.vocab < 2:
        p.error("--steps, --microbatches, --log-every and --every must be >= 1, --vocab >= 2")
    res = run(a.steps, a.microbatches, a.log_every, a.vocab, seed=a.seed, hidden=a.hidden, every=a.every)
    names = list(res.logged[0][1]["train"])
    print("step  " + "  ".join(f"{n:>10s}" for n in names))
    for step, values in res.logged:
        print(f"{step:>4d}  " + "  ".join(f"{float(values['train'][n]):>10.4f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
