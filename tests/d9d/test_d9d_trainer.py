"""d9d's real trainer as the integration test: ``TrainingConfigurator(...).configure().train()``.

Four gloo ranks run d9d 0.24's own training loop (meshes, pipeline schedule,
gradient sync, ``AsyncMetricCollector``, ``JobLogger`` and tracker,
``StateCheckpointer``) with a tiny language model and ``examples/d9d_task.py``'s
``LMTask``: one ``dk.MetricGroup`` (loss, tokens, accuracy, top-5, perplexity)
from ``create_metrics``, fed in ``update_metrics``. d9d's CUDA calls are
replaced by ``examples/d9d_cpu_standin.py``; nothing else is.

Layouts: dp_shard 2 x tp 2 (each tp pair sees the same data) and pp 2 x
dp_shard 2 (two pipeline stages, only the last computes the loss). Every
logged window (values as they reach the tracker, on every rank) is compared
with plain torch over the distinct microbatches of that window; a run
stopped by an exception in the middle of a window and resumed from d9d's
checkpoint logs exactly what an uninterrupted run logs.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("d9d.metric")  # "d9d" alone could be this test folder (a namespace package)

from tests.dist_utils import run_distributed  # noqa: E402

V, BATCH, SEQ, MICROBATCHES = 16, 2, 8, 2
STEPS, LOG_EVERY, CKPT_EVERY = 6, 2, 3  # windows end at steps 2, 4, 6; the checkpoint at 3 is mid-window
STOP_AT = 4  # the interrupted run raises after step 4's forward/backward (its metrics updated, not logged)
IGNORE = -100
LAYOUTS = {
    "dp_tp": dict(data_parallel_shard=2, tensor_parallel=2),
    "pp_dp": dict(pipeline_parallel=2, data_parallel_shard=2),
}
NAMES = ("loss", "tokens", "acc", "top5", "ppl")


def microbatch(step: int, dp: int, i: int) -> dict:
    """The data: microbatch ``i`` of step ``step`` (1-based) on data-parallel rank ``dp``."""
    g = torch.Generator().manual_seed(1000 * step + 10 * dp + i)
    ids = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=g)
    labels[torch.arange(SEQ)[None, :] >= lengths[:, None]] = IGNORE
    return {"input_ids": ids[:, :-1], "labels": labels}


class _Stop(Exception):
    """Raised inside the trainer to stop a run mid-window."""


# ---------------------------------------------------------------- d9d providers (built in the rank)
def _providers(stop: bool, records: list):
    from d9d.core.dist_context import BATCH_DOMAIN, DENSE_DOMAIN
    from d9d.loop.control import (
        InitializeModelStageResult,
        TrainTaskProviderContext,
    )
    from d9d.loop.event.catalogue.train import EVENT_TRAIN_FORWARD_BACKWARD_POST
    from d9d.model_state.mapper.compose import ModelStateMapperParallel
    from d9d.model_state.mapper.leaf import ModelStateMapperIdentity
    from d9d.module.parallelism.api import parallelize_replicate
    from d9d.pipelining.api import TensorSpec

    from examples.d9d_task import LMTask

    class Stage(torch.nn.Module):
        """A tiny LM, split at the hidden states: stage 0 embeds, the last stage applies the head."""

        def __init__(self, first: bool, last: bool):
            super().__init__()
            self.first, self.last = first, last
            self.emb = torch.nn.Embedding(V, 8) if first else None
            self.head = torch.nn.Linear(8, V) if last else None

        def reset_parameters(self):
            for m in (self.emb, self.head):
                if m is not None:
                    m.reset_parameters()

        def forward(self, inputs: dict, shared: dict) -> dict:  # d9d's stage call: the previous stage's outputs
            h = torch.tanh(self.emb(inputs["input_ids"])) if self.first else inputs["hidden"]
            return {"logits": self.head(h)} if self.last else {"hidden": h}

        def stage_transfer_spec(self, pipeline_input: dict, boundary) -> dict:
            return {"hidden": TensorSpec(shape=(*pipeline_input["input_ids"].shape, 8), dtype=torch.float32)}

    class ModelProvider:
        def initialize_model_stage(self, ctx):
            stage = ctx.stage
            torch.manual_seed(stage.current_stage)  # the same weights in every run and on every replica
            model = Stage(stage.is_current_stage_first, stage.is_current_stage_last)
            mapper = ModelStateMapperParallel([ModelStateMapperIdentity(n) for n, _ in model.named_parameters()])
            return InitializeModelStageResult(model=model, state_mapper=mapper)

        def parallelize_model_stage(self, ctx):
            # a replica on every rank of the stage: gradients averaged over the data and tp ranks
            mesh = ctx.dist_context.mesh_for(DENSE_DOMAIN)
            parallelize_replicate(ctx.model, mesh["dp_replicate", "dp_cp_shard", "cp_replicate", "tp"])

        def register_events(self, ctx):
            pass

        def dump_hparams(self):
            return {}

    class Stream:
        """Microbatch packs of this rank's data-parallel shard; its position is checkpointed."""

        def __init__(self, dp: int):
            self.dp, self.step = dp, 0

        def __iter__(self):
            while self.step < STEPS:
                self.step += 1
                yield [microbatch(self.step, self.dp, i) for i in range(MICROBATCHES)]

        @property
        def total_steps(self):
            return STEPS

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = int(sd["step"])

    def data_provider(ctx):
        dc = ctx.dist_context
        return Stream(dc.mesh_for(BATCH_DOMAIN)["dp"].get_local_rank())

    class RecordingTask(LMTask):
        """``examples/d9d_task.py``'s task; also records what each microbatch fed the metrics."""

        def __init__(self, dp: int):
            super().__init__(V)
            self.dp, self.last_step, self.index = dp, None, 0

        def compute_loss(self, ctx):
            step = ctx.schedule.current_step + 1
            self.index = self.index + 1 if step == self.last_step else 0  # the microbatch's index in its step
            self.last_step = step
            ctx.state["key"] = (step, self.dp, self.index)
            return super().compute_loss(ctx)

        def update_metrics(self, ctx):
            super().update_metrics(ctx)
            s = ctx.state
            records.append(dict(key=s["key"], labels=s["labels"].tolist(), logits=s["logits"].tolist()))

        def register_events(self, ctx):
            if stop:
                def halt(ev):
                    if ev.schedule.current_step + 1 == STOP_AT:
                        raise _Stop(f"stopped at step {STOP_AT}")
                ctx.event_bus.subscribe(EVENT_TRAIN_FORWARD_BACKWARD_POST, halt)

    def task_provider(ctx: TrainTaskProviderContext):
        return RecordingTask(ctx.dist_context.mesh_for(BATCH_DOMAIN)["dp"].get_local_rank())

    def optimizer_provider(ctx):
        return torch.optim.SGD(ctx.model.parameters(), lr=0.5)

    def lr_scheduler_provider(ctx):
        return torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, lambda s: 1.0)

    return task_provider, ModelProvider(), data_provider, optimizer_provider, lr_scheduler_provider


