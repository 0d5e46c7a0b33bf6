"""examples/d9d_task.py: the d9d train task's metric group gives what plain torch
(and d9d's own aggregation metrics) compute from the same microbatches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.example_loader import load_example

pytest.importorskip("d9d")

ROOT = Path(__file__).resolve().parents[1]
IGNORE = -100


def _module():
    return load_example("d9d_task.py", "d9d_task_example")


def _reference(window: list[dict]) -> dict[str, torch.Tensor]:
    """The group's values from the microbatches' logits/labels/loss, in float64 plain torch."""
    logits = torch.cat([mb["logits"].flatten(0, -2) for mb in window]).double()
    labels = torch.cat([mb["labels"].flatten() for mb in window])
    keep = labels != IGNORE
    lg, lb = logits[keep], labels[keep]
    n = torch.stack([mb["tokens"] for mb in window]).double()
    loss = torch.stack([mb["loss"] for mb in window]).double()
    return {
        "loss": (loss * n).sum() / n.sum(),
        "tokens": keep.sum().double(),
        "acc": (lg.argmax(-1) == lb).double().mean(),
        "top5": (lg.topk(5, dim=-1).indices == lb[:, None]).any(-1).double().mean(),
        "ppl": F.cross_entropy(lg, lb, reduction="mean").exp(),
    }


@pytest.mark.parametrize("microbatches,log_every", [(1, 2), (3, 3)])
def test_task_metrics_match_plain_torch(microbatches, log_every):
    mod = _module()
    res = mod.run(steps=6, microbatches=microbatches, log_every=log_every, vocab=37, batch=3, seq=11, seed=1)
    assert [s for s, _ in res.logged] == list(range(log_every, 7, log_every))
    for (_, values), window in zip(res.logged, res.microbatches):
        assert set(values) == {"train"}
        got, want = values["train"], _reference(window)
        assert set(got) == set(want)
        assert len(window) == microbatches * log_every  # reset() after each logging step
        for k, v in want.items():
            torch.testing.assert_close(got[k].double(), v, rtol=1e-6, atol=1e-9, msg=lambda m: f"{k}: {m}")
        # the token count is exact; the loss mean is the mean NLL, so perplexity = exp(loss)
        assert float(got["tokens"]) == sum(int((mb["labels"] != IGNORE).sum()) for mb in window)
        torch.testing.assert_close(got["ppl"].double(), got["loss"].double().exp(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("every", [1, 3])
def test_hidden_state_task_metrics_match_plain_torch(every):
    """HiddenLMTask: accuracy, top-5 and perplexity from dk.LinearLogits (hidden states x the
    LM head, the loss's logsumexp reused) equal plain torch on the logits the head would have
    made; with every=3 the token metrics cover only every third step's microbatches."""
    mb_per_step, log_every = 2, 3
    res = _module().run(steps=6, microbatches=mb_per_step, log_every=log_every, vocab=37, batch=3, seq=11, seed=3,
                        hidden=True, every=every)
    for (step, values), window in zip(res.logged, res.microbatches):
        got = values["train"]
        steps = range(step - log_every + 1, step + 1)
        sampled = [mb for i, mb in enumerate(window) if steps[i // mb_per_step] % every == 0]
        whole, tokens = _reference(window), _reference(sampled)
        for k in ("loss", "tokens"):
            torch.testing.assert_close(got[k].double(), whole[k], rtol=1e-6, atol=1e-9, msg=lambda m: f"{k}: {m}")
        for k in ("acc", "top5", "ppl"):
            torch.testing.assert_close(got[k].double(), tokens[k], rtol=1e-5, atol=1e-9, msg=lambda m: f"{k}: {m}")


def test_task_metrics_match_d9d_aggregation_metrics():
    """d9d's own WeightedMeanMetric / SumMetric fed the same microbatches (float32: rtol 1e-6)."""
    from d9d.metric.impl.aggregation import SumMetric, WeightedMeanMetric

    res = _module().run(steps=4, microbatches=2, log_every=4, vocab=20, seed=2)
    (_, values), window = res.logged[0], res.microbatches[0]
    mean, total = WeightedMeanMetric(), SumMetric()
    for mb in window:
        mean.update(mb["loss"], mb["tokens"].float())
        total.update(mb["tokens"].float())
    torch.testing.assert_close(values["train"]["loss"].double(), mean.compute().double(), rtol=1e-6, atol=0)
    assert float(values["train"]["tokens"]) == float(total.compute())


def test_task_is_a_d9d_train_task_and_its_metrics_d9d_metrics():
    from d9d.loop.control import CreateMetricsContext, TrainTask
    from d9d.metric import Metric

    mod = _module()
    task = mod.LMTask(10)
    assert isinstance(task, TrainTask)
    metrics = task.create_metrics(CreateMetricsContext()).metrics
    assert set(metrics) == {"train"} and isinstance(metrics["train"], Metric)
    assert set(metrics["train"].compute()) == {"loss", "tokens", "acc", "top5", "ppl"}


@pytest.mark.timeout(300)
def test_script_runs_on_cpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "examples/d9d_task.py", "--steps", "4", "--log-every", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["step", "loss", "tokens", "acc", "top5", "ppl"]
    assert [int(line.split()[0]) for line in lines[1:]] == [2, 4]


def test_task_context_is_built_by_d9d_without_private_attributes():
    """The example's context comes from d9d's own constructor (DeviceMeshParameters().build()),
    never from object.__new__ and the context's private attributes."""
    import d9d_kernels as dk

    ex = _module()
    source = (ROOT / "examples" / "d9d_task.py").read_text()
    assert "object.__new__" not in source and "ctx._" not in source
    ctx = ex.local_dist_context()
    assert not ctx.mesh_params.is_distributed and ctx.is_main_process and ctx.num_nodes == 1
    assert dk.DistributedContext.from_d9d(ctx).is_local
