"""MoE router statistics logged by d9d's training loop: ``python examples/d9d_moe_task.py``.

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
  host.

``train`` runs d9d's own trainer, ``TrainingConfigurator(...).configure()
.train()``, with this task, the model as pipeline stages (``MoEStage``: the
embedding on the first, the head on the last, the MoE blocks split between
them), a deterministic token stream and SGD. Each logging step the tracker
gets ``train/loss`` and ``train/router/max_violation``, ``dead_experts``,
``cv`` and ``entropy`` (``main`` uses d9d's log tracker: one log line each).

Without a GPU: d9d's loop calls CUDA (device, streams, events, meshes), so
``train`` first installs ``d9d_cpu_standin`` (next to this file: a CPU
stand-in for exactly those calls, for tests and examples only), and the
MoE forward is ``moe_forward``: d9d's router and token counter as they are,
the experts' SwiGLU as dense torch over the layer's grouped weights (d9d's
token dispatch and grouped GEMM need CUDA; ``MoELayer.forward`` itself runs
on CUDA). ``tests/test_example_moe.py`` runs ``train`` on one process and on
4 gloo ranks (pp 2 x dp 2).

    python examples/d9d_moe_task.py [--steps 6] [--log-every 3] [--layers 4] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from d9d.core.dist_context import BATCH_DOMAIN, DENSE_DOMAIN, DeviceMeshParameters
from d9d.loop.control import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    CreateMetricsContext,
    CreateMetricsResult,
    InitializeDataProviderContext,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    ParallelizeModelStageContext,
    RegisterTaskEventsContext,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.event.catalogue.common import EventModelStagesReadyContext, EventStepContext
from d9d.loop.event.catalogue.train import EVENT_TRAIN_FORWARD_BACKWARD_POST, EVENT_TRAIN_MODEL_STAGES_READY
from d9d.core.types import MicrobatchPack
from d9d.module.block.moe import MoELayer
from torch.distributed.tensor import DTensor

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

    def forward(self, h):
        return h + moe_forward(self.mlp, h)


class MoEStage(torch.nn.Module):
    """One pipeline stage of the tiny MoE LM: the embedding on the first
    stage, the MoE blocks ``layer_ids`` (a ``ModuleDict`` keyed by global
    layer index: ``layers.<i>.mlp``), the LM head on the last. d9d calls it
    with the pipeline inputs (first stage) or the previous stage's outputs."""

    def __init__(self, vocab: int, dim: int, layer_ids: range, experts: int, top_k: int, first: bool, last: bool):
        super().__init__()
        self.dim = dim
        self.emb = torch.nn.Embedding(vocab, dim) if first else None
        self.layers = torch.nn.ModuleDict({str(i): Block(dim, experts, top_k) for i in layer_ids})
        self.head = torch.nn.Linear(dim, vocab) if last else None

    def reset_parameters(self):
        for m in (self.emb, self.head):
            if m is not None:
                m.reset_parameters()
        for block in self.layers.values():
            cast(Block, block).mlp.reset_parameters()

    def forward(self, inputs: dict, shared: dict) -> dict:
        h = self.emb(inputs["input_ids"]) if self.emb is not None else inputs["hidden"]
        for block in self.layers.values():
            h = block(h)
        return {"logits": self.head(h)} if self.head is not None else {"hidden": h}

    def stage_transfer_spec(self, pipeline_input: dict, boundary) -> dict:
        from d9d.pipelining.api import TensorSpec

        return {"hidden": TensorSpec(shape=(*pipeline_input["input_ids"].shape, self.dim), dtype=torch.float32)}


