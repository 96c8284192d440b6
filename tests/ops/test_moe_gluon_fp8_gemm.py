"""gluon_fp8_gemm.grouped_mm (persistent Gluon FP8 grouped GEMM, sm_90) against the dequantised product in fp64.

The spec: y[rows of e] = dequant(qx)[rows] @ dequant(qw[e]), with 1x128 row scales (the kernel reads them in
quantize_dual's expert-major layout, the spec in the row-major one: same values) and 128x128 weight blocks; the
kernel accumulates each 128-deep slice in fp32 on the tensor cores and scales it in fp32, so it matches the fp64
product to the bf16 output's rounding. Rows at or past offs[-1] must be zeros (the caller's padding), rows of one
expert never written by another's tile. GPU only: Gluon does not run in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def _operands(counts, K, F, pad, seed):
    from moestack.ops.moe import fp8_quant as fq

    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    N = sum(counts) + pad
    x = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g).pow(2) * 8).to("cuda", torch.bfloat16)
    w = (torch.randn(E, K, F, generator=g) * 0.05).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to("cuda", torch.int32)
    qx, sx, _, _ = fq.quantize_dual(x, offs, tiles=False)
    qx_em, sx_em, _, _ = fq.quantize_dual(x, offs, expert_major=True, tiles=False)
    assert torch.equal(qx_em[:N - pad], qx[:N - pad])  # rows past offs[-1] are never quantised (nor read)
    (qw, sw), _ = fq.quantize_blocks_pair(w)
    return qx, sx, sx_em, qw, sw, offs


def _expected(qx, sx, qw, sw, offs):
    """fp64 product of the dequantised operands, expert by expert; zeros past offs[-1]."""
    N, K = qx.shape
    F = qw.shape[2]
    xd = qx.double() * sx.double().repeat_interleave(128, 1)[:, :K]
    wd = qw.double() * sw.double().repeat_interleave(128, 1)[:, :K].repeat_interleave(128, 2)[:, :, :F]
    y = torch.zeros(N, F, dtype=torch.float64, device=qx.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = xd[start:end] @ wd[e]
        start = end
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("counts,K,F,pad", [
    ([0, 1, 127, 128, 129, 0, 300], 256, 384, 5),   # empty experts, tile edges, rows past the last expert
    ([2341] * 3 + [0, 17], 640, 200, 0),           # an odd slice count (5), F not a multiple of 128
    ([64] * 9, 208, 128, 64),                      # K not a multiple of 128 (TMA zero-fills the last slice)
    ([0, 0, 0], 256, 256, 7),                      # no rows at all: only the zero padding
    ([3000, 1, 1, 1], 3584, 512, 0),               # one hot expert
])
def test_gluon_fp8_grouped_mm_gpu(counts, K, F, pad):
    from moestack.ops.moe import gluon_fp8_gemm as gg

    if not gg.supported_device(torch.cuda.current_device()):
        pytest.skip("sm_90 only")
    qx, sx, sx_em, qw, sw, offs = _operands(counts, K, F, pad, seed=K + F + len(counts))
    assert gg.supported(qx, qw)
    ref = _expected(qx, sx, qw, sw, offs)
    for config in gg.CONFIGS:
        y = gg.grouped_mm(qx, sx_em, qw, sw, offs, torch.bfloat16, config=config)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all(), config
        used = sum(counts)
        assert (y[used:] == 0).all(), config
        err = (y.double() - ref).norm() / ref.norm().clamp_min(1e-30)
        assert err < 6e-3, (config, err.item())  # bf16 output rounding (~2e-3 rms)
        assert torch.equal(y, gg.grouped_mm(qx, sx_em, qw, sw, offs, torch.bfloat16, config=config)), config


@pytest.mark.gpu
def test_gluon_fp8_grouped_mm_matches_triton_gpu():
    """Same slices, same fp32 promotion order as fp8_tma's Triton kernel: the outputs are expected bitwise equal."""
    from moestack.ops.moe import fp8_tma
    from moestack.ops.moe import gluon_fp8_gemm as gg

    if not gg.supported_device(torch.cuda.current_device()):
        pytest.skip("sm_90 only")
    qx, sx, sx_em, qw, sw, offs = _operands([700, 0, 513, 90], 1024, 768, 3, seed=1)
    y = gg.grouped_mm(qx, sx_em, qw, sw, offs, torch.bfloat16)
    y_tri = fp8_tma.grouped_mm(qx, sx, qw, sw, offs, torch.bfloat16)
    diff = (y.float() - y_tri.float()).abs().max().item()
    assert diff == 0.0, diff


