"""What the GPU kernels compile to, checked without a GPU.

The built extension is disassembled with the toolkit's cuobjdump (or the copy
inside the triton package) and the compiled Triton kernels are read as PTX for
sm_90, so the properties the HBM estimates rest on (bench/analysis.md,
"Kernel figures") are asserted in `make test`:

* PTX is embedded (TORCH_CUDA_ARCH_LIST ends in ``+PTX``: newer GPUs JIT it);
* the 1-D kernels and the contiguous binary_stats / score_histogram walk read
  with 16-byte vector loads (``LDG.E.128``);
* no float64 shared-memory atomic (``ATOMS.CAST.SPIN.64``, a CAS loop) in
  these kernels: counters are uint32;
* registers leave room for at least 2 blocks of 256 threads per SM, and no
  kernel spills (the entries kernels may keep one 8-byte value across the
  exact-sigmoid division call, outside their loop);
* Triton: ``ld.global.v4`` in the 1-D kernels, no ``acq_rel`` atomics.

``gpu``-marked tests (skipped here) run every op on a device under
``torch.cuda.set_sync_debug_mode("error")`` and inside a captured CUDA graph.
"""

from __future__ import annotations

import glob
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import d9d_kernels as dk
from d9d_kernels import reference

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ARCH = "sm_90"
THREADS = 256  # csrc/cuda/common.cuh kThreads
REGS_PER_SM = 65536

# Kernel families of this file (substrings of the mangled names) -> expectations.
ONE_D = ("extrema_kernel", "moments_kernel")
ENTRIES = ("binary_kernel", "entries_kernel")
# class_stats score rows in one pass (float / half / bfloat16, max(top_ks) <= 32)
ONE_PASS = ("scores_warp_kernel", "scores_block_kernel")
# the same, a thread per row (<= 32 classes, class-strided rows): scalar loads by design
THREAD_ROWS = ("scores_thread_kernel",)
OURS = ONE_D + ENTRIES + ONE_PASS + THREAD_ROWS + ("any_logit_kernel", "any_logit_rows_kernel", "rows_kernel", "set_pivot_kernel",
                                     "scores_kernel", "indices_kernel", "expert_load_kernel", "expert_gate_kernel",
                                     "recenter_kernel", "center_kernel")
# log2(e) as a float64 (high word): every float64 exp loads it.
F64_LOG2E = "0x3ff71547"


def _tool(name: str) -> str | None:
    """`name` from the CUDA toolkit, else from the triton package (it ships cuobjdump/nvdisasm)."""
    cands = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for root in cands:
        if root and os.path.isfile(os.path.join(root, "bin", name)):
            return os.path.join(root, "bin", name)
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        p = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", name)
        if os.path.isfile(p):
            return p
    return shutil.which(name)


def _extension_path() -> str:
    if not dk._extension.HAS_CUDA_KERNELS:
        pytest.skip("d9d_kernels._C was built without CUDA kernels")
    from d9d_kernels import _C

    return _C.__file__


