"""MoE router statistics in a d9d train task: ``python examples/d9d_moe_task.py``.

``MoETask`` is a ``d9d.loop.control.TrainTask`` for a tiny causal LM whose
feed-forward blocks are d9d's own ``MoELayer`` (``d9d.module.block.moe``),
kept in a ``ModuleDict`` keyed by global layer index as d9d's models do.

* ``create_metrics`` returns ``{"train": g}``, one ``dk.MetricGroup`` of the
  loss and ``dk.ExpertLoad`` over every MoE layer: the router statistics sync
  in the group's one collective.
* The MoE layers count their routed tokens themselves (``tokens_per_expert``).
  ``register_events`` subscribes to two d9d loop events that fire on every
  rank, every pipeline stage included (``update_metrics`` runs on the last
  stage only): ``EVENT_TRAIN_MODEL_STAGES_READY`` keeps the stages, and
  ``EVENT_TRAIN_FORWARD_BACKWARD_POST`` (after the step's microbatches,
  right before d9d starts the metrics' sync) adds every stage's counters to
  the metric in one update (``ExpertLoad.update_from_model``, global layer
  ids from the module names) and zeroes them. Nothing reads a tensor on the
  host. Each logging step logs ``train/router/max_violation``,
  ``dead_experts``, ``cv`` and ``entropy``.

d9d's own loop needs CUDA (its metric collector, the MoE layer's token
dispatch and grouped-GEMM experts). So that this file runs on any machine,
``main`` drives the calls the loop makes, in its order, on CPU: the event
bus with the same two events, ``build_forward_inputs`` -> model ->
``compute_loss`` -> backward -> ``update_metrics`` per microbatch, and on
logging steps ``metrics.sync(ctx)`` (when distributed), ``compute()``,
``reset()``. On CPU the MoE forward is ``moe_forward``: d9d's router and
its token counter as they are, the experts' SwiGLU as dense torch over the
layer's grouped weights (``MoELayer.forward`` itself on CUDA).

    python examples/d9d_moe_task.py [--steps 6] [--log-every 3] [--layers 4] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import cast

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
    RegisterTaskEventsContext,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.event import EventBus
from d9d.loop.event.catalogue.common import EventModelStagesReadyContext, EventStepContext
from d9d.loop.event.catalogue.train import EVENT_TRAIN_FORWARD_BACKWARD_POST, EVENT_TRAIN_MODEL_STAGES_READY
from d9d.metric.impl.container import ComposeMetric
from d9d.module.block.moe import MoELayer

import d9d_kernels as dk
from d9d_kernels.metrics.expert_load import moe_layers

ROUTER_KEYS = ("max_violation", "dead_experts", "cv", "entropy")


class MoETask(TrainTask):
    """Next-token prediction with router statistics of every MoE layer."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._stages: list[torch.nn.Module] = []
        self._router: dk.ExpertLoad | None = None

    def register_events(self, ctx: RegisterTaskEventsContext) -> None:
        ctx.event_bus.subscribe(EVENT_TRAIN_MODEL_STAGES_READY, self._keep_stages)
        ctx.event_bus.subscribe(EVENT_TRAIN_FORWARD_BACKWARD_POST, self._read_routers)

    def _keep_stages(self, ctx: EventModelStagesReadyContext) -> None:
        self._stages = list(ctx.modules)

    def _read_routers(self, ctx: EventStepContext) -> None:
        # every rank: this stage's MoE layers, by global layer id, in one update; counters zeroed
        router = self._router
        assert router is not None, "create_metrics runs before the first step"
        for stage in self._stages:
            if moe_layers(stage):
                router.update_from_model(stage)

    def build_forward_inputs(self, ctx: BuildForwardInputsContext) -> BuildForwardInputsResult:
        return BuildForwardInputsResult(input={"input_ids": ctx.batch["input_ids"]}, shared={},
                                        state={"labels": ctx.batch["labels"]})

    def compute_loss(self, ctx: ComputeLossContext) -> ComputeLossResult:
        logits, labels = ctx.pipeline_results["logits"], ctx.state["labels"]
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten())
        tokens = torch.tensor(float(labels.numel()), device=labels.device)
        ctx.state.update(loss=loss.detach(), tokens=tokens)
        return ComputeLossResult(loss=loss, loss_weight=tokens)

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        g = dk.MetricGroup({
            "loss": dk.WeightedMeanMetric(),
            "router": dk.ExpertLoad(self.num_experts, num_layers=self.num_layers, top_k=self.top_k),
        })
        self._router = cast(dk.ExpertLoad, g["router"])
        return CreateMetricsResult(metrics={"train": g})

    def update_metrics(self, ctx: UpdateMetricsContext) -> None:
        g = cast(dk.MetricGroup, ctx.metrics["train"])  # d9d types the children as its Metric
        g["loss"].update(values=ctx.state["loss"], weights=ctx.state["tokens"])


