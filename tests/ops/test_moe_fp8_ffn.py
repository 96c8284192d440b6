"""The FP8 expert FFN with the activation fused into the quantisers (fp8_ffn.py, gluon_glu_quant.py).

CPU: Fp8ExpertFFN's steps (the cuBLAS path through test_moe_fp8's emulated torch._scaled_mm, the unfused
activation kernels in the interpreter, unrounded fp32 "q") against the unfused composition Fp8GroupedMMv3 ->
fused GLU -> Fp8GroupedMMv3 (bitwise: the same operations on the same numbers) and an fp64 loop; the fallback
composition; the Experts dispatch. GPU (`-m gpu`): the Gluon kernels' bytes against fused_glu / glu_bwd followed
by quantize_dual (bitwise), and the fused FFN against the unfused v3 composition at K3 widths (bitwise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_moe_fp8 import DEV, emulated_scaled_mm, make_case, offs_from_counts, rel_err  # first: TRITON_INTERPRET

from moestack.model.mlp import glu_activation
from moestack.ops.moe import fp8_ffn
from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe import fp8_scaled_mm as fsm
from moestack.ops.moe import fp8_weight_cache as wc
from moestack.ops.moe.fp8_grouped_gemm import Fp8GroupedMMv3
from moestack.ops.moe.triton_activation import fused_glu

BETAS = (4.0, 25.0)


def _weights(E, L, I, dtype, seed, device=DEV):
    """Experts' parameters: w_gate_up [E, 2I, L], w_down [E, L, I] (scaled to keep activations O(1))."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, L, generator=g) * L**-0.5).to(device, dtype).requires_grad_(True)
    w2 = (torch.randn(E, L, I, generator=g) * I**-0.5).to(device, dtype).requires_grad_(True)
    return w1, w2


def _run(fn, x, w1, w2, dy):
    """fn(x, w_gate_up view, w_down view) and its gradients in x, w1, w2."""
    xg = x.clone().requires_grad_(True)
    y = fn(xg, w1.transpose(1, 2), w2.transpose(1, 2))
    return (y, *torch.autograd.grad(y, (xg, w1, w2), dy))


def _composition(offs, kind, q_dtype, min_rows):
    """The unfused v3 layer: Fp8GroupedMMv3 -> fused GLU -> Fp8GroupedMMv3."""
    def fn(x, w1, w2):
        gu = Fp8GroupedMMv3.apply(x, w1, offs, q_dtype, None, min_rows)
        return Fp8GroupedMMv3.apply(fused_glu(gu, kind, *BETAS), w2, offs, q_dtype, None, min_rows)
    return fn


def _reference(x, w1, w2, offs, kind, dy):
    """The fp64 layer per expert and its gradients."""
    xr = x.detach().double().requires_grad_(True)
    w1r, w2r = w1.detach().double().requires_grad_(True), w2.detach().double().requires_grad_(True)
    ends = offs.tolist()
    outs = []
    for e, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        gate, up = (xr[a:b] @ w1r[e].t()).chunk(2, dim=-1)
        outs.append(glu_activation(gate, up, kind, *BETAS) @ w2r[e].t())
    y = torch.cat(outs + [xr.new_zeros(x.shape[0] - ends[-1], x.shape[1])])
    return (y, *torch.autograd.grad(y, (xr, w1r, w2r), dy.double()))


def _compare(got, want, used, exact: bool, tol: float = 1e-6):
    names = ("y", "dx", "dw_gate_up", "dw_down")
    for name, a, b in zip(names, got, want):
        if name in ("y", "dx"):
            a, b = a[:used], b[:used]
        if exact:
            assert torch.equal(a, b), (name, rel_err(a, b))
        else:
            assert rel_err(a, b) < tol, (name, rel_err(a, b))


# ---------------------------------------------------------------------------------------------------------------
# CPU: emulated cuBLAS path, interpreter kernels, fp32 "q"


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_ffn_cublas_path_emulated(kind, monkeypatch):
    """Fp8ExpertFFN (the cuBLAS path, unfused activation kernels off the GPU) = the v3 composition, bitwise; and
    the fp64 layer (unrounded "q": exact up to fp32 rounding). An empty expert, odd counts, tail rows."""
    if DEV == "cuda":
        pytest.skip("emulation case; the GPU runs test_ffn_vs_composition_gpu")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setenv(fsm.CUBLAS_MIN_ROWS_ENV, "0")
    wc.clear()
    counts, L, I = [130, 0, 70], 512, 512  # fsm.shapes_ok for both GEMMs: widths multiples of 512
    assert fsm.shapes_ok(L, 2 * I) and fsm.shapes_ok(I, L)
    x, _, offs = make_case(counts, L, 8, torch.float32, seed=1, tail=2)
    w1, w2 = _weights(len(counts), L, I, torch.float32, seed=2)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    taken = []
    orig = fp8_ffn.Fp8ExpertFFN.apply
    monkeypatch.setattr(fp8_ffn.Fp8ExpertFFN, "apply", lambda *a: (taken.append(1), orig(*a))[1])
    got = _run(lambda x, a, b: fp8_ffn.fp8_expert_ffn(x, a, b, offs, kind, *BETAS, q_dtype=torch.float32),
               x, w1, w2, dy)
    assert taken == [1]
    want = _run(_composition(offs, kind, torch.float32, 0), x, w1, w2, dy)
    used = sum(counts)
    _compare(got, want, used, exact=True)
    _compare(got, _reference(x, w1, w2, offs, kind, dy), used, exact=False, tol=1e-5)
    assert (got[0][used:] == 0).all() and (got[3][1] == 0).all() and (got[2][1] == 0).all()
    wc.clear()


