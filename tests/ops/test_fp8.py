"""FP8 (moestack/ops/fp8): the quantisation spec, the Triton quantisers, the weight cache, the expert GEMMs (Triton
and per-expert cuBLAS), the strategy the recipe installs.

CPU: the spec against plain loops (torch); Triton kernels in the interpreter with unrounded fp32 "q" (the
interpreter rounds fp8 casts wrongly), so the tiling, scale layouts and GEMM schedules are checked exactly against
fp64 loops; the per-expert cuBLAS path runs through an emulation of torch._scaled_mm that asserts the shapes and
strides torch's blockwise recipes take (outer-dim-major 1x128 scales with leading dim = rows, 128x128 scales
K-block-major, row-major a, column-major b, rows a multiple of 4) and computes the dequantised product in fp32.
GPU (`-m gpu`): fp8 rounding against the torch spec, the GEMMs against the fp32 loop and the recipe's spec at real
shapes, the cuBLAS path included where the probe accepts it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are decorated
pytest.importorskip("triton")

from moestack.ops.fp8 import grouped_gemm as f8  # noqa: E402
from moestack.ops.fp8 import quant as fq  # noqa: E402
from moestack.ops.fp8 import reference as fref  # noqa: E402
from moestack.ops.fp8 import scaled_mm as fsm  # noqa: E402
from moestack.ops.fp8 import weight_cache as wc  # noqa: E402
from moestack.ops.moe.reference import grouped_mm_loop  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _grouped import DEV, offs_from_counts, rel_err  # noqa: E402


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
# the spec (torch) against plain loops

E4M3_REL = 2.0**-4  # round to nearest, 3 mantissa bits, normal range


def _plain_scale(vals: list[float]) -> float:
    amax = max(abs(v) for v in vals)
    return amax / 448.0 if amax > 0 else 1.0


def _check_roundtrip(x, deq, scale_of):
    """Each element within e4m3's relative step of the original, or within the subnormal step of its group."""
    err = (deq - x.float()).abs()
    bound = E4M3_REL * x.float().abs() + scale_of * 2.0**-9
    assert (err <= bound * 1.0001).all()


def test_quantize_rows_ref_against_plain_loop():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=g) * torch.logspace(-3, 2, 300)
    x[2, 128:256] = 0.0  # an all-zero group: scale 1, zeros out
    q, s = fref.quantize_rows_ref(x)
    assert q.dtype == fref.FP8 and s.shape == (5, 3)
    for n in range(5):
        for kb in range(3):
            vals = x[n, kb * 128:(kb + 1) * 128].tolist()
            assert s[n, kb].item() == pytest.approx(_plain_scale(vals), rel=1e-6)
    deq = fref.dequantize_rows(q, s)
    _check_roundtrip(x, deq, s.repeat_interleave(128, 1)[:, :300])
    assert (deq[2, 128:256] == 0).all()
    assert deq.abs().max() <= x.abs().max() * (1 + 1e-6)


def test_quantize_blocks_ref_against_plain_loop():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 200, 150, generator=g).transpose(1, 2)  # [E, K=150, F=200] strided view
    q, s = fref.quantize_blocks_ref(w)
    assert s.shape == (2, 2, 2)
    for e in range(2):
        for kb in range(2):
            for fb in range(2):
                vals = w[e, kb * 128:(kb + 1) * 128, fb * 128:(fb + 1) * 128].flatten().tolist()
                assert s[e, kb, fb].item() == pytest.approx(_plain_scale(vals), rel=1e-6)
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :150, :200]
    _check_roundtrip(w, fref.dequantize_blocks(q, s), full)
    # the transposed weight quantises to the transposed blocks: dgrad reuses forward's values exactly
    qt, st = fref.quantize_blocks_ref(w.transpose(1, 2))
    assert torch.equal(st, s.transpose(1, 2)) and torch.equal(qt.float(), q.float().transpose(1, 2))


