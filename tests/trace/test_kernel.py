"""Kernel classes from names (communication first) and time by class."""

from __future__ import annotations

import pytest

from d9d_kernels.trace import kernel
from d9d_kernels.trace._common import kernel_class
from d9d_kernels.trace._load import KIND_MEMCPY
from tests.trace._synth import SynthTrace


@pytest.mark.parametrize("name,cls", [
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*)", "communication"),  # not reduction
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("Memcpy DtoD (Device -> Device)", "memory"),
    ("Memset (Device)", "memory"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>>(Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "attention"),
    ("ampere_sgemm_128x64_tn", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("void cudnn::cnn::conv2d_grouped_direct_kernel<float>", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "reduction"),
    ("triton_red_fused_sum_1", "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("triton_poi_fused_gelu_2", "elementwise"),
    ("some_custom_kernel", "other"),
])
def test_name_rules(name, cls):
    assert kernel_class(name) == cls


def test_memcpy_event_is_memory_whatever_its_name():
    assert kernel_class("weird name", KIND_MEMCPY) == "memory"


def test_time_by_class_by_construction(tmp_path):
    t = SynthTrace()
    t.kernel("ampere_sgemm_128x64_tn", 0, 60)
    t.kernel("ampere_sgemm_128x64_tn", 100, 20)
    t.kernel("flash_fwd_kernel", 200, 40)
    t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", 0, 50, stream=20)
    t.kernel("Memcpy HtoD (Pageable -> Device)", 300, 30, cat="gpu_memcpy")
    res = kernel.metric_cal(t.write(tmp_path / "rank0.json"), step_filter="all")
    bc = res["ranks"]["rank0"]["by_class"]
    total = 60 + 20 + 40 + 50 + 30
    want = {"gemm": (2, 80), "attention": (1, 40), "communication": (1, 50), "memory": (1, 30)}
    assert set(bc) == set(want)
    for cls, (n, us) in want.items():
        assert bc[cls]["count"]["value"] == n
        assert bc[cls]["time"]["value"] == us
        assert bc[cls]["pct"]["value"] == pytest.approx(100.0 * us / total)
    assert bc["gemm"]["top_kernels"][0]["name"] == "ampere_sgemm_128x64_tn"
    # HTA-style typing: gemm [0,60) overlaps nccl [0,50)
    h = res["ranks"]["rank0"]["hta_kernel_type"]
    assert h["COMPUTATION overlapping COMMUNICATION"]["time"]["value"] == 50
    assert h["COMPUTATION"]["time"]["value"] == 10 + 20 + 40
    assert h["MEMORY"]["time"]["value"] == 30
