"""examples/d9d_moe_task.py through d9d's real trainer: the router statistics d9d's
loop logs equal numpy's, from the top-k indices d9d's routers actually chose.

``train`` runs ``TrainingConfigurator(...).configure().train()`` in spawned gloo
processes (so the CPU stand-in for d9d's CUDA calls never patches this
process): one process (no mesh) and 4 ranks, pp 2 x dp 2, where each stage
owns half the MoE layers and each data rank routes its own tokens. Every
router's forward is recorded with a forward hook on d9d's ``TopKRouter``
(found by module name, ``layers.<i>.mlp.router``), tagged with the step d9d
reports; the values reaching the tracker (``NullRun.write``, on every rank)
must equal numpy's over the recorded routing of all ranks in each logging
window.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("d9d.module.block.moe")

from tests.dist_utils import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, LOG_EVERY, LAYERS, EXPERTS, TOP_K = 4, 2, 4, 6, 2
ROUTER_KEYS = ("max_violation", "dead_experts", "cv", "entropy")


def _summary(load: np.ndarray) -> dict:
    """The four statistics of a [L, E] load, over the layers that saw tokens."""
    E = load.shape[1]
    a = load[load.sum(1) > 0]
    mean = a.mean(1)
    p = a / a.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(1) / math.log(E)
    return dict(max_violation=(a.max(1) / mean - 1).max(), dead_experts=float((a == 0).sum()),
                cv=(a.std(1) / mean).mean(), entropy=ent.mean())


def _worker(rank: int, world: int, mesh: dict | None) -> dict:
    """Rank ``rank`` trains the example; returns what reached the tracker and what its routers chose."""
    from d9d.core.dist_context import DeviceMeshParameters
    from d9d.loop.event.catalogue.train import EVENT_TRAIN_FORWARD_BACKWARD_PRE
    from d9d.tracker.provider.null import NullRun, NullTrackerConfig

    from tests.example_loader import load_example

    ex = load_example("d9d_moe_task.py", "d9d_moe_task_example")
    logged: list = []
    routing: list = []
    NullRun.write = lambda self, point, value: logged.append((point.step, point.name, float(value.value)))

    class RecordingTask(ex.MoETask):
        """The example's task; also hooks every router of this rank's stages."""

        step = -1

        def register_events(self, ctx):
            super().register_events(ctx)
            ctx.event_bus.subscribe(EVENT_TRAIN_FORWARD_BACKWARD_PRE, self._at)

        def _at(self, ev):
            self.step = ev.schedule.current_step

        def _keep_stages(self, ctx):
            super()._keep_stages(ctx)
            for stage in ctx.modules:
                for name, mod in stage.named_modules():
                    m = re.search(r"(?:^|\.)layers\.(\d+)\.mlp\.router$", name)
                    if m:
                        mod.register_forward_hook(
                            lambda mod, args, out, i=int(m.group(1)): routing.append(
                                (self.step, i, out.selected_expert_indices.reshape(-1).tolist())))

    ex.train(DeviceMeshParameters(**mesh) if mesh else None, steps=STEPS, log_every=LOG_EVERY, layers=LAYERS,
             experts=EXPERTS, top_k=TOP_K, task_cls=RecordingTask, tracker=NullTrackerConfig())
    return dict(logged=logged, routing=routing)


def _check(runs: list, layers_per_rank: int) -> None:
    routing = [r for out in runs for r in out["routing"]]
    for out in runs:  # every rank hooked the routers of its own stage and saw them run
        assert len({i for _, i, _ in out["routing"]}) == layers_per_rank, out["routing"][:2]
    ends = [s - 1 for s in range(LOG_EVERY, STEPS + 1, LOG_EVERY)]  # d9d's steps are 0-based
    for rank, out in enumerate(runs):
        windows: dict = {}
        for step, name, value in out["logged"]:
            if name.startswith("train/router/"):
                windows.setdefault(step, {})[name[len("train/router/"):]] = value
        assert sorted(windows) == ends, (rank, sorted(windows))
        for end in ends:
            load = np.zeros((LAYERS, EXPERTS))
            for step, i, idx in routing:
                if end - LOG_EVERY < step <= end:
                    load[i] += np.bincount(idx, minlength=EXPERTS)
            assert (load.sum(1) > 0).all()
            want, got = _summary(load), windows[end]
            assert set(got) == set(ROUTER_KEYS), got
            for k in ROUTER_KEYS:
                assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15), (rank, end, k, got, want)


def test_one_process_real_trainer():
    runs = run_distributed(_worker, 1, None, timeout=120, pg_timeout=60)
    _check(runs, LAYERS)


def test_pp2_dp2_real_trainer():
    """Stages own different layers, data ranks route different tokens: every rank logs
    the statistics of all layers over all ranks' tokens (the pp + dp sync)."""
    runs = run_distributed(_worker, 4, dict(pipeline_parallel=2, data_parallel_shard=2), timeout=180,
                           pg_timeout=60)
    _check(runs, LAYERS // 2)


def test_cli():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "examples/d9d_moe_task.py", "--steps", "2", "--log-every", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    for step in (0, 1):  # d9d's log tracker: one line per value, 0-based steps
        for k in ("loss", *(f"router/{k}" for k in ROUTER_KEYS)):
            assert re.search(rf"step {step} \(stage=train\): train/{k}=", out), (step, k, out[-2000:])