def test_quantize_token_tiles_ref_against_plain_loop():
    counts = [130, 0, 5, 256]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(counts) + 2, 70, generator=g)
    offs = offs_from_counts(counts, "cpu")
    qT, s = fref.quantize_token_tiles_ref(x, offs)
    assert qT.shape == (70, fref.num_token_tiles(x.shape[0], 4) * 128)
    # expert tiles: e0 rows 0:128, 128:130; e2 rows 130:135; e3 rows 135:263, 263:391
    tiles = [(0, 128), (128, 130), (130, 135), (135, 263), (263, 391)]
    for gi, (a, b) in enumerate(tiles):
        for d in (0, 33, 69):
            assert s[gi, d].item() == pytest.approx(_plain_scale(x[a:b, d].tolist()), rel=1e-6)
        deq = qT[:, gi * 128:gi * 128 + (b - a)].float().t() * s[gi]
        _check_roundtrip(x[a:b], deq, s[gi].expand(b - a, -1))
        assert (qT[:, gi * 128 + (b - a):(gi + 1) * 128].float() == 0).all(), "tile padding is zero"


# ---------------------------------------------------------------------------------------------------------------
# quantisers (interpreter, fp32 "q")


def test_quantize_rows_and_blocks_kernels_interpreter():
    """The Triton quantize_rows / quantize_blocks with unrounded fp32 "q" against the spec (tiling, scale
    indexing)."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_quantize_dual_gpu / test_quantize_blocks_pair_gpu")
    x, param, _ = make_case([40, 0, 131, 3], 136, 144, torch.float32, seed=9, tail=2)
    w = param.transpose(1, 2)
    for (q, s), (qr, sr) in [
        (fq.quantize_rows(x, torch.float32), fref.quantize_rows_ref(x, torch.float32)),
        (fq.quantize_blocks(w, torch.float32), fref.quantize_blocks_ref(w, torch.float32)),
    ]:
        assert rel_err(s, sr) < 1e-6 and rel_err(q, qr) < 1e-6


def test_quantize_dual_interpreter():
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_quantize_dual_gpu")
    counts = [40, 0, 131, 3, 0]
    x, _, offs = make_case(counts, 200, 8, torch.float32, seed=1, tail=3)
    x[5, 128:200] = 0.0  # an all-zero row group: scale 1
    N = x.shape[0]
    used = sum(counts)
    qr, sr = fref.quantize_rows_ref(x, torch.float32)
    qTr, sTr = fref.quantize_token_tiles_ref(x, offs, torch.float32)
    n_tiles = sum((c + 127) // 128 for c in counts)
    for expert_major in (False, True):
        q, s, qT, sT = fq.quantize_dual(x, offs, torch.float32, expert_major=expert_major)
        assert q.shape == (N, 200) and q._base.shape == (N + 3, 200) and (q._base[N:] == 0).all()
        assert rel_err(q[:used], qr[:used]) < 1e-6
        if expert_major:
            assert torch.equal(s, fref.expert_major_scales_ref(sr, offs))
        else:
            assert rel_err(s[:used], sr[:used]) < 1e-6
        assert rel_err(sT[:n_tiles], sTr[:n_tiles]) < 1e-6
        assert rel_err(qT[:, :n_tiles * 128], qTr[:, :n_tiles * 128]) < 1e-6
    q2, _, qT2, sT2 = fq.quantize_dual(x, offs, torch.float32, tiles=False)
    assert qT2 is None and sT2 is None and torch.equal(q2[:used], q[:used])


def test_expert_major_layout():
    base, mp = fref.expert_major_layout([5, 0, 8, 1])
    assert mp == [8, 0, 8, 4] and base == [0, 8, 8, 16]
    s = torch.arange(14 * 2, dtype=torch.float32).view(14, 2) + 1
    flat = fref.expert_major_scales_ref(s, torch.tensor([5, 5, 13, 14], dtype=torch.int32))
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
    qr, sr = fref.quantize_blocks_ref(w, torch.float32)
    qTr, sTr = fref.quantize_blocks_ref(w.transpose(1, 2), torch.float32)
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
    """quantize_blocks from an fp32 view whose F is contiguous goes through w^T's own layout."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_quantize_blocks_pair_gpu")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 140, 260, generator=g)  # [E, K, F], F contiguous
    q, s = fq.quantize_blocks(w, torch.float32)
    qr, sr = fref.quantize_blocks_ref(w, torch.float32)
    assert rel_err(q, qr) < 1e-6 and rel_err(s, sr) < 1e-6 and q.stride(1) == 1 and s.is_contiguous()