def stage_layers(layers: int, stage: int, stages: int) -> range:
    """The global layer ids of pipeline stage ``stage`` of ``stages``."""
    return range(stage * layers // stages, (stage + 1) * layers // stages)


class MoEModelProvider(ModelProvider[MoEStage]):
    """d9d's model provider: ``MoEStage`` for each stage, replicated over the data ranks
    (experts included: a tiny model needs no expert parallelism)."""

    def __init__(self, vocab: int, dim: int, layers: int, experts: int, top_k: int):
        self.vocab, self.dim, self.layers, self.experts, self.top_k = vocab, dim, layers, experts, top_k

    def initialize_model_stage(self, ctx: InitializeModelStageContext) -> InitializeModelStageResult[MoEStage]:
        from d9d.model_state.mapper.compose import ModelStateMapperParallel
        from d9d.model_state.mapper.leaf import ModelStateMapperIdentity

        s = ctx.stage
        model = MoEStage(self.vocab, self.dim, stage_layers(self.layers, s.current_stage, s.num_stages), self.experts,
                         self.top_k, s.is_current_stage_first, s.is_current_stage_last)
        mapper = ModelStateMapperParallel([ModelStateMapperIdentity(n) for n, _ in model.named_parameters()])
        return InitializeModelStageResult(model=model, state_mapper=mapper)

    def parallelize_model_stage(self, ctx: ParallelizeModelStageContext[MoEStage]) -> None:
        from d9d.module.parallelism.api import parallelize_replicate

        if not ctx.dist_context.mesh_params.is_distributed:
            return  # one process: no mesh
        mesh = ctx.dist_context.mesh_for(DENSE_DOMAIN)
        parallelize_replicate(ctx.model, mesh["dp_replicate", "dp_cp_shard", "cp_replicate", "tp"])
        # That made every buffer a DTensor too. A layer's token counter counts this rank's tokens
        # (d9d's expert-parallel style distributes the experts and the router, never the counter):
        # it stays a plain tensor.
        for block in ctx.model.layers.values():
            moe = cast(Block, block).mlp
            counter = cast(DTensor, moe.tokens_per_expert).to_local()
            moe.register_buffer("tokens_per_expert", counter, persistent=False)


class TokenStream:
    """Microbatch packs of random tokens: microbatch ``i`` of step ``s`` on data rank ``dp``
    from seed ``seed + 1000 s + 10 dp + i``; the position is checkpointed."""

    def __init__(self, dp: int, steps: int, microbatches: int, vocab: int, batch: int, seq: int, seed: int):
        self.dp, self.steps, self.microbatches = dp, steps, microbatches
        self.vocab, self.batch, self.seq, self.seed = vocab, batch, seq, seed
        self.step = 0

    def microbatch(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + 1000 * self.step + 10 * self.dp + i)
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def __iter__(self) -> Iterator[MicrobatchPack]:
        while self.step < self.steps:
            self.step += 1
            yield [self.microbatch(i) for i in range(self.microbatches)]

    @property
    def total_steps(self) -> int | None:
        return self.steps

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def train(mesh: DeviceMeshParameters | None = None, *, steps: int = 6, microbatches: int = 2, log_every: int = 3,
          layers: int = 4, experts: int = 8, top_k: int = 2, vocab: int = 40, dim: int = 16, batch: int = 4,
          seq: int = 12, seed: int = 0, tracker=None, save_dir: str | None = None,
          task_cls: type[MoETask] = MoETask) -> None:
    """Runs d9d's trainer on this task: ``mesh`` (default: one process),
    metrics to ``tracker`` (a d9d tracker config, default d9d's log tracker)
    every ``log_every`` steps, checkpoints off (``save_dir``: where d9d looks
    for one to resume; default a fresh temporary folder). ``task_cls``: the
    task class (a subclass can observe the stages, as the tests do)."""
    from d9d.loop.config import (
        CheckpointingConfig,
        DataPrefetchConfig,
        DeterminismConfig,
        GarbageCollectionConfig,
        GradientClippingConfig,
        JobLoggerConfig,
        StepActionSpecial,
        TrainerConfig,
    )
    from d9d.loop.run import TrainingConfigurator
    from d9d.tracker import RunConfig
    from d9d.tracker.provider.log import LogTrackerConfig

    on_gpu = torch.cuda.is_available()  # asked once: the stand-in reports a device
    if not on_gpu:
        import d9d_cpu_standin  # examples/d9d_cpu_standin.py (this file's folder is on sys.path)

        d9d_cpu_standin.install()
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainerConfig(
            run=RunConfig(name="d9d_moe_task"),
            logging=JobLoggerConfig(period_steps=log_every, tracker=tracker or LogTrackerConfig()),
            determinism=DeterminismConfig(base_seed=seed),
            gc=GarbageCollectionConfig(period_steps=100),
            checkpointing=CheckpointingConfig(save_dir=Path(save_dir or tmp), period_steps=StepActionSpecial.disable),
            gradient_clipping=GradientClippingConfig(max_norm=None),
            # prefetching copies packs on a side CUDA stream: on CPU there is nothing to copy
            data_prefetch=DataPrefetchConfig(prefetch_factor=1 if on_gpu else 0),
        )

        def task_provider(ctx):
            return task_cls(layers, experts, top_k)

        def data_provider(context: InitializeDataProviderContext) -> TokenStream:
            dc = context.dist_context
            dp = dc.mesh_for(BATCH_DOMAIN)["dp"].get_local_rank() if dc.mesh_params.is_distributed else 0
            return TokenStream(dp, steps, microbatches, vocab, batch, seq, seed)

        def optimizer_provider(ctx):
            return torch.optim.SGD(ctx.model.parameters(), lr=0.5)

        def lr_scheduler_provider(ctx):
            return torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, lambda s: 1.0)

        model_provider = MoEModelProvider(vocab, dim, layers, experts, top_k)
        TrainingConfigurator(mesh or DeviceMeshParameters(), config, task_provider, model_provider, data_provider,
                             optimizer_provider, lr_scheduler_provider).configure().train()


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
    train(steps=a.steps, microbatches=a.microbatches, log_every=a.log_every, layers=a.layers, experts=a.experts,
          top_k=a.top_k, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