def test_rows_gemm_env_rejects_unknown(monkeypatch):
    from moestack.ops.moe import fp8_grouped_gemm as fgg

    monkeypatch.setenv(fgg.ROWS_GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match="MOESTACK_FP8_ROWS_GEMM='cutlass'"):
        fgg._gluon_rows_gemm(torch.empty(1))
    monkeypatch.setenv(fgg.ROWS_GEMM_ENV, "gluon")
    assert fgg._gluon_rows_gemm(torch.empty(1)) is None  # CPU tensors: the per-expert path decides


@pytest.mark.gpu
def test_v3_gluon_rows_match_cublas_gpu(monkeypatch):
    """v3 at many rows per expert: y, dX and dW with the Gluon forward / dX (weight gradient per-expert cuBLAS, or
    fp8_tma's) match the per-expert cuBLAS path's to within bf16 rounding; with fp8_tma's weight gradient neither
    pass syncs with the host."""
    from moestack.ops.moe import fp8_grouped_gemm as fgg
    from moestack.ops.moe import fp8_scaled_mm as fsm
    from moestack.ops.moe import fp8_weight_cache
    from moestack.ops.moe import gluon_fp8_gemm as gg

    if not gg.supported_device(torch.cuda.current_device()) or not fsm.available(torch.device("cuda")):
        pytest.skip("sm_90 with cuBLAS blockwise FP8 only")
    g = torch.Generator().manual_seed(3)
    counts = [700, 0, 1300, 560]
    N, D, F = sum(counts), 512, 1024
    x0 = torch.randn(N, D, generator=g).to("cuda", torch.bfloat16)
    w0 = (torch.randn(len(counts), D, F, generator=g) * 0.05).to("cuda")
    dy = torch.randn(N, F, generator=g).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    out = {}
    for kind in ("cublas", "gluon", "gluon+tma-wgrad"):
        monkeypatch.setenv(fgg.ROWS_GEMM_ENV, kind.split("+")[0])
        monkeypatch.setenv(fgg.TMA_WGRAD_ENV, "1" if kind.endswith("tma-wgrad") else "0")
        fp8_weight_cache.clear()
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        y = fgg.Fp8GroupedMMv3.apply(x, w, offs, fgg.fq.FP8, None, 256)
        y.backward(dy)
        out[kind] = (y.detach().float(), x.grad.float(), w.grad.float())
    for kind in ("gluon", "gluon+tma-wgrad"):
        for name, a, b in zip(("y", "dx", "dw"), out["cublas"], out[kind]):
            err = ((a - b).norm() / a.norm()).item()
            assert err < 1e-3, (kind, name, err)
    # the sync-free combination: forward and backward without a device-to-host sync (after a warm-up call)
    monkeypatch.setenv(fgg.ROWS_GEMM_ENV, "gluon")
    monkeypatch.setenv(fgg.TMA_WGRAD_ENV, "1")
    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    fgg.Fp8GroupedMMv3.apply(x, w, offs, fgg.fq.FP8, None, 256).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fgg.Fp8GroupedMMv3.apply(x, w, offs, fgg.fq.FP8, None, 256).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fp8_weight_cache.clear()




_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from moestack.ops.moe import gluon_fp8_gemm as gg

n_consumers, pair, ns, group_t = gg.CONFIGS[int(sys.argv[1])]
kern = gg.fp8_gg_gluon_kernel
layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
x_layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
consts = {"BE": 64, "BT": 64 * n_consumers, "NS": ns, "GT": group_t, "PAIR": pair,
          "REGS": gg.REGISTERS[n_consumers][0], "PREGS": gg.REGISTERS[n_consumers][1], "PROMOTE": True}
types = {"x_desc": f"tensordesc<fp8e4nv[64, 128],{x_layout!r}>", "w_desc": f"tensordesc<fp8e4nv[128, 128],{layout!r}>",
         "sx": "*fp32", "sw": "*fp32", "y": "*bf16", "offs": "*i32"}
sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kern.arg_names}
src = GluonASTSource(fn=kern, signature=sig, attrs={},
                     constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()})
ptx = triton_compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx, "no fp8 wgmma"
assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
assert "setmaxnreg" in ptx, "no producer / consumer register split"
"""


@pytest.mark.parametrize("config", [0, 2])
def test_gluon_fp8_grouped_mm_compiles_for_sm90(config):
    """CPU: the kernel compiles for sm_90a with two and with three consumer warpgroups, with
    fp8 wgmma, TMA loads and the producer / consumer register split: catches Gluon front-end breakage without a GPU
    (the numbers are the GPU tests' job). In a subprocess without TRITON_INTERPRET, which turns jit functions into
    interpreted ones at import."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(config)], capture_output=True, text=True, env=env,
                       check=False, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