def test_weight_cache_pair_hits():
    if DEV == "cuda":
        pytest.skip("interpreter case")
    wc.clear()
    _, param, _ = make_case([1], 136, 130, torch.float32, seed=3)
    param.requires_grad_(True)
    w = param.transpose(1, 2)
    fwd, bwd = wc.pair(w, torch.float32)
    misses = wc.stats["misses"]
    again = wc.pair(param.transpose(1, 2), torch.float32)  # another view of the same parameter: both layouts hit
    assert again[0][0] is fwd[0] and again[1][0] is bwd[0] and wc.stats["misses"] == misses
    with torch.no_grad():
        param.mul_(2.0)
    fwd2, _ = wc.pair(w, torch.float32)
    assert wc.stats["misses"] == misses + 1 and rel_err(fwd2[1], 2 * fwd[1]) < 1e-6
    off = wc.pair(w, torch.float32, "off")  # mode "off": quantised on every call, nothing cached
    assert off[0][0] is not fwd2[0] and wc.stats["misses"] == misses + 1
    with pytest.raises(ValueError, match="fp8 weight cache mode 'always'.*kernels.fp8.weight_cache"):
        wc.pair(w, torch.float32, "always")
    wc.clear()


@pytest.mark.parametrize("mode", ["on", "step"])
def test_weight_cache_drops_freed_weights(mode):
    """FSDP2 frees a gathered weight after use by resizing its storage to 0 (and refills it at the next gather). By
    default the next miss drops such an entry, so the cache holds only what is gathered now; mode "step" keeps it
    until the optimizer step. peak_bytes is the most held at once."""
    if DEV == "cuda":
        pytest.skip("interpreter case")
    wc.clear()
    wc.stats["peak_bytes"] = 0
    layers = [torch.nn.Parameter(make_case([1], 136, 130, torch.float32, seed=s)[1]) for s in (5, 6)]
    values = [p.detach().clone() for p in layers]
    one = sum(t.nbytes for layout in wc.pair(layers[0].transpose(1, 2), torch.float32, mode) for t in layout)
    layers[0].untyped_storage().resize_(0)  # layer 0 resharded
    wc.pair(layers[1].transpose(1, 2), torch.float32, mode)  # a miss: the purge runs
    assert len(wc._entries) == (2 if mode == "on" else 4)
    assert wc.stats["peak_bytes"] == (one if mode == "on" else 2 * one)
    layers[0].untyped_storage().resize_(values[0].nbytes)  # gathered again, same values (same optimizer step)
    layers[0].data.copy_(values[0])  # as FSDP's copy-out: through another tensor, no version bump
    misses = wc.stats["misses"]
    (q, s), _ = wc.pair(layers[0].transpose(1, 2), torch.float32, mode)
    assert wc.stats["misses"] == misses + (mode == "on")
    want = fref.quantize_blocks_ref(values[0].transpose(1, 2), torch.float32)
    assert rel_err(fref.dequantize_blocks(q, s), fref.dequantize_blocks(*want)) < 1e-6
    wc.clear()


@pytest.mark.parametrize("opt_kw", [{"fused": True}, {"foreach": True}])
def test_weight_cache_follows_optimizer_step(opt_kw):
    """Issue #7: the trainer's fused AdamW (torch._fused_adamw_) updates the parameters without bumping their
    version counter, so a version-keyed cache served the step-0 fp8 weights for the whole run (frozen expert
    weights in the forward). After optimizer.step() both cached layouts and the GEMM must follow the new
    weights."""
    wc.clear()
    counts = [5, 0, 9]
    x, param, offs = make_case(counts, 136, 40, torch.float32, seed=21)
    param = torch.nn.Parameter(param)
    w = param.transpose(1, 2)
    opt = torch.optim.AdamW([param], lr=0.1, **opt_kw)
    wc.pair(w, torch.float32)
    param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(22)).to(param.device)
    opt.step()
    assert rel_err(param.detach(), make_case(counts, 136, 40, torch.float32, seed=21)[1]) > 1e-2  # it moved
    (q, s), (qT, sT) = wc.pair(w, torch.float32)
    for got, want in (((q, s), fref.quantize_blocks_ref(w.detach(), torch.float32)),
                      ((qT, sT), fref.quantize_blocks_ref(param.detach(), torch.float32))):
        assert rel_err(fref.dequantize_blocks(*got), fref.dequantize_blocks(*want)) < 1e-6
    y = f8.Fp8GroupedMM.apply(x, w, offs, torch.float32, 10**9)
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
# expert GEMMs (interpreter / emulation)