def test_ffn_fallback_path(monkeypatch):
    """I % 128 != 0 and widths not multiples of 512: no cuBLAS path, so the plain composition (Triton GEMMs)."""
    if DEV == "cuda":
        pytest.skip("interpreter case")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setenv(fsm.CUBLAS_MIN_ROWS_ENV, "0")
    monkeypatch.setattr(fp8_ffn.Fp8ExpertFFN, "apply", lambda *a: pytest.fail("no cuBLAS path here"))
    wc.clear()
    counts, L, I = [40, 0, 21], 136, 100
    x, _, offs = make_case(counts, L, 8, torch.float32, seed=4)
    w1, w2 = _weights(len(counts), L, I, torch.float32, seed=5)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    got = _run(lambda x, a, b: fp8_ffn.fp8_expert_ffn(x, a, b, offs, "situ_glu", *BETAS, q_dtype=torch.float32),
               x, w1, w2, dy)
    _compare(got, _run(_composition(offs, "situ_glu", torch.float32, None), x, w1, w2, dy), sum(counts), True)
    _compare(got, _reference(x, w1, w2, offs, "situ_glu", dy), sum(counts), exact=False, tol=1e-5)
    wc.clear()


def test_experts_dispatch_fp8_ffn(monkeypatch):
    """Experts with backend "fp8-ffn" runs fp8_expert_ffn with its activation settings, forward and backward (fp32
    "q" here, so the result is the fp64 layer's); the registry knows the name (v3's single GEMM)."""
    from moestack.model.moe import Experts
    from moestack.ops import moe as moe_ops

    if DEV == "cuda":
        pytest.skip("emulation case")
    assert "fp8-ffn" in moe_ops._BACKENDS
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setenv(fsm.CUBLAS_MIN_ROWS_ENV, "0")
    wc.clear()
    seen = []
    orig = fp8_ffn.fp8_expert_ffn

    def spy(*args):
        seen.append(args[4:])
        return orig(*args, q_dtype=torch.float32)

    monkeypatch.setattr(fp8_ffn, "fp8_expert_ffn", spy)
    counts, L, I = [3, 9, 0], 512, 512
    ex = Experts(len(counts), L, I, "swiglu", situ_beta=3.0, situ_linear_beta=20.0)
    ex.init_weights(0.02)
    ex.backend = "fp8-ffn"
    x, _, offs = make_case(counts, L, 8, torch.float32, seed=7)
    x.requires_grad_(True)
    y = ex(x, offs)
    y.square().sum().backward()
    assert seen == [("swiglu", 3.0, 20.0)]
    ref = _reference(x, ex.w_gate_up, ex.w_down, offs, "swiglu", 2 * y.detach())
    got = (y, x.grad, ex.w_gate_up.grad, ex.w_down.grad)
    _compare(got, ref, sum(counts), exact=False, tol=1e-5)
    wc.clear()


def test_glu_quant_rejects_unsupported():
    """The Gluon kernels' clear errors (checked before any launch, so CPU tensors do)."""
    gq = pytest.importorskip("moestack.ops.moe.gluon_glu_quant")
    offs = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="I % 128 == 0"):
        gq.glu_quant_fwd(torch.zeros(4, 200, dtype=torch.bfloat16), offs)
    with pytest.raises(ValueError, match="I % 128 == 0"):
        gq.glu_quant_fwd(torch.zeros(4, 256, dtype=torch.float32), offs)
    with pytest.raises(ValueError, match="activation"):
        gq.glu_quant_fwd(torch.zeros(4, 256, dtype=torch.bfloat16), offs, kind="gelu")


# ---------------------------------------------------------------------------------------------------------------
# GPU

GPU_COUNTS = [0, 1, 127, 128, 129, 700, 0, 2341]  # empty, one row, one tile +- 1, several tiles


def _gluon():
    from moestack.ops.moe import gluon_glu_quant

    if not gluon_glu_quant.supported(torch.cuda.current_device()):
        pytest.skip("sm_90 only")
    return gluon_glu_quant


