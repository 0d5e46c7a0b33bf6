"""Compiled update plans: a planned update as ONE call into C++.

``d9d_kernels.core.plan`` turns the first update of an input signature into
a ``Plan`` (which statistic gets which input; later calls run
``Statistic.bind`` callables). At a small batch the remaining Python (the
wrapper, a dict per statistic, the ``torch.ops`` argument parsing) still
costs several times the kernels. When every step of a plan is a raw op call,
``attach`` lowers it to a signature of the owner's ``_C.PlanRunner``: the
metadata each input must have, and per op its argument stack (state views,
constants) with the slots that take an input. The planned wrapper then calls
``runner.run(args, kwargs)`` first (only while the storage's local views are
the ones it writes; inside a ``forward``, which points the update at a
scratch copy of the state, ``on_scratch``'s copy of the runner bound to the
scratch views): on a match it checks the inputs and calls every op through
the c10 dispatcher in C++; otherwise (a new signature, a changed dtype...)
it returns -1 and the Python plan path runs. Both paths make the same op
calls on the same tensors, so their states are bit-identical
(tests/core/test_compiled.py).

On CPU a whole ``forward`` is one call too where the owner's values all
come from the group_values program (``fused.fused_forward``):
``set_forward`` gives a scratch runner, per signature, the ranges its ops
write and the owner's group_values arguments, and ``PlanRunner.forward``
resets the last forward's ranges, runs the ops, folds and returns the
batch values.

A statistic opts in with ``compile_step(sample, state) -> OpStep | None``
(None: keep the Python plan), the lowered form of its ``bind``.
``D9D_KERNELS_COMPILED=0`` (read when a signature is planned) keeps every
update on the Python plan path (the reference; also what ``torch.compile``
traces: the wrapper never calls the runner while compiling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from d9d_kernels import _extension

__all__ = ["OpStep", "Runner", "attach", "on_scratch", "set_forward", "enabled", "runner_class"]

#: how an op argument is made from an input (values of csrc/cpu/plan_runner.cpp's Source)
SOURCES = {"as_is": 0, "flat": 1, "fill1": 2, "fill_like": 3}
_KINDS = {type(None): 0, float: 2, int: 3, bool: 4}


@dataclass
class OpStep:
    """One ``torch.ops.d9d_kernels.<op>`` call of a compiled plan.

    Attributes:
        op: the op's name in the ``d9d_kernels`` namespace.
        inputs: op argument -> ``(source, statistic input[, like input])``,
            source one of ``SOURCES``: the input as is, flattened
            (``reshape(-1)``), a number filled as a float64 ``[1]`` tensor, or
            a number filled to the flattened size of input ``like``.
        consts: op argument -> value (state views, configuration).
    """

    op: str
    inputs: dict
    consts: dict = field(default_factory=dict)


def runner_class():
    """``_C.PlanRunner``, or None when the extension lacks it (or its ``fast_update``)."""
    return _extension.host_function("PlanRunner") if _extension.host_function("fast_update") else None


def enabled() -> bool:
    return os.environ.get("D9D_KERNELS_COMPILED", "1") != "0" and runner_class() is not None


def _not_taken(metric, args: tuple, kwargs: dict) -> bool:
    return False


#: ``fast_update(metric, args, kwargs) -> bool``: the planned wrapper's branch
#: for a runner bound to the local views, in C++ (csrc/cpu/plan_runner.cpp):
#: ``storage.compiled[id(metric)]``'s runner (by its ``handle``) outside a
#: group's routing, ``storage.dirty = True`` when a signature ran.
fast_update = _extension.host_function("fast_update") or _not_taken


def _no_shortcut(owner, args: tuple, kwargs: dict):
    return None


#: ``fast_forward(owner, args, kwargs) -> dict | None``: a forward in its
#: steady state in C++ (csrc/cpu/plan_runner.cpp): the ``ForwardShortcut``
#: the previous one-call forward of the same input names left in the
#: owner's compiled entry, checked and run; None: not taken.
fast_forward = _extension.host_function("fast_forward") or _no_shortcut


def _check(v):
    if isinstance(v, torch.Tensor):
        return (1, v.dtype, str(v.device), list(v.shape))
    kind = _KINDS.get(type(v))
    return None if kind is None else (kind,)


def _lower(storage, plan, recorded, names: list, views: list) -> list | None:
    """The runner's steps of ``plan``, or None when a step has no ``compile_step``."""
    steps = []
    for (j, _, spec), (_, sample) in zip(plan.steps, recorded):
        stat = storage.layout.stats[j]
        make = getattr(stat, "compile_step", None)
        step = None if make is None else make(sample, views[j])
        if step is None:
            return None
        # statistic input -> index of the update input it came from (None: it was None)
        where = {name: (None if by_name is None else names.index(src) if by_name else src)
                 for name, by_name, src in spec}
        schema = getattr(torch.ops.d9d_kernels, step.op).default._schema
        pos = {a.name: i for i, a in enumerate(schema.arguments)}
        consts = [(pos[k], v) for k, v in step.consts.items()]
        slots = []
        for arg, (source, stat_input, *like) in step.inputs.items():
            i = where.get(stat_input)
            if i is None:  # None in this signature
                consts.append((pos[arg], None))
                continue
            li = -1
            if like:
                li = where.get(like[0])
                if li is None:
                    return None
            dev = str(next(iter(views[j].values())).device)
            slots.append((pos[arg], SOURCES[source], i, li, dev))
        covered = {p for p, _ in consts} | {s[0] for s in slots}
        for i, a in enumerate(schema.arguments):  # every argument given: the stack has no defaults
            if i not in covered:
                return None
        steps.append((f"d9d_kernels::{step.op}", "", consts, slots))
    return steps