def _gemm_vs_loop(counts, D, F, min_rows, seed, tail=2):
    wc.clear()
    x, param, offs = make_case(counts, D, F, torch.float32, seed=seed, tail=tail)
    param.requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = f8.Fp8GroupedMM.apply(xg, param.transpose(1, 2), offs, torch.float32, min_rows)
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


def test_triton_path_interpreter():
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_gemm_gpu")
    _gemm_vs_loop([40, 0, 131, 3], 136, 80, min_rows=10**9, seed=7)  # the non-swapped kernel (mean rows > 64)
    _gemm_vs_loop([9, 0, 20, 3], 136, 80, min_rows=10**9, seed=8)  # swap-AB


def test_scaled_mm_path_emulated(monkeypatch):
    """The per-expert cuBLAS path with an emulated torch._scaled_mm that enforces its layout rules: expert-major
    scales, rows rounded up to 4 (odd counts), empty experts, an expert of one row, tail rows past offs[-1]."""
    if DEV == "cuda":
        pytest.skip("emulation case; the GPU runs the real call in test_gemm_gpu")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    calls = []
    monkeypatch.setattr(fsm, "_scaled_mm_into", lambda *a: (calls.append(a[0].shape), emulated_scaled_mm(
        *a[:4], a[4].dtype, a[4]))[1])
    _gemm_vs_loop([37, 0, 130, 1, 6], 512, 512, min_rows=0, seed=9)
    assert len(calls) == 3 * 4  # forward, dX, dW: one call per non-empty expert
    assert calls[0] == (40, 512)  # 37 rows read as 40