def _assert_dual_equal(got, want, used: int, n_tiles: int):
    """quantize_dual outputs byte for byte over what the GEMMs read: q's used rows (and the zero rows past N), the
    expert-major scales, the used token tiles and their scales."""
    (q, s, qT, sT), (q0, s0, qT0, sT0) = got, want
    assert torch.equal(q.view(torch.uint8)[:used], q0.view(torch.uint8)[:used])
    assert torch.equal(q._base[q.shape[0]:].view(torch.uint8), q0._base[q0.shape[0]:].view(torch.uint8))
    assert torch.equal(s, s0)
    cols = n_tiles * fq.GROUP
    assert torch.equal(qT.view(torch.uint8)[:, :cols], qT0.view(torch.uint8)[:, :cols])
    assert torch.equal(sT[:n_tiles], sT0[:n_tiles])
    assert q0[:used].float().abs().max() == 448.0  # not a vacuous comparison


def _gpu_gate_up(counts, I, seed, tail=5):
    g = torch.Generator().manual_seed(seed)
    used = sum(counts)
    gu = torch.randn(used + tail, 2 * I, generator=g) * torch.rand(used + tail, 1, generator=g).pow(2) * 6
    gu = gu.to("cuda", torch.bfloat16)
    gu[2] = 0  # an all-zero row: scale 1
    da = torch.randn(used + tail, I, generator=g).to("cuda", torch.bfloat16)
    return gu, da, offs_from_counts(counts, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
@pytest.mark.parametrize("counts,I", [(GPU_COUNTS, 3072), ([5, 130], 256)])
def test_glu_quant_bitwise_gpu(kind, counts, I):
    """glu_quant_fwd = quantize_dual(fused_glu(gu)), glu_quant_bwd = quantize_dual(glu_bwd(gu, da)): every byte."""
    gq = _gluon()
    from moestack.ops.moe.triton_activation import KINDS

    assert set(KINDS) == set(gq.KINDS) and all(KINDS[k] == gq.KINDS[k] for k in KINDS)
    gu, da, offs = _gpu_gate_up(counts, I, seed=I + len(counts))
    used, n_tiles = sum(counts), sum((c + 127) // 128 for c in counts)
    a = fused_glu(gu, kind, *BETAS)
    want = fq.quantize_dual(a, offs, expert_major=True, tiles=True)
    _assert_dual_equal(gq.glu_quant_fwd(gu, offs, kind, *BETAS), want, used, n_tiles)
    dgu = fp8_ffn.glu_bwd(gu, da, kind, *BETAS)
    want = fq.quantize_dual(dgu, offs, expert_major=True, tiles=True)
    _assert_dual_equal(gq.glu_quant_bwd(gu, da, offs, kind, *BETAS), want, used, n_tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_ffn_vs_composition_gpu(kind, monkeypatch):
    """Fp8ExpertFFN (fused Gluon quantisers) = the unfused v3 composition at K3 widths, bitwise: the fused kernels
    write the same bytes (test_glu_quant_bitwise_gpu) and every other step is the same cuBLAS call on the same
    operands. And within the FP8 layer bound of the fp32 layer."""
    _gluon()
    if not fsm.available(torch.device("cuda")):
        pytest.skip("no per-expert cuBLAS path here")
    monkeypatch.setenv(fsm.CUBLAS_MIN_ROWS_ENV, "0")
    wc.clear()
    counts, L, I = [600, 0, 1, 129, 900, 300, 2341, 64], 3584, 3072
    x, _, offs = make_case(counts, L, 8, torch.bfloat16, seed=11, tail=3)
    w1, w2 = _weights(len(counts), L, I, torch.bfloat16, seed=12)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(13)).to(DEV, torch.bfloat16)
    taken = []
    orig = fp8_ffn._gluon_kernels
    monkeypatch.setattr(fp8_ffn, "_gluon_kernels", lambda t: (taken.append(orig(t) is not None), orig(t))[1])
    got = _run(lambda x, a, b: fp8_ffn.fp8_expert_ffn(x, a, b, offs, kind, *BETAS), x, w1, w2, dy)
    assert taken == [True, True]
    want = _run(_composition(offs, kind, fq.FP8, 0), x, w1, w2, dy)
    used = sum(counts)
    _compare(got, want, used, exact=True)
    ref = _reference(x, w1, w2, offs, kind, dy)
    errs = {n: rel_err(a[:used] if i < 2 else a, b[:used] if i < 2 else b)
            for i, (n, a, b) in enumerate(zip(("y", "dx", "dw1", "dw2"), got, ref))}
    print(f"MOE_FP8_FFN {kind} vs fp64: {errs}")
    assert max(errs.values()) < 0.1, errs
    wc.clear()
