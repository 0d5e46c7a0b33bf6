"""A hypothesis state machine over the lifecycle: random sequences of group
and member updates (positional and keyword), forwards (some after far-away
data), resets (of the group and of members, some between trigger_sync and
wait_sync), syncs (one with a load_state_dict in flight), checkpoints,
member state_dict / load_state_dict (refused, nothing changes), clones,
``to`` and a subclass that transforms its inputs, checked after every step
against plain PyTorch over the data seen since each metric's last reset;
every compute() result kept along the way must keep its numbers. Every
cache the fast paths keep (update plans, forward scratch, pivots, sync
references) must stay invisible. The 2-rank variant (rank-local calls on
one rank only, then a sync) is tests/core/test_edges_distributed.py."""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import d9d_kernels as dk

C = 4
SIZES = st.sampled_from([1, 3, 8])
SCALES = st.sampled_from([1.0, 1e-3, 1e6, 1e12])


class Scaled(dk.WeightedMeanMetric):
    """Feeds 10x its inputs: its own update runs at every call."""

    def update(self, values):
        super().update(values * 10.0)


def _members():
    return {"loss": dk.WeightedMeanMetric(), "n": dk.SumMetric(), "mx": dk.MaxMetric(),
            "acc": dk.Accuracy(task="multiclass", num_classes=C), "ppl": dk.Perplexity()}


