"""FP8 v3 expert GEMMs: fused quantisers, the paired weight quantiser, per-expert torch._scaled_mm path.

CPU: Triton kernels in the interpreter with unrounded fp32 "q" (the interpreter rounds fp8 casts wrongly), so the
tiling, scale layouts and GEMM schedules are checked exactly against fp64 loops; the per-expert cuBLAS path runs
through an emulation of torch._scaled_mm that asserts the shapes and strides torch's blockwise recipes take
(outer-dim-major 1x128 scales with leading dim = rows, 128x128 scales K-block-major, row-major a, column-major
b, rows a multiple of 4) and computes the dequantised product in fp32. GPU (`-m gpu`): fp8 rounding against the
torch spec, v3 against v2 and the fp32 loop at real shapes, the cuBLAS path included where the probe accepts it.
Older FP8 tests (v1 / v2) stay in tests/ops/test_moe_grouped_gemm.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are decorated
pytest.importorskip("triton")

from moestack.ops.moe import fp8_grouped_gemm as f8
from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe import fp8_scaled_mm as fsm
from moestack.ops.moe import fp8_weight_cache as wc
from moestack.ops.moe.reference import grouped_mm_loop

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def offs_from_counts(counts: list[int], device=DEV) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def make_case(counts, D, F, dtype, seed=0, tail=0, device=DEV):
    """x [sum(counts) + tail, D], param [E, F, D] (Experts' layout; the GEMM sees param.transpose(1, 2)), offs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N, E = sum(counts) + tail, len(counts)
    x = torch.randn(N, D, generator=g).to(device, dtype)
    param = torch.randn(E, F, D, generator=g).div(D**0.5).to(device, dtype)
    return x, param, offs_from_counts(counts, device)


def assert_fp8_near(q: torch.Tensor, q_ref: torch.Tensor, max_frac: float = 1e-2) -> None:
    """quantize_dual's kernels scale by x * (448 / amax) with an approximate reciprocal, the spec by x / scale: the
    fp8 values may differ only where x / scale falls (almost) exactly between two fp8 values (bf16 inputs hit such
    ties often: ~0.14% at K3 widths, session 9). So: every element equal or one fp8 step away (adjacent codes of the
    same sign), and not many of the latter."""
    a, b = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    same_sign = (a >> 7) == (b >> 7)
    near = (a == b) | (same_sign & ((a - b).abs() == 1))
    assert bool(near.all()), f"{int((~near).sum())} fp8 values more than one step from the spec"
    frac = float((a != b).float().mean())
    assert frac < max_frac, f"{frac:.4f} of the fp8 values one step from the spec"


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, out):
    """torch._scaled_mm (v1 API, recipe from the scale shapes) for blockwise scales, with its layout rules."""
    M, K = a.shape
    K2, N = b.shape
    nk = K // 128
    assert K == K2 and K % 128 == 0 and M % 4 == 0, (a.shape, b.shape)
    assert a.stride(1) == 1 and b.stride(0) == 1, "row-major a, column-major b"
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (M, nk), scale_a.shape
    if nk > 1:  # 1x128: outer-dim-major, leading dim = M
        assert scale_a.stride(0) == 1 and scale_a.stride(1) == M, scale_a.stride()
    nb = N // 128
    if scale_b.shape == (nk, nb) and N % 128 == 0 and nb != N:  # 128x128 blocks, K blocks contiguous
        if nk > 1 and nb > 1:
            assert scale_b.stride(0) == 1 and scale_b.stride(1) == nk, scale_b.stride()
        full_b = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:  # 1x128 along K for b: [K/128, N], N contiguous
        assert scale_b.shape == (nk, N) and (N == 1 or scale_b.stride(1) == 1), (scale_b.shape, scale_b.stride())
        full_b = scale_b.repeat_interleave(128, 0)
    for t in (a, b, scale_a, scale_b, out):
        assert t.data_ptr() % 16 == 0, "cuBLAS wants 16-byte aligned operands"
    assert out.shape == (M, N) and out.is_contiguous() and out.dtype == out_dtype
    res = (a.float() * scale_a.repeat_interleave(128, 1)) @ (b.float() * full_b)
    out.copy_(res)
    return out


# ---------------------------------------------------------------------------------------------------------------
# quantisers (interpreter, fp32 "q")