def moe_forward(moe: MoELayer, h: torch.Tensor) -> torch.Tensor:
    """``moe(h)`` on CUDA; on CPU d9d's router and token counter, then the
    grouped SwiGLU experts as dense torch (every expert on every token,
    weighted by the routed probabilities: the same output for tiny sizes)."""
    if h.is_cuda:
        return moe(h)
    x = h.reshape(-1, h.shape[-1])
    routing = moe.router(x)
    moe._update_tokens_per_expert(routing.selected_expert_indices)
    weights = torch.zeros(x.shape[0], moe._num_grouped_experts, dtype=x.dtype)
    weights.scatter_(1, routing.selected_expert_indices, routing.selected_probabilities.to(x.dtype))
    ex = moe.grouped_experts
    gate = torch.einsum("nd,edi->eni", x, ex.gate_proj.weight)
    up = torch.einsum("nd,edi->eni", x, ex.up_proj.weight)
    out = torch.einsum("eni,eid->end", F.silu(gate) * up, ex.down_proj.weight)
    return torch.einsum("end,ne->nd", out, weights).reshape(h.shape)


class Block(torch.nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int):
        super().__init__()
        self.mlp = MoELayer(hidden_dim=dim, intermediate_dim_grouped=dim, num_grouped_experts=experts, top_k=top_k,
                            router_renormalize_probabilities=True)
        self.mlp.reset_parameters()

    def forward(self, h):
        return h + moe_forward(self.mlp, h)


class TinyMoELM(torch.nn.Module):
    """Embedding, ``layers`` MoE blocks keyed by global layer index, LM head."""

    def __init__(self, vocab: int, layers: int, experts: int, top_k: int, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleDict({str(i): Block(dim, experts, top_k) for i in range(layers)})
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for block in self.layers.values():
            h = block(h)
        return {"logits": self.head(h)}


def local_dist_context() -> DistributedContext:
    """A non-distributed d9d ``DistributedContext`` on a CPU-only machine
    (``DeviceMeshParameters().build()`` calls ``torch.cuda.set_device``; this
    sets what its constructor sets for a non-distributed run, as
    examples/d9d_task.py does)."""
    ctx = object.__new__(DistributedContext)
    ctx._params = DeviceMeshParameters()
    ctx._meshes = {}
    ctx._num_nodes = 1
    ctx._logger = logging.getLogger("d9d_moe_task")
    ctx._local_rank = ctx._global_rank = ctx._node_rank = 0
    ctx._master_addr = "127.0.0.1"
    ctx._current_device = torch.device("cpu")
    return ctx


@dataclass
class Run:
    """Per logging step: the logged values and the routing (``[layer][microbatch] -> indices``) they cover."""

    logged: list
    routing: list


def run(steps: int = 6, microbatches: int = 2, log_every: int = 3, layers: int = 4, experts: int = 8, top_k: int = 2,
        vocab: int = 40, batch: int = 4, seq: int = 12, seed: int = 0) -> Run:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    dist_context = local_dist_context()
    task = MoETask(layers, experts, top_k)
    model = TinyMoELM(vocab, layers, experts, top_k)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # d9d.loop.run.train: the event bus, the task's events, the metrics, the stages
    bus = EventBus()
    task.register_events(RegisterTaskEventsContext(dist_context=dist_context, event_bus=bus))
    metrics = ComposeMetric(task.create_metrics(CreateMetricsContext()).metrics)
    bus.trigger(EVENT_TRAIN_MODEL_STAGES_READY, EventModelStagesReadyContext(modules=[model]))
    # what the routers chose, for the caller's checks (the metric never sees these)
    seen: dict[int, list] = {i: [] for i in range(layers)}
    for i, blk in model.layers.items():
        router = cast(torch.nn.Module, cast(torch.nn.Module, blk).mlp).router
        cast(torch.nn.Module, router).register_forward_hook(
            lambda mod, args, out, i=int(i): seen[i].append(out.selected_expert_indices.detach().clone()))
    out = Run([], [])
    for step in range(1, steps + 1):
        opt.zero_grad()
        for _ in range(microbatches):
            ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
            inputs = task.build_forward_inputs(BuildForwardInputsContext(batch={"input_ids": ids[:, :-1],
                                                                                "labels": ids[:, 1:]}))
            result = task.compute_loss(ComputeLossContext(pipeline_results=model(**inputs.input), state=inputs.state,
                                                          schedule=None))  # type: ignore[arg-type]  # no pipeline here
            assert result.loss_weight is not None
            (result.loss * result.loss_weight).backward()
            task.update_metrics(UpdateMetricsContext(state=inputs.state, metrics=metrics.children))
        bus.trigger(EVENT_TRAIN_FORWARD_BACKWARD_POST, EventStepContext(schedule=None))  # type: ignore[arg-type]
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= microbatches * batch * seq
        opt.step()
        if step % log_every == 0 or step == steps:
            # AsyncMetricCollector.schedule_collection + collect_results, on the current stream
            if dist_context.mesh_params.is_distributed:
                metrics.sync(dist_context)
            out.logged.append((step, pytree.tree_map(lambda x: cast(torch.Tensor, x).clone(), metrics.compute())))
            metrics.reset()
            out.routing.append([seen[i][:] for i in range(layers)])
            for v in seen.values():
                v.clear()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python examples/d9d_moe_task.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--log-every", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    r = run(a.steps, a.microbatches, a.log_every, a.layers, a.experts, a.top_k, seed=a.seed)
    print("step", "loss", *ROUTER_KEYS)
    for step, values in r.logged:
        t = values["train"]
        print(step, f"{t['loss'].item():.4f}", *(f"{t['router'][k].item():.4f}" for k in ROUTER_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