class Lifecycle(RuleBasedStateMachine):
    @initialize()
    def build(self):
        self.g = dk.MetricGroup(_members())
        self.solo = dk.SumMetric()
        self.scaled = Scaled()
        self.seen = {k: [] for k in ("loss", "n", "mx", "acc", "ppl", "solo", "scaled")}
        self.gen = torch.Generator().manual_seed(0)
        self.kept = []  # (a compute() result, a copy of its numbers)

    def _values(self, n, scale):
        return torch.randn(n, generator=self.gen, dtype=torch.float64) * scale

    def _cls(self, n):
        return torch.randn(n, C, generator=self.gen), torch.randint(0, C, (n,), generator=self.gen)

    @rule(n=SIZES, scale=SCALES, keyword=st.booleans())
    def group_values(self, n, scale, keyword):
        x = self._values(n, scale)
        self.g.update(values=x) if keyword else self.g["n"].update(x)
        for k in (("loss", "n", "mx") if keyword else ("n",)):
            self.seen[k].append(x)

    @rule(n=SIZES, member=st.booleans())
    def group_classes(self, n, member):
        p, t = self._cls(n)
        self.g["acc"].update(p, t) if member else self.g.update(preds=p, target=t)
        for k in (("acc",) if member else ("acc", "ppl")):
            self.seen[k].append((p, t))

    @rule(n=SIZES, scale=SCALES)
    def member_forward(self, n, scale):
        x = self._values(n, scale)
        v = self.g["loss"](x)
        self.seen["loss"].append(x)
        # a fresh metric's value for this batch, whatever the state holds (its pivot included)
        assert math.isclose(v.item(), x.mean().item(), rel_tol=1e-12, abs_tol=1e-12 * x.abs().max().item())

    @rule(n=SIZES, scale=SCALES)
    def forward_after_far_data(self, n, scale):
        far = self._values(3, 1.0) + 1e9
        self.g.update(values=far)
        for k in ("loss", "n", "mx"):
            self.seen[k].append(far)
        self.member_forward(n, scale)

    @rule()
    def keep_results(self):
        vals = self.g.compute()
        self.kept.append((vals, {k: v.clone() for k, v in vals.items()}))
        solo = self.solo.compute()
        self.kept.append((solo, solo.clone()))

    @rule(n=SIZES)
    def group_forward(self, n):
        p, t = self._cls(n)
        out = self.g(preds=p, target=t)
        self.seen["acc"].append((p, t))
        self.seen["ppl"].append((p, t))
        assert math.isclose(out["acc"].item(), (p.argmax(-1) == t).double().mean().item(), rel_tol=1e-12)

    @rule(n=SIZES, scale=SCALES, number=st.booleans())
    def solo_update(self, n, scale, number):
        if number:
            v = float(self._values(1, scale))
            self.solo.update(v)
            self.seen["solo"].append(torch.tensor([v], dtype=torch.float64))
        else:
            x = self._values(n, scale)
            self.solo.update(x)
            self.seen["solo"].append(x)

    @rule(n=SIZES)
    def scaled_update(self, n):
        x = self._values(n, 1.0)
        self.scaled.update(x)
        self.seen["scaled"].append(x * 10.0)

    @rule(which=st.sampled_from(["group", "loss", "acc", "solo", "scaled"]))
    def reset(self, which):
        if which == "group":
            self.g.reset()
            for k in ("loss", "n", "mx", "acc", "ppl"):
                self.seen[k] = []
        elif which in ("solo", "scaled"):
            getattr(self, which).reset()
            self.seen[which] = []
        else:
            self.g[which].reset()
            self.seen[which] = []

    @rule()
    def sync(self):
        self.g.sync()
        (self.solo if self.solo._group is None else self.solo._group).sync(None)

    @rule(which=st.sampled_from(["group", "loss", "acc"]))
    def reset_in_flight(self, which):
        self.g.trigger_sync()
        self.reset(which)
        self.g.wait_sync()

    @rule(member=st.sampled_from(["loss", "acc"]), op=st.sampled_from(["state_dict", "load_state_dict"]))
    def member_checkpoint_is_refused(self, member, op):
        args = (self.g.state_dict(),) if op == "load_state_dict" else ()
        try:
            getattr(self.g[member], op)(*args)
        except RuntimeError as e:
            assert "call it on the MetricGroup" in str(e)
        else:
            raise AssertionError(f"a member's {op} acted on the whole group")

    @precondition(lambda self: self.solo._group is None)
    @rule(n=SIZES)
    def load_while_syncing(self, n):
        other = dk.SumMetric()
        x = self._values(n, 1.0)
        other.update(x)
        self.solo.trigger_sync()
        self.solo.load_state_dict(other.state_dict())
        self.solo.wait_sync()
        self.seen["solo"] = [x]

    @rule()
    def checkpoint(self):
        fresh = dk.MetricGroup(_members())
        fresh.load_state_dict(self.g.state_dict())
        self.g = fresh

    @rule(deep=st.booleans())
    def clone(self, deep):
        self.g = copy.deepcopy(self.g) if deep else self.g.clone()
        self.solo = self.solo.clone()

    @rule()
    def move(self):
        self.g.to("cpu")
        (self.solo if self.solo._group is None else self.solo._group).to("cpu")

    @precondition(lambda self: not self.seen["solo"] and self.solo._group is None)
    @rule()
    def solo_joins_a_group(self):
        self.solo.compute()  # its fused plan for its own storage is made here
        g = dk.MetricGroup({"other": dk.SumMetric(), "solo": self.solo})
        g["other"].update(100.0)
        self.solo = g["solo"]

    @invariant()
    def kept_results_keep_their_numbers(self):
        for got, want in getattr(self, "kept", ()):
            if isinstance(got, dict):
                for k in got:
                    torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)

    @invariant()
    def values_match_plain_torch(self):
        if not hasattr(self, "g"):
            return
        vals = self.g.compute()
        self._check(vals["loss"], self.seen["loss"], lambda x: x.mean())
        self._check(vals["n"], self.seen["n"], lambda x: x.sum(), empty=0.0)
        self._check(vals["mx"], self.seen["mx"], lambda x: x.max(), empty=-math.inf)
        if self.seen["acc"]:
            p = torch.cat([a for a, _ in self.seen["acc"]])
            t = torch.cat([b for _, b in self.seen["acc"]])
            assert math.isclose(vals["acc"].item(), (p.argmax(-1) == t).double().mean().item(), rel_tol=1e-12)
        if self.seen["ppl"]:
            p = torch.cat([a for a, _ in self.seen["ppl"]])
            t = torch.cat([b for _, b in self.seen["ppl"]])
            ppl = torch.exp(torch.nn.functional.cross_entropy(p.double(), t)).item()
            assert math.isclose(vals["ppl"].item(), ppl, rel_tol=1e-6)
        for k in ("loss", "n", "mx", "acc", "ppl"):
            torch.testing.assert_close(self.g[k].compute(), vals[k], rtol=0, atol=0, equal_nan=True)
        self._check(self.solo.compute(), self.seen["solo"], lambda x: x.sum(), empty=0.0)
        self._check(self.scaled.compute(), self.seen["scaled"], lambda x: x.mean())

    @staticmethod
    def _check(value, parts, fn, empty=None):
        if not parts:
            if empty is not None:
                assert value.item() == empty, (value, empty)
            return
        x = torch.cat(parts)
        ref = fn(x).item()
        scale = x.abs().max().item()
        assert math.isclose(value.item(), ref, rel_tol=1e-9, abs_tol=1e-9 * scale), (value.item(), ref)


Lifecycle.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None,
                                       suppress_health_check=list(HealthCheck))
test_lifecycle = Lifecycle.TestCase