def test_quantize_dual_interpreter():
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_quantize_dual_gpu")
    counts = [40, 0, 131, 3, 0]
    x, _, offs = make_case(counts, 200, 8, torch.float32, seed=1, tail=3)
    x[5, 128:200] = 0.0  # an all-zero row group: scale 1
    N = x.shape[0]
    used = sum(counts)
    qr, sr = fq.quantize_rows_ref(x, torch.float32)
    qTr, sTr = fq.quantize_token_tiles_ref(x, offs, torch.float32)
    n_tiles = sum((c + 127) // 128 for c in counts)
    for expert_major in (False, True):
        q, s, qT, sT = fq.quantize_dual(x, offs, torch.float32, expert_major=expert_major)
        assert q.shape == (N, 200) and q._base.shape == (N + 3, 200) and (q._base[N:] == 0).all()
        assert rel_err(q[:used], qr[:used]) < 1e-6
        if expert_major:
            assert torch.equal(s, fq.expert_major_scales_ref(sr, offs))
        else:
            assert rel_err(s[:used], sr[:used]) < 1e-6
        assert rel_err(sT[:n_tiles], sTr[:n_tiles]) < 1e-6
        assert rel_err(qT[:, :n_tiles * 128], qTr[:, :n_tiles * 128]) < 1e-6
    q2, _, qT2, sT2 = fq.quantize_dual(x, offs, torch.float32, tiles=False)
    assert qT2 is None and sT2 is None and torch.equal(q2[:used], q[:used])


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_quantize_glu_source_interpreter(kind):
    """quantize_glu_dual (the activation inside the quantiser) equals quantize_dual of the activation, both
    layouts of the row scales."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_moe_gluon_quant.py's test_fused_glu_source_gpu")
    from moestack.model.mlp import glu_activation

    counts, inter = [40, 0, 131, 3], 256
    g = torch.Generator().manual_seed(3)
    N = sum(counts) + 2
    gu = torch.randn(N, 2 * inter, generator=g) * 3
    offs = offs_from_counts(counts)
    act = glu_activation(gu[:, :inter], gu[:, inter:], kind, 4.0, 25.0)
    used, n_tiles = sum(counts), sum((c + 127) // 128 for c in counts)
    for expert_major in (False, True):
        got = fq.quantize_glu_dual(gu, offs, kind, 4.0, 25.0, torch.float32, expert_major)
        want = fq.quantize_dual(act, offs, torch.float32, expert_major=expert_major)
        assert got[0].shape == want[0].shape and got[2].shape == want[2].shape
        assert rel_err(got[0][:used], want[0][:used]) < 1e-5
        s_got, s_want = (got[1], want[1]) if expert_major else (got[1][:used], want[1][:used])
        assert rel_err(s_got, s_want) < 1e-5
        assert rel_err(got[2][:, :n_tiles * 128], want[2][:, :n_tiles * 128]) < 1e-5
        assert rel_err(got[3][:n_tiles], want[3][:n_tiles]) < 1e-5
    with pytest.raises(ValueError, match="multiple of 128"):
        fq.quantize_glu_dual(gu[:, :200], offs, kind, 4.0, 25.0, torch.float32)


def test_expert_major_layout():
    base, mp = fq.expert_major_layout([5, 0, 8, 1])
    assert mp == [8, 0, 8, 4] and base == [0, 8, 8, 16]
    s = torch.arange(14 * 2, dtype=torch.float32).view(14, 2) + 1
    flat = fq.expert_major_scales_ref(s, torch.tensor([5, 5, 13, 14], dtype=torch.int32))
    blk = flat[8 * 2:16 * 2].view(2, 8)  # expert 2: rows 5..12, [nk, Mp]
    assert torch.equal(blk.t(), s[5:13])
    blk0 = flat[:16].view(2, 8)
    assert torch.equal(blk0[:, :5].t(), s[:5]) and (blk0[:, 5:] == 0).all()


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_quantize_blocks_pair_interpreter(w_dtype):
    """Both paths: the fused transposed store (16-bit weights) and the torch copy of q (fp32 weights)."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_quantize_blocks_pair_gpu")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 260, 140, generator=g).to(w_dtype).transpose(1, 2)  # [E, K=140, F=260] view of [E, F, K]
    (q, s), (qT, sT) = fq.quantize_blocks_pair(w, torch.float32)
    qr, sr = fq.quantize_blocks_ref(w, torch.float32)
    qTr, sTr = fq.quantize_blocks_ref(w.transpose(1, 2), torch.float32)
    assert rel_err(q, qr) < 1e-6 and rel_err(s, sr) < 1e-6 and q.stride(1) == 1
    assert rel_err(qT, qTr) < 1e-6 and rel_err(sT, sTr) < 1e-6 and qT.stride(1) == 1
    assert sT.is_contiguous() and torch.equal(sT, s.transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_transpose_bytes(dtype):
    """The byte transpose behind quantize_blocks_pair's fp32 path, against torch, at shapes off its tile grid."""
    g = torch.Generator().manual_seed(7)
    for E, R, C in ((3, 37, 50), (1, 130, 17), (2, 0, 5)):
        src = torch.randn(E, R, C, generator=g).mul(40).to(DEV).to(dtype)
        dst = torch.full((E, C, R), 1.0, device=DEV).to(dtype)
        fq.transpose_bytes(src, dst, kernel=True)
        assert torch.equal(dst.view(torch.uint8) if dtype.itemsize == 1 else dst,
                           (src.view(torch.uint8) if dtype.itemsize == 1 else src).transpose(1, 2))


def test_quantize_blocks_fp32_transposing_view_interpreter():
    """quantize_blocks from an fp32 view whose F is contiguous (v2's dX weights) goes through w^T's own layout."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_quantize_blocks_pair_gpu")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 140, 260, generator=g)  # [E, K, F], F contiguous
    q, s = fq.quantize_blocks(w, torch.float32)
    qr, sr = fq.quantize_blocks_ref(w, torch.float32)
    assert rel_err(q, qr) < 1e-6 and rel_err(s, sr) < 1e-6 and q.stride(1) == 1 and s.is_contiguous()


def test_weight_cache_pair_hits_blocks():
    if DEV == "cuda":
        pytest.skip("interpreter case")
    wc.clear()
    _, param, _ = make_case([1], 136, 130, torch.float32, seed=3)
    param.requires_grad_(True)
    w = param.transpose(1, 2)
    fwd, bwd = wc.pair(w, torch.float32)
    misses = wc.stats["misses"]
    assert wc.blocks(w, torch.float32)[0] is fwd[0]
    assert wc.blocks(param.transpose(1, 2).transpose(1, 2), torch.float32)[0] is bwd[0]
    assert wc.stats["misses"] == misses
    with torch.no_grad():
        param.mul_(2.0)
    fwd2, _ = wc.pair(w, torch.float32)
    assert wc.stats["misses"] == misses + 1 and rel_err(fwd2[1], 2 * fwd[1]) < 1e-6
    wc.clear()


@pytest.mark.parametrize("mode", ["1", "step"])
def test_weight_cache_drops_freed_weights(mode, monkeypatch):
    """FSDP2 frees a gathered weight after use by resizing its storage to 0 (and refills it at the next gather). By
    default the next miss drops such an entry, so the cache holds only what is gathered now; MOESTACK_FP8_CACHE=step
    keeps it until the optimizer step. peak_bytes is the most held at once; a bad mode names the variable."""
    if DEV == "cuda":
        pytest.skip("interpreter case")
    monkeypatch.setenv("MOESTACK_FP8_CACHE", mode)
    wc.clear()
    wc.stats["peak_bytes"] = 0
    layers = [torch.nn.Parameter(make_case([1], 136, 130, torch.float32, seed=s)[1]) for s in (5, 6)]
    values = [p.detach().clone() for p in layers]
    one = sum(t.nbytes for layout in wc.pair(layers[0].transpose(1, 2), torch.float32) for t in layout)
    layers[0].untyped_storage().resize_(0)  # layer 0 resharded
    wc.pair(layers[1].transpose(1, 2), torch.float32)  # a miss: the purge runs
    assert len(wc._entries) == (2 if mode == "1" else 4)
    assert wc.stats["peak_bytes"] == (one if mode == "1" else 2 * one)
    layers[0].untyped_storage().resize_(values[0].nbytes)  # gathered again, same values (same optimizer step)
    layers[0].data.copy_(values[0])  # as FSDP's copy-out: through another tensor, no version bump
    misses = wc.stats["misses"]
    (q, s), _ = wc.pair(layers[0].transpose(1, 2), torch.float32)
    assert wc.stats["misses"] == misses + (mode == "1")
    want = fq.quantize_blocks_ref(values[0].transpose(1, 2), torch.float32)
    assert rel_err(fq.dequantize_blocks(q, s), fq.dequantize_blocks(*want)) < 1e-6
    monkeypatch.setenv("MOESTACK_FP8_CACHE", "always")
    with pytest.raises(ValueError, match="MOESTACK_FP8_CACHE='always'"):
        wc.pair(layers[1].transpose(1, 2), torch.float32)
    wc.clear()


@pytest.mark.parametrize("opt_kw", [{"fused": True}, {"foreach": True}])
def test_weight_cache_follows_optimizer_step(opt_kw):
    """Issue #7: the trainer's fused AdamW (torch._fused_adamw_) updates the parameters without bumping their
    version counter, so a version-keyed cache served the step-0 fp8 weights for the whole run (frozen expert
    weights in the forward: v2's loss gap, v3's divergence). After optimizer.step() both cached layouts and the
    v3 GEMM must follow the new weights."""
    wc.clear()
    counts = [5, 0, 9]
    x, param, offs = make_case(counts, 136, 40, torch.float32, seed=21)
    param = torch.nn.Parameter(param)
    w = param.transpose(1, 2)
    opt = torch.optim.AdamW([param], lr=0.1, **opt_kw)
    wc.pair(w, torch.float32)
    wc.blocks(w, torch.float32)
    param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(22)).to(param.device)
    opt.step()
    assert rel_err(param.detach(), make_case(counts, 136, 40, torch.float32, seed=21)[1]) > 1e-2  # it moved
    (q, s), (qT, sT) = wc.pair(w, torch.float32)
    for got, want in (((q, s), fq.quantize_blocks_ref(w.detach(), torch.float32)),
                      ((qT, sT), fq.quantize_blocks_ref(param.detach(), torch.float32)),
                      (wc.blocks(w, torch.float32), fq.quantize_blocks_ref(w.detach(), torch.float32))):
        assert rel_err(fq.dequantize_blocks(*got), fq.dequantize_blocks(*want)) < 1e-6
    y = f8.Fp8GroupedMMv3.apply(x, w, offs, torch.float32, None, 10**9)
    y_ref = grouped_mm_loop(x.double(), w.detach().double(), offs)
    used = sum(counts)
    assert rel_err(y[:used], y_ref[:used]) < 1e-5
    wc.clear()


def test_checkpoint_loads_forget_fp8_weights():
    """load_checkpoint / load_hf_weights empty the FP8 weight cache (under FSDP2 they reach the gathered weights
    without a version bump); the helper is a no-op while the cache module is not loaded."""
    from moestack.train.checkpoint import forget_fp8_weights

    wc.clear()
    w = torch.randn(2, 256, 128, device=DEV)
    wc.pair(w, torch.float32)
    assert len(wc._entries) == 2
    forget_fp8_weights()
    assert not wc._entries


# ---------------------------------------------------------------------------------------------------------------
# v3 GEMMs (interpreter / emulation)


def _v3_vs_loop(counts, D, F, min_rows, seed, tail=2):
    wc.clear()
    x, param, offs = make_case(counts, D, F, torch.float32, seed=seed, tail=tail)
    param.requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = f8.Fp8GroupedMMv3.apply(xg, param.transpose(1, 2), offs, torch.float32, None, min_rows)
    used = int(offs[-1])
    xr, pr = x.double().requires_grad_(True), param.detach().double().requires_grad_(True)
    y_ref = grouped_mm_loop(xr, pr.transpose(1, 2), offs)
    assert rel_err(y[:used], y_ref[:used]) < 1e-5 and (y[used:] == 0).all()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
    dx, dp = torch.autograd.grad(y, (xg, param), dy)
    dxr, dpr = torch.autograd.grad(y_ref, (xr, pr), dy.double())
    assert rel_err(dx[:used], dxr[:used]) < 1e-5 and rel_err(dp, dpr) < 1e-5
    assert dp.is_contiguous()  # dW in the parameter's layout
    for e, c in enumerate(counts):
        if c == 0:
            assert (dp[e] == 0).all()
    wc.clear()


def test_v3_triton_path_interpreter():
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_v3_gpu")
    _v3_vs_loop([40, 0, 131, 3], 136, 80, min_rows=10**9, seed=7)


def test_v3_scaled_mm_path_emulated(monkeypatch):
    """The per-expert cuBLAS path with an emulated torch._scaled_mm that enforces its layout rules: expert-major
    scales, rows rounded up to 4 (odd counts), empty experts, an expert of one row, tail rows past offs[-1]."""
    if DEV == "cuda":
        pytest.skip("emulation case; the GPU runs the real call in test_v3_gpu")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    calls = []
    monkeypatch.setattr(fsm, "_scaled_mm_into", lambda *a: (calls.append(a[0].shape), emulated_scaled_mm(
        *a[:4], a[4].dtype, a[4]))[1])
    _v3_vs_loop([37, 0, 130, 1, 6], 512, 512, min_rows=0, seed=9)
    assert len(calls) == 3 * 4  # forward, dX, dW: one call per non-empty expert
    assert calls[0] == (40, 512)  # 37 rows read as 40


def test_v3_cublas_wgrad_only_emulated(monkeypatch):
    """MOESTACK_FP8_CUBLAS_WGRAD_MIN_ROWS below the forward's threshold: forward / dX on Triton, dW per expert on
    the (emulated) cuBLAS path."""
    if DEV == "cuda":
        pytest.skip("emulation case")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setenv("MOESTACK_FP8_CUBLAS_WGRAD_MIN_ROWS", "0")
    calls = []
    orig = fsm.wgrad
    monkeypatch.setattr(fsm, "wgrad", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    monkeypatch.setattr(fsm, "rows_mm", lambda *a, **k: pytest.fail("forward / dX must stay on Triton"))
    _v3_vs_loop([20, 0, 9, 131], 144, 80, min_rows=10**9, seed=15)
    assert calls == [1]


def _ffn_unfused(x, w_gu, w_down, offs, kind, q_dtype):
    from moestack.ops.moe.triton_activation import fused_glu

    gu = f8.Fp8GroupedMMv3.apply(x, w_gu.transpose(1, 2), offs, q_dtype, None, 0)
    return f8.Fp8GroupedMMv3.apply(fused_glu(gu, kind, 4.0, 25.0), w_down.transpose(1, 2), offs, q_dtype, None, 0)


@pytest.mark.parametrize("kind", ["situ_glu"])  # swiglu's source: test_quantize_glu_source_interpreter (CI time)
def test_fp8_expert_ffn_emulated(kind, monkeypatch):
    """The fused FFN (activation inside the down GEMM's quantiser) against the unfused pair of v3 GEMMs around
    fused_glu, on the emulated cuBLAS path with unrounded "fp8": outputs and all three gradients, empty experts, odd
    counts, tail rows; and against the fp64 eager FFN."""
    if DEV == "cuda":
        pytest.skip("emulation case; the GPU runs test_fp8_expert_ffn_gpu")
    from moestack.model.mlp import glu_activation
    from moestack.ops.moe import fp8_expert_ffn as ffn

    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setenv("MOESTACK_FP8_CUBLAS_MIN_ROWS", "0")
    monkeypatch.setenv(f8.V3_ENV, "1")
    monkeypatch.setenv(ffn.ENV, "1")
    counts, D, inter = [37, 0, 130, 1, 6], 512, 512
    g = torch.Generator().manual_seed(21)
    x = torch.randn(sum(counts) + 2, D, generator=g)
    w_gu = (torch.randn(len(counts), 2 * inter, D, generator=g) / D**0.5).requires_grad_(True)
    w_down = (torch.randn(len(counts), D, inter, generator=g) / inter**0.5).requires_grad_(True)
    offs = offs_from_counts(counts)
    assert ffn.applies(x, w_gu.transpose(1, 2), w_down.transpose(1, 2))
    used = sum(counts)
    dy = torch.randn(x.shape, generator=g)
    outs = []
    for fused in (True, False):
        wc.clear()
        xg = x.clone().requires_grad_(True)
        if fused:
            y = ffn.Fp8ExpertFFN.apply(xg, w_gu.transpose(1, 2), w_down.transpose(1, 2), offs, kind, 4.0, 25.0,
                                       torch.float32)
        else:
            y = _ffn_unfused(xg, w_gu, w_down, offs, kind, torch.float32)
        outs.append((y, *torch.autograd.grad(y, (xg, w_gu, w_down), dy)))
    for got, want in zip(*outs):
        assert rel_err(got[:used] if got.shape[0] == x.shape[0] else got, want[:used] if want.shape[0] == x.shape[0]
                       else want) < 1e-5
    # against the eager FFN in fp64 (the quantisers are unrounded here, so only the fp32 GEMMs differ)
    xr = x.double().requires_grad_(True)
    wg, wd = w_gu.detach().double().requires_grad_(True), w_down.detach().double().requires_grad_(True)
    gu = grouped_mm_loop(xr, wg.transpose(1, 2), offs)
    y_ref = grouped_mm_loop(glu_activation(gu[:, :inter], gu[:, inter:], kind), wd.transpose(1, 2), offs)
    refs = (y_ref, *torch.autograd.grad(y_ref, (xr, wg, wd), dy.double()))
    y, dx, dwg, dwd = outs[0]
    assert rel_err(y[:used], y_ref[:used]) < 1e-4 and rel_err(dx[:used], refs[1][:used]) < 1e-4
    assert rel_err(dwg, refs[2]) < 1e-4 and rel_err(dwd, refs[3]) < 1e-4
    assert (dwg[1] == 0).all() and (dwd[1] == 0).all() and dwg.is_contiguous() and dwd.is_contiguous()
    wc.clear()


def test_fp8_expert_ffn_applies(monkeypatch):
    """Where the fused FFN steps aside: off by default, v3 off, the env switch at 0, few rows per expert, an
    intermediate size off the tile grid, the Triton weight gradient; a bad switch value names the variable."""
    from moestack.ops.moe import fp8_expert_ffn as ffn

    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setenv(f8.V3_ENV, "1")
    assert not ffn.applies(torch.zeros(4096, 512), torch.zeros(4, 512, 1024), torch.zeros(4, 512, 512))  # opt-in
    monkeypatch.setenv(ffn.ENV, "1")
    x = torch.zeros(4096, 512)
    w_gu, w_down = torch.zeros(4, 512, 1024), torch.zeros(4, 512, 512)
    assert ffn.applies(x, w_gu, w_down)
    assert not ffn.applies(x[:100], w_gu, w_down)  # mean rows per expert below the cuBLAS threshold
    assert not ffn.applies(torch.zeros(4096, 640), torch.zeros(4, 640, 1280), torch.zeros(4, 640, 640))
    for env, value in ((f8.V3_ENV, "0"), (f8.V2_ENV, "0"), (ffn.ENV, "0"), (f8.TMA_WGRAD_ENV, "1")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            assert not ffn.applies(x, w_gu, w_down), env
    monkeypatch.setenv(ffn.ENV, "yes")
    with pytest.raises(ValueError, match="MOESTACK_FP8_FUSED_FFN='yes'"):
        ffn.applies(x, w_gu, w_down)


def test_experts_take_the_fused_ffn(monkeypatch):
    """Experts.ffn hands the fp8 backend's FFN to moestack.ops.moe.expert_ffn (triton activation, own seam) and runs
    the unfused pair when it returns None or when a seam replaced grouped_mm."""
    from moestack.model.mlp import glu_activation
    from moestack.model.moe import Experts
    from moestack.ops import moe as moe_ops
    from moestack.ops.moe import fp8_expert_ffn as ffn

    experts = Experts(2, 8, 4)
    experts.init_weights(0.1)
    experts.backend, experts.routing_backend = "fp8", "triton"
    seen = []
    monkeypatch.setattr(moe_ops, "_fp8_available", lambda: True)
    monkeypatch.setattr(ffn, "expert_ffn", lambda x, wg, wd, o, kind, b, lb: seen.append((wg.shape, kind)) or x * 2)
    x, offs = torch.randn(5, 8), torch.tensor([2, 5], dtype=torch.int32)
    assert torch.equal(experts(x, offs), x * 2) and seen == [((2, 8, 8), "situ_glu")]
    # the unfused pair (the eager activation, so this runs on CPU tensors with a GPU present too)
    monkeypatch.setattr(experts, "glu", lambda gu: glu_activation(*gu.chunk(2, dim=-1), "situ_glu"))
    gu = grouped_mm_loop(x, experts.w_gate_up.transpose(1, 2), offs)
    want = grouped_mm_loop(glu_activation(*gu.chunk(2, dim=-1), "situ_glu"), experts.w_down.transpose(1, 2), offs)
    monkeypatch.setattr(ffn, "expert_ffn", lambda *a: None)
    monkeypatch.setattr(moe_ops, "grouped_mm", lambda x, w, o, backend=None: grouped_mm_loop(x, w, o))
    assert torch.allclose(experts(x, offs), want)  # expert_ffn declined
    monkeypatch.setattr(ffn, "expert_ffn", lambda *a: pytest.fail("a replaced seam must bypass the fused FFN"))
    monkeypatch.setattr(experts, "grouped_mm", lambda x, w, o: grouped_mm_loop(x, w, o))
    assert torch.allclose(experts(x, offs), want)


def test_host_offsets_cached():
    offs = torch.tensor([3, 5, 9], dtype=torch.int32)
    a = fsm.host_offsets(offs)
    assert a == [3, 5, 9] and fsm.host_offsets(offs) is a
    offs.add_(1)  # an in-place change is seen
    assert fsm.host_offsets(offs) == [4, 6, 10]


def test_registry_v3_env(monkeypatch):
    """v3 is the default of the registry call (v2=None, v3=None); MOESTACK_FP8_V3=0 gives v2, MOESTACK_FP8_V2=0 or
    an explicit v2=False v1, and a value other than 0 / 1 is refused with the variable's name."""
    monkeypatch.delenv(f8.V2_ENV, raising=False)
    monkeypatch.delenv(f8.V3_ENV, raising=False)
    seen = []
    monkeypatch.setattr(f8.Fp8GroupedMMv3, "apply", lambda *a: seen.append("v3") or a[0].new_zeros(1))
    monkeypatch.setattr(f8.Fp8GroupedMM, "apply", lambda *a: seen.append(f"v{1 + a[4]}") or a[0].new_zeros(1))
    x, param, offs = make_case([2, 3], 8, 8, torch.float32, device="cpu")
    f8.grouped_mm(x, param.transpose(1, 2), offs)
    f8.grouped_mm(x, param.transpose(1, 2), offs, v2=False)
    monkeypatch.setenv(f8.V3_ENV, "0")
    f8.grouped_mm(x, param.transpose(1, 2), offs)
    monkeypatch.setenv(f8.V3_ENV, "1")
    monkeypatch.setenv(f8.V2_ENV, "0")
    f8.grouped_mm(x, param.transpose(1, 2), offs)
    assert seen == ["v3", "v1", "v2", "v1"]
    monkeypatch.setenv(f8.V2_ENV, "yes")
    with pytest.raises(ValueError, match="MOESTACK_FP8_V2='yes'"):
        f8.grouped_mm(x, param.transpose(1, 2), offs)


# ---------------------------------------------------------------------------------------------------------------
# GPU

FP8_RMS = 0.05  # e4m3 on both operands: ~2.5-3% relative RMS per operand, ~4% on a product of random data
# A whole layer (gate/up GEMM -> GLU -> down GEMM, both operands of each in e4m3) vs the bf16 layer: the exact FP8
# recipe emulated in torch on CPU (correct fp8 casts) gives 6.3-6.4% on the output and on every gradient at
# test_v3_layer_gpu's shapes, which is what the GPU measured (6.3%): the old bound (5% on the output) was too tight.
FP8_LAYER = 0.1
GPU_V3_CASES = [
    # counts kind, E, D, F, cublas_min_rows (0: the cuBLAS path wherever the probe accepts it), TMA kernel
    ("uniform600", 8, 1024, 1536, 0, False),
    ("odd", 7, 3584, 1024, 0, False),
    ("skew", 16, 2048, 512, 0, False),
    ("uniform64", 32, 1024, 1000, 10**9, False),  # Triton path (swap-AB), F not a multiple of 128
    ("uniform600", 8, 1024, 1536, 10**9, True),  # fp8_tma.py (forward / dX tokens on M, BT 64 / 128; dW)
    ("uniform64", 32, 1024, 1000, 10**9, True),  # fp8_tma.py at BT_MAX 64, F % 128 != 0
    ("uniform16", 56, 512, 1024, 10**9, True),  # fp8_tma.py swap-AB (BT 16)
]  # the Triton path at many rows (persistent kernel) runs in test_v3_layer_gpu


def gpu_counts(kind: str, E: int) -> list[int]:
    g = torch.Generator().manual_seed(E)
    if kind.startswith("uniform"):
        return [int(kind[len("uniform"):])] * E
    if kind == "skew":
        return [3001] + [0] * (E - 3) + [5, 1]
    return [int(v) for v in torch.randint(0, 700, (E,), generator=g)] + [0]


@pytest.mark.gpu
def test_quantize_dual_gpu():
    counts = gpu_counts("odd", 7)
    x, param, offs = make_case(counts, 3584, 512, torch.bfloat16, seed=4, tail=5)
    used = sum(counts)
    n_tiles = sum((c + 127) // 128 for c in counts)
    qr, sr = fq.quantize_rows_ref(x)
    qTr, sTr = fq.quantize_token_tiles_ref(x, offs)
    for em in (False, True):
        q, s, qT, sT = fq.quantize_dual(x, offs, expert_major=em)
        assert_fp8_near(q[:used], qr[:used])
        s_ref = fq.expert_major_scales_ref(sr, offs) if em else sr[:used]
        assert rel_err(s if em else s[:used], s_ref) < 1e-6
        assert rel_err(sT[:n_tiles], sTr[:n_tiles]) < 1e-6
        assert_fp8_near(qT[:, :n_tiles * 128], qTr[:, :n_tiles * 128])
    w = param.transpose(1, 2)
    (q, s), (qT, sT) = fq.quantize_blocks_pair(w)
    for (a, sa), (b, sb) in (((q, s), fq.quantize_blocks_ref(w)), ((qT, sT), fq.quantize_blocks_ref(param))):
        assert rel_err(sa, sb) < 1e-6 and (a.float() != b.float()).float().mean() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind,E,D,F,min_rows,tma", GPU_V3_CASES)
def test_v3_gpu(kind, E, D, F, min_rows, tma, monkeypatch):
    """v3 against the fp32 loop (fp8 error bounds) and against v2 (the same recipe: close to each other)."""
    monkeypatch.setenv(f8.TMA_ENV, "1" if tma else "0")
    monkeypatch.setenv(f8.TMA_WGRAD_ENV, "1" if tma else "0")
    wc.clear()
    counts = gpu_counts(kind, E)
    x, param, offs = make_case(counts, D, F, torch.bfloat16, seed=E + F, tail=5)
    used = sum(counts)
    dy = torch.randn(x.shape[0], F, device=DEV, dtype=torch.bfloat16)
    outs = {}
    for name in ("v2", "v3"):
        p = param.clone().requires_grad_(True)
        xg = x.clone().requires_grad_(True)
        y = f8.grouped_mm(xg, p.transpose(1, 2), offs, v2=True, v3=name == "v3", cublas_min_rows=min_rows)
        dx, dp = torch.autograd.grad(y, (xg, p), dy)
        outs[name] = (y, dx, dp)
        assert (y[used:] == 0).all() and (dp[torch.tensor(counts) == 0] == 0).all()
    xr, pr = x.float().requires_grad_(True), param.float().requires_grad_(True)
    y_ref = grouped_mm_loop(xr, pr.transpose(1, 2), offs)
    dxr, dpr = torch.autograd.grad(y_ref, (xr, pr), dy.float())
    y, dx, dp = outs["v3"]
    errs = {"y": rel_err(y[:used], y_ref[:used]), "dx": rel_err(dx[:used], dxr[:used]), "dw": rel_err(dp, dpr)}
    agree = [rel_err(a[:used] if i < 2 else a, b[:used] if i < 2 else b)
             for i, (a, b) in enumerate(zip(outs["v3"], outs["v2"]))]
    cublas = min_rows == 0 and fsm.shapes_ok(D, F) and fsm.available(x.device)
    print(f"MOE_FP8_V3 {kind} E={E} D={D} F={F} cublas={cublas} tma={tma}: vs fp32 {errs}, vs v2 {agree}")
    assert all(e < FP8_RMS for e in errs.values()), errs
    assert all(e < 1e-2 for e in agree), agree
    wc.clear()


@pytest.mark.gpu
def test_v3_no_sync_on_triton_path():
    """Below the cuBLAS threshold v3 keeps the no-host-sync property of v2 (the cuBLAS path reads offs once)."""
    wc.clear()
    counts = gpu_counts("uniform64", 32)
    x, param, offs = make_case(counts, 1024, 1024, torch.bfloat16, seed=1)
    p = param.clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    f8.grouped_mm(xg, p.transpose(1, 2), offs, v2=True, v3=True, cublas_min_rows=10**9).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = f8.grouped_mm(xg, p.transpose(1, 2), offs, v2=True, v3=True, cublas_min_rows=10**9)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    wc.clear()


def test_scaled_mm_wgrad_single_tile_bf16_fallback(monkeypatch):
    """An expert with one token tile makes torch read the scales as rowwise; if fp32 output is refused there,
    wgrad computes that expert in bf16 and copies (the others stay fp32)."""
    if DEV == "cuda":
        pytest.skip("emulation case")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    monkeypatch.setitem(fsm._state, "rowwise_fp32", False)
    counts = [100, 0, 140]
    x, param, offs = make_case(counts, 128, 256, torch.float32, seed=5)
    dy = torch.randn(x.shape[0], 256, generator=torch.Generator().manual_seed(6))
    _, _, qxT, sx = fq.quantize_dual(x, offs, torch.float32)
    _, _, qdyT, sdy = fq.quantize_dual(dy, offs, torch.float32)
    dw = fsm.wgrad(qxT, sx, qdyT, sdy, offs.tolist(), like=param.transpose(1, 2))
    starts = [0, 100, 100]
    for e, c in enumerate(counts):
        want = x[starts[e]:starts[e] + c].double().t() @ dy[starts[e]:starts[e] + c].double()
        if c == 0:
            assert (dw[e] == 0).all()
        elif e == 0:  # one tile: through bf16 (rounded, so not exact)
            assert 1e-5 < rel_err(dw[e], want) < 1e-2
        else:
            assert rel_err(dw[e], want) < 1e-6


def test_wgrad_streams_env(monkeypatch):
    monkeypatch.setenv(fsm.WGRAD_STREAMS_ENV, "3")
    with pytest.raises(ValueError, match="MOESTACK_FP8_WGRAD_STREAMS"):
        fsm.wgrad_streams()
    monkeypatch.setenv(fsm.WGRAD_STREAMS_ENV, "2")
    assert fsm.wgrad_streams() == 2


@pytest.mark.gpu
def test_scaled_mm_wgrad_two_streams_gpu(monkeypatch):
    """Every other expert's weight gradient on a side stream: bitwise the one-stream result (each GEMM is the same
    cuBLAS call on the same operands), with empty experts in between and the outputs read right after the call on
    the current stream (which must have waited for the side stream)."""
    if not fsm.available(torch.device(DEV)):
        pytest.skip("needs the cuBLAS blockwise path")
    counts = [2341, 0, 700, 1, 1300, 0, 0, 2048, 129]
    x, param, offs = make_case(counts, 1024, 768, torch.bfloat16, seed=11)
    dy = torch.randn(x.shape[0], 768, device=DEV, dtype=torch.bfloat16)
    _, _, qxT, sx = fq.quantize_dual(x, offs, expert_major=True)
    _, _, qdyT, sdy = fq.quantize_dual(dy, offs, expert_major=True)
    out = {}
    for streams in ("1", "2"):
        monkeypatch.setenv(fsm.WGRAD_STREAMS_ENV, streams)
        dw = fsm.wgrad(qxT, sx, qdyT, sdy, offs.tolist(), like=param.transpose(1, 2))
        out[streams] = dw.clone()  # on the current stream: ordered after the side stream's GEMMs
    assert torch.equal(out["1"], out["2"])
    assert out["1"][0].abs().max() > 0 and (out["1"][1] == 0).all()


def test_fp8_tma_interpreter():
    """fp8_tma.py directly (forward and the dX layout) with unrounded fp32 "q", against the fp64 loop; then v3's
    Triton path with MOESTACK_FP8_TMA=1 forward and backward."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_v3_gpu with MOESTACK_FP8_TMA=1")
    from moestack.ops.moe import fp8_tma

    for counts in ([0, 37, 3, 0, 20], [0, 137, 3, 0, 90]):  # mean rows 12 (swap-AB), 46 (tokens on M)
        x, param, offs = make_case(counts, 200, 48, torch.float32, seed=12, tail=2)
        used = sum(counts)
        w = param.transpose(1, 2)  # [E, K=200, F=48]
        (qw, sw), (qwT, swT) = fq.quantize_blocks_pair(w, torch.float32)
        qx, sx, _, _ = fq.quantize_dual(x, offs, torch.float32, tiles=False)
        assert fp8_tma.supported(qx, qw)
        y = fp8_tma.grouped_mm(qx, sx, qw, sw, offs, torch.float32)
        y_ref = grouped_mm_loop(x.double(), w.double(), offs)
        assert rel_err(y[:used], y_ref[:used]) < 1e-5 and (y[used:] == 0).all()
        dy = torch.randn(x.shape[0], 48, generator=torch.Generator().manual_seed(13))
        qdy, sdy, _, _ = fq.quantize_dual(dy, offs, torch.float32, tiles=False)
        assert fp8_tma.supported(qdy, qwT)
        dx = fp8_tma.grouped_mm(qdy, sdy, qwT, swT, offs, torch.float32)
        dx_ref = grouped_mm_loop(dy.double(), w.double().transpose(1, 2), offs)
        assert rel_err(dx[:used], dx_ref[:used]) < 1e-5 and (dx[used:] == 0).all()


def test_fp8_tma_wgrad_interpreter():
    """fp8_tma.wgrad in both gradient layouts against the fp64 per-expert products (unrounded fp32 "q"); an
    expert with several token tiles, empty experts, tail rows."""
    if DEV == "cuda":
        pytest.skip("interpreter case")
    from moestack.ops.moe import fp8_tma

    counts = [0, 140, 3, 0, 20]
    x, param, offs = make_case(counts, 48, 40, torch.float32, seed=16, tail=2)
    dy = torch.randn(x.shape[0], 40, generator=torch.Generator().manual_seed(17))
    _, _, qxT, sx = fq.quantize_dual(x, offs, torch.float32)
    _, _, qdyT, sdy = fq.quantize_dual(dy, offs, torch.float32)
    assert fp8_tma.wgrad_supported(qxT, qdyT)
    starts = [0, *offs[:-1].tolist()]
    ref = torch.stack([x[a:b].double().t() @ dy[a:b].double() for a, b in zip(starts, offs.tolist())])
    for like in (param.transpose(1, 2), param.transpose(1, 2).contiguous()):
        dw = fp8_tma.wgrad(qxT, sx, qdyT, sdy, offs, like)
        assert dw.stride() == like.stride() and rel_err(dw, ref) < 1e-5
        assert (dw[torch.tensor(counts) == 0] == 0).all()


def test_v3_tma_path_interpreter(monkeypatch):
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_v3_gpu with MOESTACK_FP8_TMA=1")
    monkeypatch.setenv(f8.TMA_ENV, "1")
    monkeypatch.setenv(f8.TMA_WGRAD_ENV, "1")
    from moestack.ops.moe import fp8_tma

    taken = []
    orig, orig_wg = fp8_tma.grouped_mm, fp8_tma.wgrad
    monkeypatch.setattr(fp8_tma, "grouped_mm", lambda *a: (taken.append("mm"), orig(*a))[1])
    monkeypatch.setattr(fp8_tma, "wgrad", lambda *a: (taken.append("wgrad"), orig_wg(*a))[1])
    _v3_vs_loop([20, 0, 9, 3], 136, 48, min_rows=10**9, seed=14)
    assert taken == ["mm", "mm", "wgrad"]  # forward, dX, dW


@pytest.mark.gpu
@pytest.mark.parametrize("min_rows,tma", [(0, False), (10**9, True), (10**9, False)])
def test_v3_layer_gpu(min_rows, tma, monkeypatch):
    """A LatentMoE layer as the trainer runs it (fp32 parameters, bf16 autocast) with the fp8 backend v3 against
    the same layer on torch's bf16 grouped GEMM: output and every gradient within FP8 error, across two
    optimizer-like updates (the fp8 weight cache must follow the parameters)."""
    from moestack.config.model_spec import MoESpec
    from moestack.model.moe import MoE

    monkeypatch.setenv(f8.TMA_ENV, "1" if tma else "0")
    monkeypatch.setenv(f8.TMA_WGRAD_ENV, "1" if tma else "0")
    monkeypatch.setenv("MOESTACK_FP8_CUBLAS_MIN_ROWS", str(min_rows))
    wc.clear()
    torch.manual_seed(0)
    spec = MoESpec(num_experts=16, top_k=4, expert_intermediate_size=512, latent_size=512)
    m = MoE(1024, spec, "situ_glu").to(DEV)
    m.init_weights(0.02)
    x = torch.randn(2, 1024, 1024, device=DEV)  # 512 rows per expert on average
    g = torch.randn(2, 1024, 1024, device=DEV)
    params = [p for p in m.parameters() if p.requires_grad]
    for step in range(2):
        outs = {}
        for backend in ("torch", "fp8"):
            m.experts.backend = backend
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(x)
            grads = torch.autograd.grad((out.float() * g).sum(), params, allow_unused=True)
            outs[backend] = (out, grads)
        errs = [rel_err(outs["fp8"][0], outs["torch"][0])]
        errs += [rel_err(a, b) for a, b in zip(outs["fp8"][1], outs["torch"][1]) if b is not None]
        print(f"MOE_FP8_V3_LAYER step {step} min_rows={min_rows} tma={tma}: out {errs[0]:.3g}, "
              f"worst grad {max(errs[1:]):.3g}")
        assert max(errs) < FP8_LAYER, errs
        with torch.no_grad():  # an optimizer-like in-place update: the next step must see the new weights
            for p in params:
                p.mul_(0.9).add_(0.002 * torch.randn_like(p))
    m.experts.backend = None
    wc.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_quantize_blocks_pair_gpu(w_dtype):
    """Both weight layouts against the torch spec at the proxy's expert shapes, from fp32 weights (the trainer's
    parameters; the fused transposed store gave a wrong w^T from fp32 on the H200, so fp32 goes through
    quantize_blocks and a byte transpose, checked bitwise against torch's) and from bf16."""
    g = torch.Generator().manual_seed(5)
    for E, F, D in ((128, 1280, 768), (128, 768, 640), (56, 1024, 1024)):
        param = torch.randn(E, F, D, generator=g).mul(0.02).to(DEV, w_dtype)  # Experts' layout
        w = param.transpose(1, 2)
        (q, s), (qT, sT) = fq.quantize_blocks_pair(w)
        assert torch.equal(qT.view(torch.uint8), q.view(torch.uint8).transpose(1, 2)), (E, F, D, w_dtype)
        for (a, sa), ref in (((q, s), w), ((qT, sT), param)):
            qr, sr = fq.quantize_blocks_ref(ref)
            assert rel_err(sa, sr) < 1e-6, (E, F, D, w_dtype)
            assert (a.float() != qr.float()).float().mean() < 1e-3, (E, F, D, w_dtype)
            assert rel_err(fq.dequantize_blocks(a, sa), ref.float()) < 0.05, (E, F, D, w_dtype)
        for ref in (w, param):  # the single-layout quantiser (v2) from both views
            (a, sa), (qr, sr) = fq.quantize_blocks(ref), fq.quantize_blocks_ref(ref)
            assert rel_err(sa, sr) < 1e-6 and (a.float() != qr.float()).float().mean() < 1e-3, (E, F, D, w_dtype)
            assert a.stride(1) == 1


@pytest.mark.gpu
def test_quantize_dual_many_experts_gpu():
    """quantize_dual at the proxy's expert count (E = 128: BE = 128 at 16 warps; the other GPU cases have E <= 56)
    and widths (768, 640), with empty, one-row, one-tile and multi-tile experts, against the torch spec."""
    g = torch.Generator().manual_seed(0)
    counts = [0] * 20 + [1, 3, 127, 128, 129, 255, 256, 257]
    counts += [int(v) for v in torch.randint(0, 900, (100,), generator=g)]
    offs = offs_from_counts(counts)
    used, n_tiles = sum(counts), sum((c + 127) // 128 for c in counts)
    for K in (768, 640):
        x = torch.randn(used + 5, K, generator=g).to(DEV, torch.bfloat16)
        qr, sr = fq.quantize_rows_ref(x)
        qTr, sTr = fq.quantize_token_tiles_ref(x, offs)
        q, s, qT, sT = fq.quantize_dual(x, offs)
        assert torch.isfinite(s[:used]).all() and torch.isfinite(sT[:n_tiles]).all()
        assert rel_err(s[:used], sr[:used]) < 1e-6 and rel_err(sT[:n_tiles], sTr[:n_tiles]) < 1e-6
        assert_fp8_near(q[:used], qr[:used])
        assert_fp8_near(qT[:, :n_tiles * 128], qTr[:, :n_tiles * 128])


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad_min_rows", ["default", "triton"])
def test_v3_proxy_layer_steps_gpu(wgrad_min_rows, monkeypatch):
    """Issue #7 at the proxy's MoE shapes: 128 experts, latent 768, inter 640, top-16, 4096 tokens = 65536 rows =
    512 per expert, so at the default thresholds forward / dX run on Triton (768 is not a multiple of 512) and dW
    on per-expert cuBLAS ("triton": dW on Triton too). fp32 parameters, bf16 autocast and the trainer's optimizer
    (fused AdamW on CUDA, which does not bump parameter versions) for 6 steps, following the fp8 gradients. Every
    step: v3's output and gradients finite and within the layer bound of the bf16 layer at the same, live weights
    (a stale fp8 weight cache fails from step 1)."""
    from moestack.config.model_spec import MoESpec
    from moestack.model.moe import MoE

    if wgrad_min_rows == "triton":
        monkeypatch.setenv("MOESTACK_FP8_CUBLAS_WGRAD_MIN_ROWS", str(10**9))
    monkeypatch.setenv(f8.V3_ENV, "1")
    wc.clear()
    torch.manual_seed(0)
    spec = MoESpec(num_experts=128, top_k=16, expert_intermediate_size=640, latent_size=768)
    m = MoE(1536, spec, "situ_glu").to(DEV)
    m.init_weights(0.02)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for step in range(6):
        x = torch.randn(2, 2048, 1536, device=DEV)
        g = torch.randn(2, 2048, 1536, device=DEV)
        outs = {}
        for backend in ("torch", "fp8"):
            m.experts.backend = backend
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(x)
            outs[backend] = (out, torch.autograd.grad((out.float() * g).sum(), params, allow_unused=True))
        # ground truth: the same layer in fp32 (no autocast, the per-expert loop), so a failure says whether the
        # fp8 layer or the bf16 reference is off (they are only compared with each other below)
        m.experts.backend = "reference"
        out32 = m(x)
        outs["fp32"] = (out32, torch.autograd.grad((out32 * g).sum(), params, allow_unused=True))
        out8, grads8 = outs["fp8"]
        finite = [bool(torch.isfinite(t).all()) for t in (out8, *[t for t in grads8 if t is not None])]
        errs = [rel_err(out8, outs["torch"][0])]
        errs += [rel_err(a, b) for a, b in zip(grads8, outs["torch"][1]) if b is not None]
        vs32 = {k: [rel_err(outs[k][0], out32)] + [rel_err(a, b) for a, b in zip(outs[k][1], outs["fp32"][1])
                                                   if b is not None] for k in ("torch", "fp8")}
        names = ["out"] + [n for n, p in m.named_parameters() if p.requires_grad]
        counts = m.last_expert_counts
        print(f"MOE_FP8_V3_PROXY wgrad={wgrad_min_rows} step {step}: finite {all(finite)}, out {errs[0]:.3g}, "
              f"worst grad {max(errs[1:]):.3g}, rows/expert min {int(counts.min())} max {int(counts.max())}")
        for k, v in vs32.items():
            print(f"MOE_FP8_V3_PROXY step {step} {k} vs fp32: " + " ".join(f"{n}={e:.3g}" for n, e in zip(names, v)))
        assert all(finite), finite
        assert max(vs32["torch"]) < 0.03, ("bf16 reference off vs fp32", vs32["torch"])
        assert max(vs32["fp8"]) < FP8_LAYER, ("fp8 off vs fp32", vs32["fp8"])
        assert max(errs) < FP8_LAYER, errs
        for p, gr in zip(params, grads8):
            p.grad = gr
        opt.step()
        opt.zero_grad(set_to_none=True)
    m.experts.backend = None
    wc.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad_min_rows", ["default", "triton"])
def test_v3_proxy_gemms_gpu(wgrad_min_rows, monkeypatch):
    """The proxy layer's two expert GEMMs alone (E = 128, 435..579 rows per expert, x in bf16 under autocast, fp32
    parameters in Experts' layout): v3's y, dX and dW and the bf16 torch backend's against the fp32 loop. Localises
    a failure of test_v3_proxy_layer_steps_gpu to one GEMM, one output and one side."""
    from moestack.ops.moe import reference

    if wgrad_min_rows == "triton":
        monkeypatch.setenv("MOESTACK_FP8_CUBLAS_WGRAD_MIN_ROWS", str(10**9))
    g = torch.Generator().manual_seed(3)
    counts = [int(v) for v in torch.randint(435, 580, (128,), generator=g)]
    fails = []
    for D, F in ((768, 1280), (640, 768)):  # gate/up: latent -> 2 x inter; down: inter -> latent
        wc.clear()
        x, param, offs = make_case(counts, D, F, torch.float32, seed=D)
        param = param.mul(0.02 * D**0.5)  # init std 0.02, as the layer
        x = x.to(torch.bfloat16)
        dy = torch.randn(x.shape[0], F, generator=g).to(DEV, torch.bfloat16)
        xr, pr = x.float().requires_grad_(True), param.clone().requires_grad_(True)
        y_ref = grouped_mm_loop(xr, pr.transpose(1, 2), offs)
        ref = (y_ref, *torch.autograd.grad(y_ref, (xr, pr), dy.float()))
        for name in ("fp8v3", "torch"):
            xg, p = x.clone().requires_grad_(True), param.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if name == "fp8v3":
                    y = f8.grouped_mm(xg, p.transpose(1, 2), offs, v2=True, v3=True)
                else:
                    y = reference.grouped_mm(xg, p.transpose(1, 2), offs)
            got = (y, *torch.autograd.grad(y, (xg, p), dy))
            errs = {k: rel_err(a, b) for k, a, b in zip(("y", "dx", "dw"), got, ref)}
            print(f"MOE_FP8_V3_PROXY_GEMM wgrad={wgrad_min_rows} K={D} F={F} {name} vs fp32: {errs}")
            bound = FP8_RMS if name == "fp8v3" else 0.01
            fails += [(name, D, F, k, e) for k, e in errs.items() if not e < bound]
    wc.clear()
    assert not fails, fails


@pytest.mark.gpu
@pytest.mark.parametrize("rows_gemm", ["cublas", "gluon"])
def test_fp8_expert_ffn_gpu(rows_gemm, monkeypatch):
    """The fused FFN on the H200: bitwise equal to the unfused v3 pair (same fp8 operands, same GEMM calls) for the
    output and all three gradients, with an empty expert and odd counts; and within FP8's error of the fp32 FFN."""
    from moestack.model.mlp import glu_activation
    from moestack.ops.moe import fp8_expert_ffn as ffn
    from moestack.ops.moe import gluon_quant

    if not fsm.available(torch.device("cuda")) or not gluon_quant.supported(torch.cuda.current_device()):
        pytest.skip("sm_90 with the cuBLAS blockwise path")
    monkeypatch.setenv(f8.V3_ENV, "1")
    monkeypatch.setenv(f8.ROWS_GEMM_ENV, rows_gemm)
    counts, D, inter = [700, 0, 1301, 515, 903], 1024, 512
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(counts) + 3, D, generator=g).to("cuda", torch.bfloat16)
    w_gu = (torch.randn(len(counts), 2 * inter, D, generator=g) / D**0.5).cuda().requires_grad_(True)
    w_down = (torch.randn(len(counts), D, inter, generator=g) / inter**0.5).cuda().requires_grad_(True)
    offs = offs_from_counts(counts)
    dy = torch.randn(x.shape, generator=g).to("cuda", torch.bfloat16)
    used = sum(counts)
    outs = []
    for fused in ("1", "0"):
        monkeypatch.setenv(ffn.ENV, fused)
        wc.clear()
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the compute dtype the fp8 backend takes x to
            y = ffn.expert_ffn(xg, w_gu.transpose(1, 2), w_down.transpose(1, 2), offs, "situ_glu", 4.0, 25.0)
            if fused == "0":
                assert y is None
                y = _ffn_unfused(xg, w_gu, w_down, offs, "situ_glu", fq.FP8)
        assert y.dtype == torch.bfloat16
        outs.append((y[:used], *torch.autograd.grad(y, (xg, w_gu, w_down), dy)))
    for name, got, want in zip(("y", "dx", "dw_gate_up", "dw_down"), *outs):
        got, want = (got[:used], want[:used]) if name == "dx" else (got, want)
        assert torch.equal(got, want), (name, rel_err(got, want))
    xr = x.float().requires_grad_(True)
    wg, wd = w_gu.detach().clone().requires_grad_(True), w_down.detach().clone().requires_grad_(True)
    gu = grouped_mm_loop(xr, wg.transpose(1, 2), offs)
    y_ref = grouped_mm_loop(glu_activation(gu[:, :inter], gu[:, inter:], "situ_glu"), wd.transpose(1, 2), offs)
    refs = (y_ref[:used], *torch.autograd.grad(y_ref, (xr, wg, wd), dy.float()))
    for name, got, ref in zip(("y", "dx", "dw_gate_up", "dw_down"), outs[0], refs):
        got, ref = (got[:used], ref[:used]) if name == "dx" else (got, ref)
        assert rel_err(got, ref) < 8e-2, (name, rel_err(got, ref))
    wc.clear()