def _cuobjdump(*args: str) -> str:
    tool = _tool("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or triton package)")
    r = subprocess.run([tool, *args, _extension_path()], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


_CACHE: dict = {}


def sass() -> dict[str, str]:
    """sm_90 SASS of every kernel of ours: mangled name -> its instructions."""
    if "sass" not in _CACHE:
        out = _cuobjdump("-sass", "-arch", ARCH)
        funcs, name = {}, None
        for line in out.splitlines():
            m = re.search(r"Function : (\S+)", line)
            if m:
                name = m.group(1)
                funcs[name] = []
            elif name is not None:
                funcs[name].append(line)
        _CACHE["sass"] = {k: "\n".join(v) for k, v in funcs.items() if any(f in k for f in OURS)}
    return _CACHE["sass"]


def resources() -> dict[str, dict[str, int]]:
    """sm_90 REG / STACK / SHARED / LOCAL per kernel of ours."""
    if "res" not in _CACHE:
        out = _cuobjdump("--dump-resource-usage", "-arch", ARCH)
        res, name = {}, None
        for line in out.splitlines():
            m = re.search(r"Function (\S+):", line)
            if m:
                name = m.group(1)
                continue
            if name and "REG:" in line:
                res[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
                name = None
        _CACHE["res"] = {k: v for k, v in res.items() if any(f in k for f in OURS)}
    return _CACHE["res"]


def family(names, fam: str) -> list[str]:
    # "rows_kernel" is also a suffix of "any_logit_rows_kernel": match the whole word
    # (then I: a template's arguments, or E: the end of a plain function's name)
    return [n for n in names if re.search(rf"(?<![a-z_]){fam}[IE]", n)]


def test_every_family_is_in_the_binary():
    funcs = sass()
    for fam in OURS:
        assert family(funcs, fam), f"no {fam} in the sm_90 SASS of {_extension_path()}"


def test_ptx_is_embedded():
    ptx = _cuobjdump("-ptx")
    assert ".target sm_90" in ptx, "no sm_90 PTX: TORCH_CUDA_ARCH_LIST must end in 9.0+PTX"
    for fam in ONE_D + ENTRIES:
        assert re.search(rf"\.entry \S*{fam}", ptx), f"{fam} missing from the PTX"


@pytest.mark.parametrize("fam", ONE_D + ENTRIES + ONE_PASS)
def test_vector_loads(fam):
    """Every instantiation streams its preds / x with 16-byte loads."""
    funcs = sass()
    for name in family(funcs, fam):
        assert "LDG.E.128" in funcs[name], f"{name}: no LDG.E.128 (16-byte vector load)"


def test_class_stats_single_pass_has_no_float64_exp():
    """The one-pass score rows take exp2f (MUFU.EX2); the float64 path they
    replace (scores_kernel, kept for float64 scores and k > 32) shows what a
    float64 exp looks like in SASS, so this check can fail."""
    funcs = sass()
    assert any(F64_LOG2E in funcs[n] for n in family(funcs, "scores_kernel")), "float64 exp signature not found"
    for fam in ONE_PASS + THREAD_ROWS:
        names = family(funcs, fam)
        # the thread kernel's register top-k has KB 1/8/32 slots; the warp / block kernels one list per warp
        want = 3 * 3 if fam in THREAD_ROWS else 3
        assert len(names) == want, f"{fam}: expected {want} instantiations (float/half/bfloat16), got {len(names)}"
        for name in names:
            assert "MUFU.EX2" in funcs[name], f"{name}: no exp2f"
            assert F64_LOG2E not in funcs[name], f"{name}: a float64 exp in the float path"


@pytest.mark.parametrize("fam", OURS)
def test_no_float64_shared_atomics(fam):
    """Shared counters are uint32 (native ATOMS.ADD / POPC.INC), never the float64 CAS loop."""
    funcs = sass()
    for name in family(funcs, fam):
        assert "ATOMS.CAST.SPIN" not in funcs[name], f"{name}: shared-memory CAS loop"


def test_l1_counts_stay_in_registers():
    """binary_stats with one label counts in registers: no shared atomic in its element loop."""
    funcs = sass()
    l1 = [n for n in family(funcs, "binary_kernel") if "binary_kernelILb1E" in n]
    assert l1
    for name in l1:
        # the only shared atomics are the per-warp sums of the block flush: 4 cells and bad[2],
        # and 4 more cells where INPUT_AUTO counts both readings (binary_kernel<true, true, ...>)
        flushed = 10 if "binary_kernelILb1ELb1E" in name else 6
        assert funcs[name].count("ATOMS") <= flushed, name


@pytest.mark.parametrize("fam", OURS)
def test_registers_fit_and_no_spills(fam):
    res = resources()
    names = family(res, fam)
    assert names
    for name in names:
        r = res[name]
        regs = (r["REG"] + 7) // 8 * 8  # allocation granularity
        assert REGS_PER_SM // (regs * THREADS) >= 2, f"{name}: {r['REG']} registers allow < 2 blocks/SM"
        limit = 0 if fam in ONE_D else 8
        assert r["STACK"] <= limit and r["LOCAL"] == 0, f"{name}: spills ({r})"


# ---- Triton, compiled for sm_90 without a GPU ----------------------------------------------
# conftest.py sets TRITON_INTERPRET=1 for the session: compile in a subprocess without it.

ALIGNED = [["tt.divisibility", 16]]


def _ptx(kernel, consts: dict, types: dict, aligned: tuple[str, ...] = ()) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for p in params:
        sig[p] = "constexpr" if p in consts else types.get(p, "*fp64" if p.endswith("_ptr") else "i64")
    attrs = {(params.index(p),): ALIGNED for p in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def _triton_checks() -> None:
    from d9d_kernels.triton import _common, binary_stats, running_extrema, score_histogram
    from d9d_kernels.triton import weighted_moments as wm

    assert not _common.INTERPRETED
    B = _common.BLOCK
    # 16-byte aligned pointers and n % 16 == 0: what Triton specialises at launch
    # for torch allocations, so the steady-state kernels take these variants.
    one_d = {
        "extrema": _ptx(running_extrema._partial_kernel, dict(SKIP_BAD=False, HAS_M=False, BLOCK=B),
                        {"x_ptr": "*fp32", "m_ptr": "*u8"}, ("x_ptr", "part_ptr", "n")),
        "moments": _ptx(wm._moments_kernel,
                        dict(SKIP_BAD=False, HAS_Y=True, HAS_W=1, HAS_M=False, HAS_PIVOT=False, BLOCK=B),
                        {"x_ptr": "*fp32", "y_ptr": "*fp32", "w_ptr": "*fp32", "m_ptr": "*u8", "first_ptr": "*i64"},
                        ("x_ptr", "y_ptr", "w_ptr", "n")),
    }
    for name, ptx in one_d.items():
        assert "ld.global.v4" in ptx, f"triton {name}: no 16-byte vector load"
    ps = {"p_ptr": "*fp32", "t_ptr": "*i64", "m_ptr": "*u8", "flag_ptr": "*i32"}
    bn, bl = binary_stats.tile_2d(1)
    atomics = dict(one_d)
    atomics["binary_stats"] = _ptx(binary_stats._binary_stats_kernel,
                                   dict(KIND=2, HAS_M=True, HAS_IGNORE=True, BLOCK_N=bn, BLOCK_L=bl), ps)
    atomics["outside"] = _ptx(binary_stats.outside_kernel, dict(HAS_M=True, HAS_IGNORE=True, BLOCK_N=bn, BLOCK_L=bl), ps)
    for nb in (0, 2048):  # an atomic per entry; per-program histograms
        atomics[f"hist_nb{nb}"] = _ptx(score_histogram._binary_hist_kernel,
                                       dict(KIND=2, HAS_M=True, HAS_IGNORE=True, BLOCK_N=bn, BLOCK_L=bl, NB=nb), ps)
    from d9d_kernels.triton import expert_histogram as eh

    for nb in (0, 128):  # an atomic per slot; per-program histograms
        atomics[f"expert_load_nb{nb}"] = _ptx(eh._load_kernel, dict(NB=nb, BLOCK=B),
                                              {"idx_ptr": "*i64", "lay_ptr": "*i64"})
    atomics["expert_gate"] = _ptx(eh._gate_kernel, dict(BLOCK_T=16, BLOCK_E=128),
                                  {"p_ptr": "*fp32", "lay_ptr": "*i64"})
    atomics["first_good"] = _ptx(wm._first_good_kernel, dict(HAS_Y=False, HAS_W=0, HAS_M=False, BLOCK=B),
                                 {"x_ptr": "*fp32", "y_ptr": "*fp32", "w_ptr": "*fp32", "m_ptr": "*u8",
                                  "first_ptr": "*i64"})
    for name, ptx in atomics.items():
        lines = [ln for ln in ptx.splitlines() if re.search(r"\b(atom|red)\.", ln)]
        assert name == "extrema" or lines, f"triton {name}: no atomics found"
        bad = [ln.strip() for ln in lines if "acq_rel" in ln or ".acquire" in ln or ".release" in ln]
        assert not bad, f"triton {name}: ordered atomics {bad[:3]}"


def _without_interpreter(module: str, func: str) -> None:
    """Runs tests/ops/<module>.<func>() in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import {module}; {module}.{func}()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def test_triton_ptx_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    _without_interpreter("test_sass", "_triton_checks")


# ---- on a GPU: no host sync, graph capture ---------------------------------------------------


def _f64(*shape, fill=0.0, dev="cuda"):
    return torch.full(shape, fill, dtype=torch.float64, device=dev)


def _calls(dev):
    """(name, fn(states), fresh states) for every op of this file, on adversarial inputs:
    misaligned x[1:], odd sizes (50257), narrow targets, masks, NaN/Inf, INPUT_AUTO."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(100_003, generator=g).to(dev)
    x[7] = float("nan")
    x[11] = float("inf")
    xs = x[1:]  # misaligned: scalar head, vectors, scalar tail
    w = torch.rand(100_003, generator=g).to(dev)[1:]
    m = (torch.rand(100_002, generator=g) > 0.1).to(dev)
    p = torch.randn(3, 50257, generator=g).to(dev)
    t = torch.randint(0, 2, (3, 50257), generator=g).to(dev)
    p1 = torch.randn(200_001, generator=g).to(dev)[1:]
    t1 = torch.randint(0, 2, (200_000,), generator=g).to(dev)
    sc = torch.randn(64, 1000, generator=g).to(dev)
    tc = torch.randint(0, 1000, (64,), generator=g).to(dev)
    ek = torch.rand(48, 8192, 128, generator=g).topk(8, -1).indices.reshape(48, -1).to(dev)  # routing of 48 layers
    ek[3, ::7] = -1  # dropped slots
    ek[4, 100] = 128  # an index out of range
    eg = torch.softmax(torch.randn(2, 32, 128, generator=g), -1).to(dev)
    two = torch.tensor(2.0, device=dev)  # made here: a host-to-device copy is a sync the op is not asked to avoid
    return [
        ("weighted_moments", lambda s, b: dk.ops.weighted_moments(xs, xs * 2, w, m, state=s, bad=b, skip_bad=True),
         lambda: (_f64(9), _f64(1))),
        ("weighted_moments_scalar_w",
         lambda s, b: dk.ops.weighted_moments(xs.half(), weights=two, state=s, bad=b),
         lambda: (_f64(9), _f64(1))),
        ("running_extrema", lambda s, b: dk.ops.running_extrema(xs.bfloat16(), mask=m, state=s, bad=b),
         lambda: (_f64(2, fill=-float("inf")), _f64(1))),
        ("binary_stats", lambda s, b: dk.ops.binary_stats(p, t, state=s, bad=b), lambda: (_f64(50257, 4), _f64(2))),
        ("binary_stats_L1", lambda s, b: dk.ops.binary_stats(p1, t1, state=s, bad=b), lambda: (_f64(1, 4), _f64(2))),
        ("score_histogram", lambda s, b: dk.ops.score_histogram(p1, t1, hist=s, bad=b),
         lambda: (_f64(2, 1, 10_000), _f64(2))),
        ("expert_histogram", lambda s, b: dk.ops.expert_histogram(ek, None, load=s, bad=b),
         lambda: (_f64(48, 128), _f64(1))),
        ("expert_histogram_layers_int32", lambda s, b: dk.ops.expert_histogram(ek[5:9].int(), [9, 2, 40, 3], load=s, bad=b),
         lambda: (_f64(48, 128), _f64(1))),
        ("expert_histogram_gate", lambda s, b: dk.ops.expert_histogram(ek[:2, :256], [0, 1], eg, load=s[0], gate=s[1],
                                                                       bad=b),
         lambda: ((_f64(2, 128), _f64(2, 129)), _f64(1))),
        ("score_histogram_multiclass",
         lambda s, b: dk.ops.score_histogram(sc, tc, hist=s, bad=b, multiclass=True),
         lambda: (_f64(2, 1000, 100), _f64(2))),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_no_host_sync_and_graph_capture(backend, monkeypatch):
    """After a warm-up call, each op runs with sync debug mode "error" and replays
    from a CUDA graph with the result of eager calls."""
    if backend not in dk.ops.backends():
        pytest.skip(f"backend {backend} not available")
    monkeypatch.setenv("D9D_KERNELS_BACKEND", backend)
    dev = torch.device("cuda")
    for name, call, fresh in _calls(dev):
        eager = fresh()
        call(*fresh())  # warm-up: compile / occupancy queries / scratch buffers
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(*eager)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graphed = fresh()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call(*fresh())  # warm-up on the capture stream (its own scratch)
            with torch.cuda.graph(graph, stream=stream):
                call(*graphed)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        for e, gph in zip(eager, graphed):
            torch.testing.assert_close(gph, e, rtol=1e-9, atol=0, equal_nan=True, msg=f"{backend} {name}")


@pytest.mark.gpu
def test_compiled_triton_on_gpu():
    """test_triton._gpu_check, in a process without TRITON_INTERPRET: test_triton's
    own module runs interpreted on CPU tensors and is skipped on a GPU machine."""
    pytest.importorskip("triton")
    _without_interpreter("test_triton", "_gpu_check")


@pytest.mark.gpu
def test_cuda_matches_reference_at_vector_boundaries():
    """Every offset 0..15 and length around the vector width: head/body/tail splits."""
    if "cuda" not in dk.ops.backends():
        pytest.skip("no CUDA kernels")
    g = torch.Generator().manual_seed(1)
    base = torch.randn(300, generator=g)
    base[[5, 77]] = float("nan")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for off in range(16):
            for n in (0, 1, 7, 8, 9, 31, 64, 129, 250):
                x = base[off:off + n].to(dtype)
                for skip in (False, True):
                    want_s, want_b = _f64(2, fill=-float("inf"), dev="cpu"), _f64(1, dev="cpu")
                    reference.running_extrema(x, None, skip, want_s, want_b)
                    got_s, got_b = _f64(2, fill=-float("inf")), _f64(1)
                    dk.ops.running_extrema(x.cuda(), state=got_s, bad=got_b, skip_bad=skip, backend="cuda")
                    torch.testing.assert_close(got_s.cpu(), want_s, equal_nan=True)
                    torch.testing.assert_close(got_b.cpu(), want_b)
                    want_s, want_b = _f64(9, dev="cpu"), _f64(1, dev="cpu")
                    reference.weighted_moments(x, x * 2, x.abs(), None, skip, want_s, want_b)
                    got_s, got_b = _f64(9), _f64(1)
                    xc = x.cuda()
                    dk.ops.weighted_moments(xc, xc * 2, xc.abs(), state=got_s, bad=got_b, skip_bad=skip, backend="cuda")
                    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-12, atol=1e-12, equal_nan=True)
                    torch.testing.assert_close(got_b.cpu(), want_b)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["class_stats_C2048", "binary_stats_L3072", "score_histogram_6x1024"])
def test_cuda_shared_memory_at_the_48k_boundary(case):
    """Private shared counters of exactly 48 KiB beside the kernel's static shared
    memory: the launch fits (or opts in) and the counts match the reference."""
    if "cuda" not in dk.ops.backends():
        pytest.skip("no CUDA kernels")
    g = torch.Generator().manual_seed(3)
    if case == "class_stats_C2048":  # 3 * C doubles = 48 KiB, no confusion matrix
        C, n = 2048, 50_000
        p, t = torch.randint(0, C, (n,), generator=g), torch.randint(0, C, (n,), generator=g)
        want = [_f64(1, 3, C, dev="cpu"), _f64(2, dev="cpu"), _f64(2, dev="cpu")]
        reference.class_stats(p, t, None, C, None, [1], False, want[0], None, *want[1:])
        got = [w.cuda() * 0 for w in want]
        torch.ops.d9d_kernels.class_stats.default(p.cuda(), t.cuda(), None, C, None, [1], False, got[0], None, *got[1:])
    elif case == "binary_stats_L3072":  # 4 * L uint32 = 48 KiB
        L, n = 3072, 64
        p, t = torch.rand(n, L, generator=g), torch.randint(0, 2, (n, L), generator=g)
        want = [_f64(L, 4, dev="cpu"), _f64(2, dev="cpu")]
        reference.binary_stats(p, t, None, 0.5, None, reference.INPUT_PROBS, *want)
        got = [w.cuda() * 0 for w in want]
        dk.ops.binary_stats(p.cuda(), t.cuda(), state=got[0], bad=got[1], input_kind=reference.INPUT_PROBS,
                            backend="cuda")
    else:  # 2 * L * B uint32 = 48 KiB
        L, B, n = 6, 1024, 20_000
        p, t = torch.rand(n, L, generator=g), torch.randint(0, 2, (n, L), generator=g)
        want = [_f64(2, L, B, dev="cpu"), _f64(2, dev="cpu")]
        reference.score_histogram(p, t, None, None, reference.INPUT_PROBS, False, *want)
        got = [w.cuda() * 0 for w in want]
        dk.ops.score_histogram(p.cuda(), t.cuda(), hist=got[0], bad=got[1], input_kind=reference.INPUT_PROBS,
                               backend="cuda")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_running_extrema_beyond_int32():
    """N = 2^31 + 5 (bfloat16, ~4.3 GB): indices and per-block counts past int32."""
    if "cuda" not in dk.ops.backends():
        pytest.skip("no CUDA kernels")
    n = 2**31 + 5
    x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    x[-1] = 3.0
    x[0] = -2.0
    x[n // 2] = float("inf")
    s, b = _f64(2, fill=-float("inf")), _f64(1)
    dk.ops.running_extrema(x, state=s, bad=b, backend="cuda")
    assert s.tolist() == [float("inf"), 2.0] and b.item() == 1.0
    lab = torch.zeros(n, dtype=torch.int64, device="cuda")
    st, bad = _f64(1, 4), _f64(2)
    dk.ops.binary_stats(x, lab, state=st, bad=bad, input_kind=reference.INPUT_PROBS, backend="cuda")
    # preds: 3.0 and inf are > 0.5 (inf is bad: not finite), the rest are 0 or -2
    # bad: [targets not 0/1, bad preds] = [0, the inf]
    assert st.tolist() == [[0.0, 1.0, float(n - 2), 0.0]] and bad.tolist() == [0.0, 1.0]