def _config(tmp: str, tag: str):
    from d9d.loop.config import (
        CheckpointingConfig,
        DataPrefetchConfig,
        DeterminismConfig,
        GarbageCollectionConfig,
        GradientClippingConfig,
        JobLoggerConfig,
        TrainerConfig,
    )
    from d9d.tracker import RunConfig
    from d9d.tracker.provider.null import NullTrackerConfig

    return TrainerConfig(
        run=RunConfig(name=tag),
        logging=JobLoggerConfig(period_steps=LOG_EVERY, tracker=NullTrackerConfig()),
        determinism=DeterminismConfig(base_seed=0),
        gc=GarbageCollectionConfig(period_steps=100),
        checkpointing=CheckpointingConfig(save_dir=f"{tmp}/{tag}", period_steps=CKPT_EVERY),
        gradient_clipping=GradientClippingConfig(max_norm=None),
        # prefetching copies packs on a side CUDA stream (Tensor.record_stream): on CPU there is nothing to copy
        data_prefetch=DataPrefetchConfig(prefetch_factor=0),
    )


def _train(layout: str, tmp: str, tag: str, stop: bool) -> list:
    from d9d.core.dist_context import DeviceMeshParameters
    from d9d.loop.run import TrainingConfigurator

    records: list = []
    providers = _providers(stop, records)
    trainer = TrainingConfigurator(DeviceMeshParameters(**LAYOUTS[layout]), _config(tmp, tag), *providers).configure()
    try:
        trainer.train()
    except _Stop:
        assert stop
    return records


