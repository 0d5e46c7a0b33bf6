"""The compiled extension: loading, backend reporting, forcing, CUDA-free import."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import d9d_kernels as dk
from d9d_kernels import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str, **env) -> str:
    """Runs `code` in a fresh interpreter (PYTHONPATH = repo root); returns stdout."""
    e = {k: v for k, v in os.environ.items() if k != "D9D_KERNELS_BACKEND"}
    e.update(PYTHONPATH=ROOT, **env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_import_does_not_initialise_cuda():
    out = run_py(
        "import torch, d9d_kernels as dk\n"
        "a = torch.cuda.is_initialized()\n"
        "s, b = torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)\n"
        "dk.ops.running_extrema(torch.randn(5), state=s, bad=b)\n"
        "dk.ops.backends()\n"
        "print(a, torch.cuda.is_initialized())\n"
    )
    assert out.split() == ["False", "False"]


def test_works_without_compiled_extension():
    out = run_py(
        "import sys\n"
        "sys.modules['d9d_kernels._C'] = None  # import of _C now raises ImportError\n"
        "import torch, d9d_kernels as dk\n"
        "from d9d_kernels import _extension, reference\n"
        "s, b = torch.zeros(9, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)\n"
        "dk.ops.weighted_moments(torch.tensor([1.0, 2.0, 3.0]), state=s, bad=b)\n"
        "print(s[1].item() / s[0].item())\n"
        "print('cpp' in dk.ops.backends(), 'torch' in dk.ops.backends())\n"
        "print(_extension.CPP_ERROR)\n"
        "try:\n"
        "    dk.ops.weighted_moments(torch.ones(2), state=s, bad=b, backend='cpp')\n"
        "except RuntimeError as e:\n"
        "    print('FORCED:', e)\n"
    )
    lines = out.strip().splitlines()
    assert lines[0] == "2.0"
    assert lines[1] == "False True"
    assert "d9d_kernels._C could not be imported" in lines[2]
    assert lines[3].startswith("FORCED:") and "'cpp'" in lines[3] and "could not be imported" in lines[3]


def _cuda_build_expected() -> bool:
    if os.environ.get("D9D_KERNELS_BUILD_CUDA", "auto").lower() in ("0", "false", "no", "off"):
        return False
    if glob.glob(os.path.join(ROOT, "build", ".ext-cpu-*")):  # the Makefile's stamp: `make demo`'s CPU-only build
        return False  # (`make test` rebuilds with the CUDA kernels and removes it)
    if torch.version.cuda is None:
        return False
    spec = importlib.util.spec_from_file_location("_d9d_setup_probe", os.path.join(ROOT, "setup.py"))
    src = open(os.path.join(ROOT, "setup.py")).read()
    # only the toolkit probe of setup.py (running the file would call setup())
    ns: dict = {"__file__": spec.origin}
    exec(compile(src.split("def want_cuda")[0], spec.origin, "exec"), ns)
    return ns["find_cuda_home"]() is not None


@pytest.mark.skipif("cpp" not in dk.ops.backends(), reason="compiled extension not built")
def test_every_op_has_cpu_and_expected_cuda_kernels():
    for op in _extension.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"d9d_kernels::{op}", "CPU"), op
    if not _cuda_build_expected():
        pytest.skip("this build was not expected to include CUDA kernels")
    for op in _extension.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"d9d_kernels::{op}", "CUDA"), op
    assert "cuda" in dk.ops.backends()


def test_backends_content():
    b = dk.ops.backends()
    assert b[-1] == "torch" and len(set(b)) == len(b)
    assert set(b) <= {"cpp", "cuda", "triton", "torch"}
    assert ("cpp" in b) == (_extension.CPP_ERROR is None)
    assert ("triton" in b) == (importlib.util.find_spec("triton") is not None)


def test_forced_backend_env():
    code = (
        "import torch, d9d_kernels as dk\n"
        "from unittest import mock\n"
        "import d9d_kernels.reference as ref\n"
        "s, b = torch.full((2,), float('-inf'), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)\n"
        "with mock.patch.object(ref, 'running_extrema', wraps=ref.running_extrema) as spy:\n"
        "    dk.ops.running_extrema(torch.tensor([1.0, -4.0]), state=s, bad=b)\n"
        "print(spy.call_count, s.tolist())\n"
    )
    assert run_py(code, D9D_KERNELS_BACKEND="torch").split()[0] == "1"  # forced: the reference ran
    if "cpp" in dk.ops.backends():
        assert run_py(code).split()[0] == "0"  # auto on CPU: the C++ kernel ran
    with pytest.raises(ValueError, match=r"d9d_kernels\.running_extrema: backend must be one of"):
        run_forced("nope")
    with pytest.raises(RuntimeError, match=r"backend 'cuda' can't run on cpu"):
        run_forced("cuda")


def run_forced(name: str) -> None:
    s, b = torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    old = os.environ.get("D9D_KERNELS_BACKEND")
    os.environ["D9D_KERNELS_BACKEND"] = name
    try:
        dk.ops.running_extrema(torch.tensor([1.0]), state=s, bad=b)
    finally:
        if old is None:
            del os.environ["D9D_KERNELS_BACKEND"]
        else:
            os.environ["D9D_KERNELS_BACKEND"] = old


# ---- the metric layer without the compiled extension -------------------------------------------
# Planned updates (core/plan.py) call dk.ops.raw(...), which must fall back to the
# reference when _C is missing; checked against plain-torch / sklearn values.

_GROUP_STEPS = (
    "import torch, d9d_kernels as dk\n"
    "g = dk.MetricGroup({'mx': dk.MaxMetric(), 'mn': dk.MinMetric(), 's': dk.SumMetric(),\n"
    "                    'wm': dk.WeightedMeanMetric(),\n"
    "                    'acc': dk.Accuracy(task='multiclass', num_classes=5, average='micro'),\n"
    "                    'top3': dk.Accuracy(task='multiclass', num_classes=5, average='micro', top_k=3),\n"
    "                    'bacc': dk.Accuracy(task='binary'), 'auroc': dk.AUROC(task='binary')})\n"
    "gen = torch.Generator().manual_seed(0)\n"
    "xs, ss, cs, ps, ts = [], [], [], [], []\n"
    "for step in range(6):  # signatures repeat: the second call of each runs its plan\n"
    "    x = torch.randn(8, generator=gen); s = torch.randn(8, 5, generator=gen)\n"
    "    c = torch.randint(0, 5, (8,), generator=gen); p = torch.rand(8, generator=gen)\n"
    "    t = torch.randint(0, 2, (8,), generator=gen)\n"
    "    g['mx'].update(float(x[0])); g['mn'].update(x); g['s'].update(float(step))\n"
    "    g['wm'].update(x, weights=2.0)\n"
    "    g['acc'].update(s, c); g['top3'].update(s, c); g['bacc'].update(p, t); g['auroc'].update(p, t)\n"
    "    xs.append(x); ss.append(s); cs.append(c); ps.append(p); ts.append(t)\n"
    "got = {k: v.item() for k, v in g.compute().items()}\n"
    "x, s, c, p, t = (torch.cat(v) for v in (xs, ss, cs, ps, ts))\n"
    "want = {'mx': max(float(v[0]) for v in xs), 'mn': x.min().item(), 's': 15.0, 'wm': x.double().mean().item(),\n"
    "        'acc': (s.argmax(1) == c).double().mean().item(),\n"
    "        'top3': (s.topk(3, 1).indices == c[:, None]).any(1).double().mean().item(),\n"
    "        'bacc': ((p > 0.5).long() == t).double().mean().item()}\n"
    "from sklearn.metrics import roc_auc_score\n"
    "want['auroc'] = roc_auc_score(t.numpy(), p.numpy())\n"
)


def _check_values(got: dict, want: dict) -> None:
    assert set(got) == set(want) | {"auroc"} or set(got) == set(want)
    for k, v in want.items():
        tol = 2e-3 if k == "auroc" else 1e-9  # AUROC: 4096-bin histogram vs exact sklearn
        assert got[k] == pytest.approx(v, abs=tol), k


def test_metric_group_planned_updates_without_compiled_extension():
    import json

    out = run_py(
        "import sys\n"
        "sys.modules['d9d_kernels._C'] = None  # import of _C now raises ImportError\n"
        + _GROUP_STEPS
        + "import json; from d9d_kernels import _extension\n"
        "print(json.dumps([got, want, _extension.CPP_ERROR is not None, dk.ops.backends()]))\n"
    )
    got, want, hidden, backends = json.loads(out.strip().splitlines()[-1])
    assert hidden and "cpp" not in backends
    _check_values(got, want)


def test_planned_updates_run_the_reference_when_cpp_is_unavailable(monkeypatch):
    from d9d_kernels import reference

    monkeypatch.setattr(_extension, "HAS_CPP", False)  # what a missing _C reports
    monkeypatch.delenv("D9D_KERNELS_BACKEND", raising=False)
    calls = {}
    for op in _extension.OPS:
        real = getattr(reference, op)

        def spy(*args, _real=real, _op=op):
            calls[_op] = calls.get(_op, 0) + 1
            return _real(*args)

        monkeypatch.setattr(reference, op, spy)
    ns: dict = {}
    exec(_GROUP_STEPS, ns)
    _check_values(ns["got"], ns["want"])
    # every member update of every step ran the reference (checked and planned calls alike)
    assert calls == {"running_extrema": 12, "weighted_moments": 12, "class_stats": 12, "binary_stats": 6,
                     "score_histogram": 6}, calls


def test_raw_accessor_follows_the_backend_choice(backend, monkeypatch):
    from d9d_kernels import reference

    x = torch.randn(50, dtype=torch.float64)
    x[3] = float("nan")
    mask = torch.rand(50) > 0.3
    want_s, want_b = torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    reference.running_extrema(x, mask, True, want_s, want_b)
    v = x[mask & ~torch.isnan(x)]
    assert want_s.tolist() == [v.max().item(), -v.min().item()]  # the reference itself, against plain torch
    op = dk.ops.raw("running_extrema", "cpu", backend)
    if backend == "cpp":
        assert op is torch.ops.d9d_kernels.running_extrema.default
    calls, real = [], reference.running_extrema
    monkeypatch.setattr(reference, "running_extrema", lambda *a: (calls.append(1), real(*a))[1])
    s, b = torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    op(x, mask, True, s, b)
    assert calls == ([1] if backend == "torch" else [])  # looked up at the call
    assert s.tolist() == want_s.tolist() and b.tolist() == want_b.tolist()
    # auto choice: what the checked wrapper runs
    auto = dk.ops.raw("running_extrema", torch.device("cpu"))
    assert auto is (torch.ops.d9d_kernels.running_extrema.default if "cpp" in dk.ops.backends()
                    else reference.running_extrema)


def test_raw_accessor_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"ops\.raw: argument 'op' must be one of"):
        dk.ops.raw("class_statz")
    with pytest.raises(RuntimeError, match=r"backend 'cuda' can't run on cpu"):
        dk.ops.raw("class_stats", "cpu", "cuda")


@pytest.mark.skipif("cpp" not in dk.ops.backends(), reason="no compiled extension")
def test_cpu_ops_are_built_to_split_across_threads():
    """at::parallel_for is a header template: in torch's OpenMP build it only
    runs chunks on several threads when the extension is compiled with
    -fopenmp (without it every chunk ran on the calling thread). The built
    library must call libgomp, and share the runtime torch loaded."""
    from d9d_kernels import _C

    with open(_C.__file__, "rb") as f:
        assert b"GOMP_parallel" in f.read(), "the extension was built without -fopenmp"
    if sys.platform.startswith("linux"):
        out = run_py("import torch, d9d_kernels._C\n"
                     "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
        assert out.count("libgomp") == 1, f"not one OpenMP runtime: {out}"


# ---- an op's argument checks: written once (csrc/kernels/*_checks.h), run by every backend ------

def _f64(*shape, fill=0.0):
    return torch.full(shape, fill, dtype=torch.float64)


# (op call with one bad argument, the C++ check's message); each call names its state tensors
_BAD_CALLS = {
    "state shape": (lambda be, st: dk.ops.running_extrema(torch.ones(4), state=st[0], bad=st[1], backend=be),
                    lambda: (_f64(3, fill=-float("inf")), _f64(1)),
                    r"running_extrema: argument 'state' must be float64 \[2\], got shape \[3\]"),
    "state dtype": (lambda be, st: dk.ops.weighted_moments(torch.ones(4), state=st[0], bad=st[1], backend=be),
                    lambda: (torch.zeros(9), _f64(1)),
                    r"weighted_moments: argument 'state' must be float64 \[9\], got Float"),
    "top_ks range": (lambda be, st: dk.ops.class_stats(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), num_classes=3,
                                                        stats=st[0], extras=st[1], bad=st[2], top_ks=(1, 4),
                                                        backend=be),
                     lambda: (_f64(2, 3, 3), _f64(2), _f64(2)),
                     r"class_stats: argument 'top_ks' must lie in \[1, num_classes=3\]"),
    "input_kind": (lambda be, st: dk.ops.binary_stats(torch.rand(4), torch.tensor([0, 1, 1, 0]), state=st[0],
                                                      bad=st[1], input_kind=5, backend=be),
                   lambda: (_f64(1, 4), _f64(2)),
                   r"binary_stats: argument 'input_kind' must be 0 \(probs\), 1 \(logits\) or 2 \(auto\), got 5"),
    "no bins": (lambda be, st: dk.ops.score_histogram(torch.rand(4), torch.tensor([0, 1, 1, 0]), hist=st[0],
                                                      bad=st[1], backend=be),
                lambda: (_f64(2, 1, 0), _f64(2)),
                r"score_histogram: argument 'hist' must be float64 \[2, L, B\] with L = 1 and B >= 1"),
}


@pytest.mark.skipif("cpp" not in dk.ops.backends(), reason="the checks are the compiled extension's")
@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_every_backend_refuses_an_argument_with_the_ops_one_check(case, backend):
    call, make, message = _BAD_CALLS[case]
    state = make()
    before = [t.clone() for t in state]
    with pytest.raises((ValueError, TypeError), match=message):
        call(backend, state)
    assert all(torch.equal(a, b) for a, b in zip(state, before))  # nothing written


@pytest.mark.skipif("cpp" not in dk.ops.backends(), reason="the checks are the compiled extension's")
@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_fake_tensors_run_the_ops_checks(case):
    """The op's meta kernel (its fake under FakeTensorMode and torch.compile) is its checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    call, make, message = _BAD_CALLS[case]
    with FakeTensorMode():
        state = make()
        with pytest.raises((ValueError, TypeError), match=message):
            call(None, state)


def test_a_build_without_cuda_kernels_dispatches_cuda_tensors_to_triton():
    """The dispatcher, not a Python table, picks Triton: it is the op's CUDA kernel there."""
    out = run_py(
        "import d9d_kernels._extension as e; e.HAS_CUDA_KERNELS = False  # what a CPU-only build reports\n"
        "import torch, d9d_kernels as dk, d9d_kernels.ops\n"
        "for op in e.OPS:\n"
        "    line = [l for l in torch._C._dispatch_dump(f'd9d_kernels::{op}').splitlines() if l.startswith('CUDA:')]\n"
        "    print(op, 'ops/_dispatch.py' in line[0], dk.ops.backend_for(op, 'cuda'))\n"
    )
    if "cpp" not in dk.ops.backends():
        pytest.skip("no compiled extension")
    want = "triton" if "triton" in dk.ops.backends() else "torch"
    assert out.split() == [w for op in _extension.OPS for w in (op, "True", want)]