class Runner:
    """An owner's ``_C.PlanRunner`` with what it was built from: the state
    views its ops write and, per signature in the order added, the ``add``
    arguments and the statistics the plan updates (``PlanRunner.run``
    returns the index of the signature it ran)."""

    __slots__ = ("views", "runner", "handle", "adds", "stats", "scratch", "forward", "shortcuts")

    def __init__(self, views: list):
        self.views, self.runner, self.adds, self.stats = views, runner_class()(), [], []
        self.handle = self.runner.handle()  # the capsule through which _C.fast_update runs it
        self.scratch = None  # (signatures, scratch views, Runner or None): on_scratch's cache
        self.forward = None  # the owner plan a scratch runner's PlanRunner.forward was set up with (set_forward)
        self.shortcuts = {}  # frozenset of input names -> ForwardShortcut (fast_forward): the owner's forwards

    def add(self, spec: tuple, stats) -> None:
        self.runner.add(*spec)
        self.adds.append(spec)
        self.stats.append(stats)


class ForwardShortcut(NamedTuple):
    """What a one-call forward (``fused_forward``) needs again when nothing
    has changed since the last, kept in the owner's compiled entry
    (``Runner.shortcuts``): ``fast_forward`` runs it after checking that the
    entry is on the local views, no forward runs, ``storage.scratch_dirty
    is dirty`` (the scratch as that forward left it) and the owner's fused
    ``plan`` is the same. A tuple: the C++ reads its fields by position."""

    dirty: Any  # the FoldRanges that forward left: its ``reset`` is the next forward's
    reset: list
    plan: Any
    handle: Any  # the scratch runner's capsule
    select: list  # [(output key, value index)]
    all_dirty: Any  # the FoldRanges of every statistic: set when the call raises


def on_scratch(storage, entry: Runner) -> Runner | None:
    """``entry``'s signatures with every state view among the op constants
    replaced by the same view of the storage's forward scratch: forward's
    update as one call into C++, the same ops on the scratch copy. Made once
    per scratch and signature count; None when a constant tensor is not one
    of the state views (that owner's forward keeps the Python plan)."""
    key = (len(entry.adds), storage.scratch_views)
    c = entry.scratch
    if c is not None and c[0] == key[0] and c[1] is key[1]:
        return c[2]
    swap = {id(t): w[k] for v, w in zip(entry.views, storage.scratch_views) for k, t in v.items()}
    out = Runner(storage.scratch_views)
    for (nargs, kwnames, checks, steps), stats in zip(entry.adds, entry.stats):
        moved = _moved(steps, swap)
        if moved is None:
            out = None
            break
        out.add((nargs, kwnames, checks, moved), stats)
    entry.scratch = (key[0], key[1], out)
    return out


def set_forward(storage, s: Runner, plan, values_args: tuple) -> None:
    """Sets up the scratch runner ``s`` (``on_scratch``) for
    ``PlanRunner.forward`` (a forward's reset, update, fold and batch values
    in one call): per signature the storage's ranges of the statistics it
    writes, and the owner's fused-compute ``plan`` with its group_values
    arguments on the scratch buffers (``values_args``)."""
    s.runner.set_forward([storage._fold_ranges(frozenset(stats)).fold for stats in s.stats], *values_args)
    s.forward = plan


def _moved(steps: list, swap: dict) -> list | None:
    """``steps`` with each tensor constant replaced by ``swap[id(tensor)]``; None if one is missing."""
    out = []
    for op, overload, consts, slots in steps:
        cs = []
        for pos, v in consts:
            if isinstance(v, torch.Tensor):
                v = swap.get(id(v))
                if v is None:
                    return None
            cs.append((pos, v))
        out.append((op, overload, cs, slots))
    return out


def attach(storage, owner: int, plan, recorded: list, args: tuple, kwargs: dict) -> None:
    """Adds ``plan`` (just built from ``recorded`` for this call's signature)
    to ``owner``'s ``Runner`` in ``storage.compiled`` when every step lowers."""
    if torch.compiler.is_compiling() or plan is None or not hasattr(plan, "steps") or not enabled():
        return
    names = [None] * len(args) + list(kwargs)  # update input index -> keyword name
    checks = [_check(v) for v in (*args, *kwargs.values())]
    if any(c is None for c in checks) or len(checks) > 16:
        return
    # the local state's views, also while a forward points the update at its scratch copy
    views = storage.saved_views if getattr(storage, "saved_views", None) is not None else storage.local_views
    steps = _lower(storage, plan, recorded, names, views)
    if steps is None:
        return
    entry = storage.compiled.get(owner)
    if entry is None:
        entry = storage.compiled[owner] = Runner(views)
    entry.add((len(args), list(kwargs), checks, steps), plan.stats)