def _worker(rank: int, world: int, tmp: str) -> dict:
    from d9d.tracker.provider.null import NullRun

    from tests.example_loader import cpu_standin

    cpu_standin().install()
    logged: list = []

    def write(self, point, value):  # what d9d's JobLogger hands to the tracker (rank > 0: a null tracker)
        if point.name.startswith("train/"):
            logged.append((point.step + 1, point.name[len("train/"):], value.value.item()))

    NullRun.write = write
    out: dict = {}
    for layout in LAYOUTS:
        for tag, stop, save_dir in (("full", False, "full"), ("stopped", True, "stopped"),
                                    ("resumed", False, "stopped")):  # resumed: the stopped run's checkpoints
            del logged[:]
            records = _train(layout, tmp, f"{layout}-{save_dir}", stop)
            out[layout, tag] = dict(logged=list(logged), records=records)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("d9d_trainer")), timeout=300, pg_timeout=60)


# ---------------------------------------------------------------- the reference: plain torch over the data
def _windows(logged: list) -> dict:
    """``{step: {name: value}}`` of the logged windows."""
    out: dict = {}
    for step, name, value in logged:
        out.setdefault(step, {})[name] = value
    return out


def _reference(records: list, window_end: int) -> dict:
    """Plain torch over the distinct microbatches of the window ending at ``window_end``:
    every (step, dp rank, microbatch) once, labels from the data definition."""
    logits, labels, seen = [], [], {}
    for r in records:
        key = r["key"]
        if window_end - LOG_EVERY < key[0] <= window_end:
            assert torch.equal(torch.tensor(r["labels"]), microbatch(*key)["labels"]), key
            if key in seen:  # a tp replica: the same microbatch, the same logits
                assert seen[key] == r["logits"], key
                continue
            seen[key] = r["logits"]
            logits.append(torch.tensor(r["logits"], dtype=torch.float64).flatten(0, -2))
            labels.append(torch.tensor(r["labels"]).flatten())
    dps = 2
    assert sorted(seen) == [(s, d, i) for s in range(window_end - LOG_EVERY + 1, window_end + 1)
                            for d in range(dps) for i in range(MICROBATCHES)]
    z, y = torch.cat(logits), torch.cat(labels)
    keep = y != IGNORE
    z, y = z[keep], y[keep]
    nll = torch.nn.functional.cross_entropy(z, y, reduction="none")
    top5 = z.topk(5, dim=-1).indices
    tokens = sum(int((microbatch(*k)["labels"] != IGNORE).sum()) for k in seen)
    return {"loss": float(nll.mean()), "tokens": float(tokens), "acc": float((z.argmax(-1) == y).double().mean()),
            "top5": float((top5 == y[:, None]).any(-1).double().mean()), "ppl": math.exp(float(nll.mean()))}


def _all_records(runs: list, layout: str, tag: str) -> list:
    return [r for out in runs for r in out[layout, tag]["records"]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logged_windows_equal_plain_torch(runs, layout):
    """Every rank logs, at every logging step, plain torch's values over the window's
    distinct tokens: tp replicas and pipeline stages count nothing twice."""
    records = _all_records(runs, layout, "full")
    ends = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for rank, out in enumerate(runs):
        windows = _windows(out[layout, "full"]["logged"])
        assert sorted(windows) == ends, (rank, sorted(windows))
        for end in ends:
            want, got = _reference(records, end), windows[end]
            assert set(got) == set(NAMES), got
            assert got["tokens"] == want["tokens"], (layout, rank, end, got["tokens"], want["tokens"])
            for name in NAMES:
                assert got[name] == pytest.approx(want[name], rel=1e-6), (layout, rank, end, name, got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_mid_window_equals_uninterrupted(runs, layout):
    """Stopped by an exception at step STOP_AT, after the checkpoint at CKPT_EVERY in the
    same window, and resumed from d9d's checkpoint: every window logged after the
    resume is bit for bit the uninterrupted run's (the checkpointed part of the window
    is restored, nothing lost or counted twice)."""
    resumed_from = CKPT_EVERY
    for rank, out in enumerate(runs):
        full = _windows(out[layout, "full"]["logged"])
        stopped = _windows(out[layout, "stopped"]["logged"])
        resumed = _windows(out[layout, "resumed"]["logged"])
        assert sorted(stopped) == [e for e in full if e < STOP_AT], (rank, sorted(stopped))
        assert sorted(resumed) == [e for e in full if e > resumed_from], (rank, sorted(resumed))
        for end, values in {**stopped, **resumed}.items():
            assert values == full[end], (layout, rank, end, values, full[end])
    # the resumed run recomputed from the checkpoint: its first microbatches are the step after it
    steps = sorted({r["key"][0] for r in _all_records(runs, layout, "resumed")})
    assert steps == list(range(resumed_from + 1, STEPS + 1)), steps