def test_cublas_wgrad_only_emulated(monkeypatch):
    """Widths cuBLAS's 128x128 weight scales cannot take (not multiples of 512) but the weight gradient's token-tile
    GEMMs can (multiples of 16): forward / dX on Triton, dW per expert on the (emulated) cuBLAS path."""
    if DEV == "cuda":
        pytest.skip("emulation case")
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    calls = []
    orig = fsm.wgrad
    monkeypatch.setattr(fsm, "wgrad", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    monkeypatch.setattr(fsm, "rows_mm", lambda *a, **k: pytest.fail("forward / dX must stay on Triton"))
    _gemm_vs_loop([20, 0, 9, 131], 144, 80, min_rows=0, seed=15)
    assert calls == [1]


def test_host_offsets_cached():
    offs = torch.tensor([3, 5, 9], dtype=torch.int32)
    a = fsm.host_offsets(offs)
    assert a == [3, 5, 9] and fsm.host_offsets(offs) is a
    offs.add_(1)  # an in-place change is seen
    assert fsm.host_offsets(offs) == [4, 6, 10]


def test_strategy_is_the_recipe_gemm(monkeypatch):
    """Fp8GroupedGemm (what the recipe puts on Experts.gemm) calls grouped_mm with its choices and says it stores
    the inputs in FP8 itself (memory/apply.py then adds no storage of its own)."""
    seen = []
    monkeypatch.setattr(f8, "grouped_mm", lambda x, w, o, **kw: seen.append(kw) or x)
    s = f8.Fp8GroupedGemm("step", 64, torch.float32)
    x = torch.randn(3, 4)
    assert s(x, torch.randn(1, 4, 4), torch.tensor([3], dtype=torch.int32)) is x
    assert seen == [{"q_dtype": torch.float32, "cublas_min_rows": 64, "cache_mode": "step"}]
    assert s.saves_fp8_inputs


# ---------------------------------------------------------------------------------------------------------------
# GPU

FP8_RMS = 0.05  # e4m3 on both operands: ~2.5-3% relative RMS per operand, ~4% on a product of random data
# A whole layer (gate/up GEMM -> GLU -> down GEMM, both operands of each in e4m3) vs the bf16 layer: the exact FP8
# recipe emulated in torch on CPU (correct fp8 casts) gives 6.3-6.4% on the output and on every gradient at
# test_layer_gpu's shapes, which is what the GPU measured (6.3%): the old bound (5% on the output) was too tight.
FP8_LAYER = 0.1
GPU_CASES = [
    # counts kind, E, D, F, cublas_min_rows (0: the cuBLAS path wherever the probe accepts it)
    ("uniform600", 8, 1024, 1536, 0),
    ("odd", 7, 3584, 1024, 0),
    ("skew", 16, 2048, 512, 0),
    ("uniform64", 32, 1024, 1000, 10**9),  # Triton path (swap-AB), F not a multiple of 128
    ("uniform600", 8, 1024, 1536, 10**9),  # Triton path, the non-swapped kernel
    ("uniform16", 56, 512, 1024, 10**9),  # Triton swap-AB at BT 16
]


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
    qr, sr = fref.quantize_rows_ref(x)
    qTr, sTr = fref.quantize_token_tiles_ref(x, offs)
    for em in (False, True):
        q, s, qT, sT = fq.quantize_dual(x, offs, expert_major=em)
        assert_fp8_near(q[:used], qr[:used])
        s_ref = fref.expert_major_scales_ref(sr, offs) if em else sr[:used]
        assert rel_err(s if em else s[:used], s_ref) < 1e-6
        assert rel_err(sT[:n_tiles], sTr[:n_tiles]) < 1e-6
        assert_fp8_near(qT[:, :n_tiles * 128], qTr[:, :n_tiles * 128])
    w = param.transpose(1, 2)
    (q, s), (qT, sT) = fq.quantize_blocks_pair(w)
    for (a, sa), (b, sb) in (((q, s), fref.quantize_blocks_ref(w)), ((qT, sT), fref.quantize_blocks_ref(param))):
        assert rel_err(sa, sb) < 1e-6 and (a.float() != b.float()).float().mean() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind,E,D,F,min_rows", GPU_CASES)
def test_gemm_gpu(kind, E, D, F, min_rows):
    """The FP8 expert GEMM against the fp32 loop (fp8 error bounds) and its forward against the recipe's torch spec
    (reference.grouped_mm_fp8_reference: the same quantised operands, so close)."""
    wc.clear()
    counts = gpu_counts(kind, E)
    x, param, offs = make_case(counts, D, F, torch.bfloat16, seed=E + F, tail=5)
    used = sum(counts)
    dy = torch.randn(x.shape[0], F, device=DEV, dtype=torch.bfloat16)
    p = param.clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = f8.grouped_mm(xg, p.transpose(1, 2), offs, cublas_min_rows=min_rows)
    dx, dp = torch.autograd.grad(y, (xg, p), dy)
    assert (y[used:] == 0).all() and (dp[torch.tensor(counts) == 0] == 0).all()
    xr, pr = x.float().requires_grad_(True), param.float().requires_grad_(True)
    y_ref = grouped_mm_loop(xr, pr.transpose(1, 2), offs)
    dxr, dpr = torch.autograd.grad(y_ref, (xr, pr), dy.float())
    errs = {"y": rel_err(y[:used], y_ref[:used]), "dx": rel_err(dx[:used], dxr[:used]), "dw": rel_err(dp, dpr)}
    spec = fref.grouped_mm_fp8_reference(x, param.transpose(1, 2), offs)
    agree = rel_err(y[:used], spec[:used])
    cublas = min_rows == 0 and fsm.shapes_ok(D, F) and fsm.available(x.device)
    print(f"MOE_FP8 {kind} E={E} D={D} F={F} cublas={cublas}: vs fp32 {errs}, forward vs the spec {agree:.2e}")
    assert all(e < FP8_RMS for e in errs.values()), errs
    assert agree < 1e-2, agree
    wc.clear()


@pytest.mark.gpu
def test_no_sync_on_triton_path():
    """Below the cuBLAS threshold the GEMMs never read the offsets on the host (the cuBLAS path reads them once)."""
    wc.clear()
    counts = gpu_counts("uniform64", 32)
    x, param, offs = make_case(counts, 1024, 1024, torch.bfloat16, seed=1)
    p = param.clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    f8.grouped_mm(xg, p.transpose(1, 2), offs, cublas_min_rows=10**9).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = f8.grouped_mm(xg, p.transpose(1, 2), offs, cublas_min_rows=10**9)
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


@pytest.mark.gpu
def test_scaled_mm_wgrad_two_streams_gpu():
    """Every other expert's weight gradient on a side stream: each expert's dW equal to its own cuBLAS call on the
    current stream alone (bitwise: the same call on the same operands), with empty experts in between and the
    outputs read right after the call on the current stream (which must have waited for the side stream)."""
    if not fsm.available(torch.device(DEV)):
        pytest.skip("needs the cuBLAS blockwise path")
    counts = [2341, 0, 700, 1, 1300, 0, 0, 2048, 129]
    x, param, offs = make_case(counts, 1024, 768, torch.bfloat16, seed=11)
    dy = torch.randn(x.shape[0], 768, device=DEV, dtype=torch.bfloat16)
    _, _, qxT, sx = fq.quantize_dual(x, offs, expert_major=True)
    _, _, qdyT, sdy = fq.quantize_dual(dy, offs, expert_major=True)
    like = param.transpose(1, 2)
    dw = fsm.wgrad(qxT, sx, qdyT, sdy, offs.tolist(), like=like).clone()  # ordered after the side stream's GEMMs
    g0 = 0
    for e, c in enumerate(counts):
        g1 = g0 + (c + 127) // 128
        if c == 0:
            assert (dw[e] == 0).all()
            continue
        one = torch.empty_like(dw)
        fsm._expert_wgrad(qxT, sx, qdyT, sdy, one, e, g0, g1, like.transpose(1, 2).is_contiguous())
        assert torch.equal(dw[e], one[e]), e
        g0 = g1


@pytest.mark.gpu
@pytest.mark.parametrize("min_rows", [0, 10**9])
def test_layer_gpu(min_rows):
    """A LatentMoE layer as the trainer runs it (fp32 parameters, bf16 autocast) with the FP8 strategy against the
    same layer on torch's bf16 grouped GEMM: output and every gradient within FP8 error, across two
    optimizer-like updates (the fp8 weight cache must follow the parameters)."""
    from moestack.config.model_spec import MoESpec
    from moestack.model.moe import MoE
    from moestack.ops.moe import GroupedGemm

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
            m.experts.gemm = f8.Fp8GroupedGemm(cublas_min_rows=min_rows) if backend == "fp8" else GroupedGemm("torch")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(x)
            grads = torch.autograd.grad((out.float() * g).sum(), params, allow_unused=True)
            outs[backend] = (out, grads)
        errs = [rel_err(outs["fp8"][0], outs["torch"][0])]
        errs += [rel_err(a, b) for a, b in zip(outs["fp8"][1], outs["torch"][1]) if b is not None]
        print(f"MOE_FP8_LAYER step {step} min_rows={min_rows}: out {errs[0]:.3g}, "
              f"worst grad {max(errs[1:]):.3g}")
        assert max(errs) < FP8_LAYER, errs
        with torch.no_grad():  # an optimizer-like in-place update: the next step must see the new weights
            for p in params:
                p.mul_(0.9).add_(0.002 * torch.randn_like(p))
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
            qr, sr = fref.quantize_blocks_ref(ref)
            assert rel_err(sa, sr) < 1e-6, (E, F, D, w_dtype)
            assert (a.float() != qr.float()).float().mean() < 1e-3, (E, F, D, w_dtype)
            assert rel_err(fref.dequantize_blocks(a, sa), ref.float()) < 0.05, (E, F, D, w_dtype)
        for ref in (w, param):  # the single-layout quantiser from both views
            (a, sa), (qr, sr) = fq.quantize_blocks(ref), fref.quantize_blocks_ref(ref)
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
        qr, sr = fref.quantize_rows_ref(x)
        qTr, sTr = fref.quantize_token_tiles_ref(x, offs)
        q, s, qT, sT = fq.quantize_dual(x, offs)
        assert torch.isfinite(s[:used]).all() and torch.isfinite(sT[:n_tiles]).all()
        assert rel_err(s[:used], sr[:used]) < 1e-6 and rel_err(sT[:n_tiles], sTr[:n_tiles]) < 1e-6
        assert_fp8_near(q[:used], qr[:used])
        assert_fp8_near(qT[:, :n_tiles * 128], qTr[:, :n_tiles * 128])


@pytest.mark.gpu
@pytest.mark.parametrize("min_rows", [512, 10**9])
def test_proxy_layer_steps_gpu(min_rows):
    """Issue #7 at the proxy's MoE shapes: 128 experts, latent 768, inter 640, top-16, 4096 tokens = 65536 rows =
    512 per expert, so at the default threshold forward / dX run on Triton (768 is not a multiple of 512) and dW
    on per-expert cuBLAS (10**9: dW on Triton too). fp32 parameters, bf16 autocast and the trainer's optimizer
    (fused AdamW on CUDA, which does not bump parameter versions) for 6 steps, following the fp8 gradients. Every
    step: the FP8 layer's output and gradients finite and within the layer bound of the bf16 layer at the same, live
    weights (a stale fp8 weight cache fails from step 1)."""
    from moestack.config.model_spec import MoESpec
    from moestack.model.moe import MoE
    from moestack.ops.moe import GroupedGemm

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
            m.experts.gemm = f8.Fp8GroupedGemm(cublas_min_rows=min_rows) if backend == "fp8" else GroupedGemm("torch")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(x)
            outs[backend] = (out, torch.autograd.grad((out.float() * g).sum(), params, allow_unused=True))
        # ground truth: the same layer in fp32 (no autocast, the per-expert loop), so a failure says whether the
        # fp8 layer or the bf16 reference is off (they are only compared with each other below)
        m.experts.gemm = GroupedGemm("reference")
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
        print(f"MOE_FP8_PROXY min_rows={min_rows} step {step}: finite {all(finite)}, out {errs[0]:.3g}, "
              f"worst grad {max(errs[1:]):.3g}, rows/expert min {int(counts.min())} max {int(counts.max())}")
        for k, v in vs32.items():
            print(f"MOE_FP8_PROXY step {step} {k} vs fp32: " + " ".join(f"{n}={e:.3g}" for n, e in zip(names, v)))
        assert all(finite), finite
        assert max(vs32["torch"]) < 0.03, ("bf16 reference off vs fp32", vs32["torch"])
        assert max(vs32["fp8"]) < FP8_LAYER, ("fp8 off vs fp32", vs32["fp8"])
        assert max(errs) < FP8_LAYER, errs
        for p, gr in zip(params, grads8):
            p.grad = gr
        opt.step()
        opt.zero_grad(set_to_none=True)
    wc.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("min_rows", [512, 10**9])
def test_proxy_gemms_gpu(min_rows):
    """The proxy layer's two expert GEMMs alone (E = 128, 435..579 rows per expert, x in bf16 under autocast, fp32
    parameters in Experts' layout): the FP8 GEMM's y, dX and dW and the bf16 torch backend's against the fp32 loop.
    Localises a failure of test_proxy_layer_steps_gpu to one GEMM, one output and one side."""
    from moestack.ops.moe import reference

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
        for name in ("fp8", "torch"):
            xg, p = x.clone().requires_grad_(True), param.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if name == "fp8":
                    y = f8.grouped_mm(xg, p.transpose(1, 2), offs, cublas_min_rows=min_rows)
                else:
                    y = reference.grouped_mm(xg, p.transpose(1, 2), offs)
            got = (y, *torch.autograd.grad(y, (xg, p), dy))
            errs = {k: rel_err(a, b) for k, a, b in zip(("y", "dx", "dw"), got, ref)}
            print(f"MOE_FP8_PROXY_GEMM min_rows={min_rows} K={D} F={F} {name} vs fp32: {errs}")
            bound = FP8_RMS if name == "fp8" else 0.01
            fails += [(name, D, F, k, e) for k, e in errs.items() if not e < bound]
    wc.clear()
    assert not fails, fails


