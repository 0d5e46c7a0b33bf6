"""training_phases on torch.profiler traces generated here on CPU; expected
times are computed in the test from the raw JSON events (containment in the
ProfilerStep span, hand-written interval merge)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from d9d_kernels.trace import training_phases as tp


def _train(path: Path, variant: str, steps: int = 3):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    sched = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched,
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(steps + 1):
            if variant == "annotated":
                with record_function("## forward ##"):
                    with record_function("MyModel.forward"):      # nested: must not double count
                        loss = m(x).sum()
                with record_function("## backward ##"):
                    loss.backward()
                with record_function("## optimizer ##"):
                    opt.step()
                    opt.zero_grad()
            elif variant == "bare":  # only what torch records itself
                loss = m(x).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
            elif variant == "forward_encloses_backward":
                with record_function("forward"):
                    loss = m(x).sum()
                    loss.backward()
                opt.step()
                opt.zero_grad()
            torch.ones(256, 256).sum()  # "other" work outside every phase
            prof.step()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("phases")
    out = {}
    for v in ("annotated", "bare", "forward_encloses_backward"):
        (d / v).mkdir()
        out[v] = _train(d / v / "rank0_trace.json", v)
    return out


def _raw(path):
    ev = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in ev if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    return ev, steps


# Timestamps are ~4e12 us in float64 (resolution ~5e-4 us): compare to 1e-2 us.


def _within(e, s):
    return e["ts"] >= s["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]


def _merge(ivs):
    """Hand-written union length."""
    total, cur_s, cur_e = 0.0, None, None
    for a, b in sorted(ivs):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def _steps(r):
    return r["ranks"]["rank0"]["steps"]


def test_annotated_phases_equal_outer_annotation(traces):
    f = traces["annotated"]
    ev, steps = _raw(f)
    r = tp.metric_cal(f)
    assert not r["errors"]
    got = _steps(r)
    assert len(got) == len(steps) == 3
    for s in steps:
        num = s["name"].split("#")[1]
        exp = {ph: sum(e["dur"] for e in ev if e["name"] == f"## {ph} ##" and _within(e, s))
               for ph in ("forward", "backward", "optimizer")}
        for ph, v in exp.items():
            assert v > 0
            assert got[num][ph]["value"] == pytest.approx(v, abs=1e-2), ph
        assert got[num]["step"]["value"] == pytest.approx(s["dur"], abs=1e-2)
        assert got[num]["other"]["value"] == pytest.approx(s["dur"] - sum(exp.values()), abs=1e-2)
    rk = r["ranks"]["rank0"]
    assert "MyModel.forward" in rk["annotations"]["forward"]
    total_fwd = sum(e["dur"] for e in ev if e["name"] == "## forward ##"
                    and any(_within(e, s) for s in steps))
    assert rk["forward_time"]["value"] == pytest.approx(total_fwd, abs=1e-2)
    assert rk["forward_time"]["unit"] == "us"


def test_bare_trace_uses_autograd_engine_and_optimizer_spans(traces):
    f = traces["bare"]
    ev, steps = _raw(f)
    got = _steps(tp.metric_cal(f))
    for s in steps:
        num = s["name"].split("#")[1]
        eng = [(e["ts"], e["ts"] + e["dur"]) for e in ev
               if e["name"].startswith("autograd::engine::evaluate_function") and _within(e, s)]
        opt = [(e["ts"], e["ts"] + e["dur"]) for e in ev
               if e["name"].startswith(("Optimizer.step#", "Optimizer.zero_grad#")) and _within(e, s)]
        assert eng and opt
        # engine ops nest (AccumulateGrad inside ...Backward on some builds): union, not sum
        assert got[num]["backward"]["value"] == pytest.approx(_merge(eng), abs=1e-2)
        assert got[num]["optimizer"]["value"] == pytest.approx(_merge(opt), abs=1e-2)
        assert got[num]["forward"]["value"] == 0.0
    r = tp.metric_cal(f)
    assert r["ranks"]["rank0"]["forward_time"]["value"] is None  # no forward annotation at all
    assert any("no annotation for forward" in n for n in r["notes"])


def test_enclosing_forward_annotation_does_not_double_count_backward(traces):
    f = traces["forward_encloses_backward"]
    ev, steps = _raw(f)
    got = _steps(tp.metric_cal(f))
    for s in steps:
        num = s["name"].split("#")[1]
        fwd = [e for e in ev if e["name"] == "forward" and _within(e, s)]
        assert len(fwd) == 1
        eng = [(e["ts"], e["ts"] + e["dur"]) for e in ev
               if e["name"].startswith("autograd::engine::evaluate_function") and _within(e, s)]
        bwd = _merge(eng)
        assert got[num]["backward"]["value"] == pytest.approx(bwd, abs=1e-2)
        # the engine ops all run inside "forward": forward keeps only the rest
        assert got[num]["forward"]["value"] == pytest.approx(fwd[0]["dur"] - bwd, abs=1e-2)
        parts = sum(got[num][k]["value"] for k in ("forward", "backward", "optimizer", "other"))
        assert parts == pytest.approx(s["dur"], abs=1e-2)


@pytest.mark.parametrize("name,phase", [
    ("## forward ##", "forward"), ("DistributedDataParallel.forward", "forward"),
    ("FSDP::pre_forward (layers.0)", None), ("## backward ##", "backward"),
    ("autograd::engine::evaluate_function: MmBackward0", "backward"),
    ("Optimizer.step#AdamW.step", "optimizer"), ("## optimizer ##", "optimizer"),
    ("aten::mm", None), ("forward_prefetch", None),
])
def test_phase_names(name, phase):
    assert tp.phase_of_name(name) == phase


def test_missing_dir_is_reported_not_raised(tmp_path):
    r = tp.metric_cal(tmp_path / "nope")
    assert str(tmp_path / "nope") in r["errors"]


def test_gpu_time_attributed_by_launch_synthetic(tmp_path):
    """Kernels count toward the phase whose CPU span holds their launch; overlapping
    kernels of one phase are unioned (backward: [300,450) and [320,400) -> 150 us)."""
    from tests.trace._synth import SynthTrace

    t = SynthTrace()
    t.step(1, 0, 500).step(2, 500, 500)
    t.cpu("## forward ##", 10, 90, cat="user_annotation")
    t.cpu("## backward ##", 110, 70, cat="user_annotation")
    t.cpu("Optimizer.step#AdamW.step", 185, 10, cat="user_annotation")
    t.kernel("fwd_gemm", 200, 100, launch_ts=20)
    t.kernel("bwd_gemm", 300, 150, launch_ts=120)
    t.kernel("bwd_gemm2", 320, 80, stream=8, launch_ts=130)
    t.kernel("adam", 460, 10, launch_ts=190)
    t.kernel("other_step_kernel", 600, 50, launch_ts=510)
    f = t.write(tmp_path / "rank0_trace.json")
    s = tp.metric_cal(f, steps="all")["ranks"]["rank0"]["steps"]
    # the default step filter ('hta') drops the GPU work launched from the last step
    assert tp.metric_cal(f)["ranks"]["rank0"]["steps"]["2"]["step_gpu"]["value"] == 0
    assert s["1"]["forward_gpu"]["value"] == pytest.approx(100)
    assert s["1"]["backward_gpu"]["value"] == pytest.approx(150)
    assert s["1"]["optimizer_gpu"]["value"] == pytest.approx(10)
    assert s["1"]["step_gpu"]["value"] == pytest.approx(100 + 150 + 10)
    assert s["2"]["step_gpu"]["value"] == pytest.approx(50)
    assert s["2"]["forward_gpu"]["value"] == 0
    assert s["1"]["forward"]["value"] == pytest.approx(90)
    assert s["1"]["other"]["value"] == pytest.approx(500 - 90 - 70 - 10)


def test_no_profiler_step_gives_one_pseudo_step(tmp_path):
    from tests.trace._synth import SynthTrace

    t = SynthTrace()
    t.cpu("## forward ##", 100, 50, cat="user_annotation")
    t.cpu("aten::mm", 110, 20)
    t.cpu("## backward ##", 160, 30, cat="user_annotation")
    t.cpu("aten::add", 195, 5)   # trace spans [100, 200)
    f = t.write(tmp_path / "rank0_trace.json")
    rk = tp.metric_cal(f)["ranks"]["rank0"]
    assert list(rk["steps"]) == ["all"]
    s = rk["steps"]["all"]
    assert s["step"]["value"] == 100 and s["forward"]["value"] == 50 and s["backward"]["value"] == 30
    assert s["other"]["value"] == 20
    assert rk["optimizer_time"]["value"] is None


def test_forward_inferred_from_fsdp_hooks(tmp_path):
    """torchtitan-like: no forward annotation; FSDP hooks bound the forward."""
    from tests.trace._synth import SynthTrace

    t = SynthTrace()
    for k, base in ((1, 0), (2, 1000)):
        t.step(k, base, 1000)
        t.cpu("FSDP::root_pre_forward", base + 10, 10, cat="user_annotation")
        t.cpu("FSDP::pre_forward (layers.0)", base + 20, 10, cat="user_annotation")
        t.cpu("FSDP::post_forward (layers.0) [pg=8]", base + 200, 10, cat="user_annotation")
        t.cpu("autograd::engine::evaluate_function: MmBackward0", base + 300, 100)
        t.cpu("FSDP::pre_forward (layers.0)", base + 350, 10, cat="user_annotation")  # AC recompute
        t.cpu("Optimizer.step#AdamW.step", base + 500, 100, cat="user_annotation")
    f = t.write(tmp_path / "rank0_trace.json")
    r = tp.metric_cal(f)
    rk = r["ranks"]["rank0"]
    for k in ("1", "2"):
        assert rk["steps"][k]["forward"]["value"] == pytest.approx(200)   # [10, 210)
        assert rk["steps"][k]["backward"]["value"] == pytest.approx(100)
        assert rk["steps"][k]["optimizer"]["value"] == pytest.approx(100)
    assert rk["annotations"]["forward"] == [tp.INFERRED_FORWARD]
    assert any("inferred" in n for n in r["notes"])
