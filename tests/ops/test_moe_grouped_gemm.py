"""Grouped GEMM backends against the per-expert loop: Triton (bf16 / fp32), the "auto" selector (the FP8 GEMMs are
tests/ops/test_fp8.py's).

CPU: the Triton kernels run under TRITON_INTERPRET=1 in fp32 at tiny shapes (the interpreter's fp32 dot is exact,
so bounds are tight). GPU (`-m gpu`, scripts/gpu_check.sh): bf16 at real shapes, gradients included, against
the fp32 loop. Inputs are fresh seeded random numbers; kernel outputs are NaN-poisoned where the kernel writes
into a caller's buffer (here every output is allocated by the kernel wrapper with torch.empty, so an unwritten
element shows as garbage / NaN in the comparison).
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

from moestack.ops import moe as moe_ops
from moestack.ops.moe import gemm_select
from moestack.ops.moe import triton_grouped_gemm as tgg
from moestack.ops.moe.reference import grouped_mm_loop

sys.path.insert(0, str(Path(__file__).parent))
from _grouped import DEV, offs_from_counts, rel_err  # noqa: E402


def make_case(counts, D, F, dtype, seed=0, tail=0, w_transposed=True, device=DEV):
    """x [sum(counts) + tail, D], w [E, D, F] (a transposed view of [E, F, D] like Experts passes), offs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N, E = sum(counts) + tail, len(counts)
    x = torch.randn(N, D, generator=g).to(device, dtype)
    if w_transposed:
        w = torch.randn(E, F, D, generator=g).div(D**0.5).to(device, dtype).transpose(1, 2)
    else:
        w = torch.randn(E, D, F, generator=g).div(D**0.5).to(device, dtype)
    return x, w, offs_from_counts(counts, device)


def loop_fp64(x, w, offs):
    return grouped_mm_loop(x.double(), w.double(), offs)


# awkward group sizes: empty experts, one hot expert, sizes not multiples of any tile, unaligned offsets
CPU_CASES = [
    ([5, 0, 17, 1, 0, 33], 24, 40, 0),  # empty experts, odd sizes
    ([0, 0, 50, 0], 20, 36, 3),  # single hot expert (extreme skew), tail rows past offs[-1]
    ([0, 0, 0], 16, 32, 4),  # no rows at all
    ([16, 16, 16], 32, 32, 0),  # exact tiles
    ([3, 1, 2, 7, 1, 0, 4, 9], 18, 20, 0),  # many tiny experts
]


@pytest.mark.parametrize("loads", ["tma", "pointer"])
@pytest.mark.parametrize("counts,D,F,tail", CPU_CASES)
def test_triton_forward_backward_interpreter(counts, D, F, tail, loads, monkeypatch):
    """TMA descriptors where widths allow (D = 18 falls back: rows not 16-byte aligned; dX needs F % 16 == 0 in the
    interpreter's configs), forward F tiles that run past an expert's weight rows (F = 40, 36); "pointer": the
    fallback kernel everywhere."""
    if DEV == "cuda":
        pytest.skip("interpreter case; the GPU runs test_triton_bf16_gpu")
    if loads == "pointer":
        from moestack.ops.moe import gg_tma

        monkeypatch.setattr(gg_tma, "fwd_supported", lambda x, w: False)
    x, w, offs = make_case(counts, D, F, torch.float32, seed=len(counts) + D, tail=tail)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = tgg.grouped_mm(x, w, offs)
    used = int(offs[-1])
    y_ref = loop_fp64(x, w, offs)
    assert torch.isfinite(y).all()
    if used:
        assert rel_err(y[:used], y_ref[:used]) < 2e-6
    assert (y[used:] == 0).all(), "rows past offs[-1] must be zero"
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    if used:
        xr, wr = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        dxr, dwr = torch.autograd.grad(grouped_mm_loop(xr, wr, offs), (xr, wr), dy.double())
        assert rel_err(dx, dxr) < 2e-6 and rel_err(dw, dwr) < 2e-6
    assert (dx[used:] == 0).all(), "gradient rows past offs[-1] are zero"
    empty = torch.tensor(counts) == 0
    assert (dw[empty] == 0).all(), "experts without rows get a zero weight gradient"
    assert dw.stride() == w.stride(), "the weight gradient is written in w's layout"


def test_tma_kernels_interpreter():
    """gg_tma directly: forward, dX (the [E, K, F] layout) and dW in both layouts, against the fp64 loop; hot
    expert with several token tiles, empty experts, tail rows; the kernels are the ones taken (fwd_supported), not
    the fallback. Also the large-expert weight-gradient kernel of the Gluon path (SKIP_ROWS 0: every expert)."""
    if DEV == "cuda":
        pytest.skip("interpreter case")
    from moestack.ops.moe import gg_tma

    counts, tail = [0, 37, 3, 0, 9], 2
    x, w, offs = make_case(counts, 32, 48, torch.float32, seed=3, tail=tail)
    N, used = x.shape[0], sum(counts)
    dy = torch.randn(N, 48, generator=torch.Generator().manual_seed(4))
    dy[used:] = 0
    wt = w.transpose(1, 2)  # [E, F, D] contiguous: the dX operand
    assert gg_tma.fwd_supported(x, w) and gg_tma.fwd_supported(dy, wt)
    y = gg_tma.grouped_mm_fwd(x, w, offs, BT_MAX=16)
    dx = gg_tma.grouped_mm_fwd(dy, wt, offs, BT_MAX=16)
    assert rel_err(y[:used], loop_fp64(x, w, offs)[:used]) < 2e-6 and (y[used:] == 0).all()
    assert rel_err(dx[:used], loop_fp64(dy, wt, offs)[:used]) < 2e-6 and (dx[used:] == 0).all()
    dw_ref = torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in
                          zip([0, *offs[:-1].tolist()], offs.tolist())])
    for like in (w, w.contiguous()):  # the parameter's transposed view, and a contiguous [E, D, F]
        dw = gg_tma.grouped_mm_wgrad(x, dy, offs, like, BT_MAX=16)
        assert dw.stride() == like.stride() and rel_err(dw, dw_ref) < 2e-6
        assert (dw[torch.tensor(counts) == 0] == 0).all()
    out = torch.full((len(counts), 32, 48), float("nan"))  # [E, D, F]: P = x, Q = dy
    grid = (2 * 1, len(counts))  # interpreter config BA 16, BB 32, GB 2: A = 32 -> 2 a-tiles, B = 48 -> 1 group
    gg_tma.gg_wgrad_kernel_large[grid](x, dy, out, offs, 32, 48, len(counts), *x.stride(), *dy.stride(),
                                       *out.stride(), PRECISION="ieee", RMAX=16, SKIP_ROWS=0)
    rows = torch.tensor(counts) > 0  # experts of <= SKIP_ROWS rows (here: the empty ones) are gluon_wgrad's
    assert rel_err(out[rows], dw_ref[rows]) < 2e-6 and out[~rows].isnan().all()


def test_triton_plain_layout_and_autocast_dtype():
    if DEV == "cuda":
        pytest.skip("interpreter case")
    x, w, offs = make_case([4, 9, 0, 3], 16, 24, torch.float32, w_transposed=False)
    y = tgg.grouped_mm(x, w, offs)
    assert rel_err(y, loop_fp64(x, w, offs)) < 2e-6


def test_experts_module_with_triton_backend_interpreter():
    """The seam: Experts.gemm = GroupedGemm("triton") gives the reference backend's outputs and parameter gradients."""
    if DEV == "cuda":
        pytest.skip("interpreter case")
    from moestack.model.moe import Experts

    torch.manual_seed(0)
    experts = Experts(4, 16, 8, activation="swiglu")
    experts.init_weights(0.3)
    h = torch.randn(23, 16)
    offs = offs_from_counts([6, 0, 12, 5], "cpu")
    outs = {}
    for backend in ("reference", "triton"):
        experts.gemm = moe_ops.GroupedGemm(backend)
        experts.zero_grad()
        y = experts(h, offs)
        y.pow(2).sum().backward()
        outs[backend] = (y.detach(), experts.w_gate_up.grad.clone(), experts.w_down.grad.clone())
    for got, want in zip(outs["triton"], outs["reference"]):
        assert rel_err(got, want) < 1e-5


def test_triton_bad_inputs():
    x, w, offs = make_case([2, 3], 8, 8, torch.float32)
    with pytest.raises(ValueError, match="offs"):
        tgg.grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match="in-dim"):
        tgg.grouped_mm(x[:, :4], w, offs)


def test_registry_has_triton_crossover():
    names = moe_ops.REGISTRY.names()
    assert "triton" in names and "crossover" in names
    assert moe_ops.REGISTRY.auto_for_device(torch.device("cpu")) == "torch"


# ---------------------------------------------------------------------------------------------------------------
# auto selection


def test_crossover_table_choice_and_json(tmp_path):
    table = gemm_select.CrossoverTable(default_rows=128, by_shape={"2048x2048": 300})
    assert table.threshold(1024, 1024) == 128
    assert table.threshold(2048, 2048) == 300
    path = tmp_path / "crossover.json"
    table.save(path)
    again = gemm_select.CrossoverTable.load(path)
    assert again == table
    assert gemm_select.choose(N=56 * 64, E=56, D=2048, F=2048, table=table) == "triton"
    assert gemm_select.choose(N=56 * 512, E=56, D=2048, F=2048, table=table) == "torch"
    with pytest.raises(ValueError, match="default_rows"):
        gemm_select.CrossoverTable.from_dict({"by_shape": {}})
    with pytest.raises(ValueError, match="'kernel' is no longer a choice"):
        gemm_select.CrossoverTable.from_dict({"default_rows": 1, "kernel": "swap"})


def test_auto_on_cpu_matches_torch():
    x, w, offs = make_case([3, 0, 5], 8, 12, torch.float32)
    y = moe_ops.grouped_mm(x, w, offs, backend="crossover")
    assert rel_err(y, loop_fp64(x, w, offs)) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes, gradients, against the fp32 loop

GPU_CASES = [
    # counts generator, D, F
    ("uniform16", 56, 2048, 2048),
    ("uniform100", 56, 1024, 512),
    ("skew", 56, 1024, 1024),
    ("empty_half", 32, 512, 768),
    ("odd", 7, 3584, 1000),
]


def gpu_counts(kind: str, E: int) -> list[int]:
    g = torch.Generator().manual_seed(E)
    if kind.startswith("uniform"):
        m = int(kind[len("uniform"):])
        return [m] * E
    if kind == "skew":
        return [2000] + [0] * (E - 2) + [3]
    if kind == "empty_half":
        return [0 if e % 2 else int(torch.randint(1, 300, (1,), generator=g)) for e in range(E)]
    return [int(v) for v in torch.randint(0, 400, (E,), generator=g)]


@pytest.mark.gpu
@pytest.mark.parametrize("loads", ["tma", "pointer"])
@pytest.mark.parametrize("kind,E,D,F", GPU_CASES)
def test_triton_bf16_gpu(loads, kind, E, D, F, monkeypatch):
    """Every row count (skew: one expert of 2000 rows); "pointer": the fallback forward kernel everywhere."""
    if loads == "pointer":
        from moestack.ops.moe import gg_tma

        monkeypatch.setattr(gg_tma, "fwd_supported", lambda x, w: False)
    counts = gpu_counts(kind, E)
    x, w, offs = make_case(counts, D, F, torch.bfloat16, seed=E + D, tail=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = tgg.grouped_mm(x, w, offs)
    used = int(offs[-1])
    xr, wr = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    y_ref = grouped_mm_loop(xr, wr, offs)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dxr, dwr = torch.autograd.grad(y_ref, (xr, wr), dy.float())
    errs = {"y": rel_err(y[:used], y_ref[:used]), "dx": rel_err(dx[:used], dxr[:used]), "dw": rel_err(dw, dwr)}
    if any(v > 1e-2 for v in errs.values()):
        print(f"MOE_GEMM_GPU_ERR triton {loads} {kind} E={E} D={D} F={F}: {errs}")
    assert all(v < 1e-2 for v in errs.values()), errs
    assert (y[used:] == 0).all()
    assert (dw[torch.tensor(counts) == 0] == 0).all()
    y2 = tgg.grouped_mm(x, w, offs)  # no atomics: bitwise equal on a second run
    again = torch.autograd.grad(y2, (x, w), dy)
    assert torch.equal(y, y2) and torch.equal(dx, again[0]) and torch.equal(dw, again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("bt_max", [16, 64, 128])  # RMAX 64, 128, 256: every reduction-depth path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # the gradient's dtype (like's)
def test_gluon_wgrad_gpu(bt_max, dtype):
    """gluon_wgrad through gg_tma.grouped_mm_wgrad(gluon=True) against the fp64 loop: empty experts, 1 row,
    depths just below / above each KS multiple, experts above RMAX (gg_wgrad_kernel_large), NaN in the rows past
    offs[-1] (must never be read), both gradient layouts; bitwise equal on a second run."""
    from moestack.ops.moe import gg_tma

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90 kernel")
    counts = [0, 1, 63, 64, 65, 128, 129, 200, 256, 300, 0, 17]
    x, w, offs = make_case(counts, 256, 384, torch.bfloat16, seed=bt_max, tail=7)
    used = sum(counts)
    dy = torch.randn(x.shape[0], 384, device=DEV, dtype=torch.bfloat16)
    x[used:], dy[used:] = float("nan"), float("nan")
    starts = [0, *offs[:-1].tolist()]
    dw_ref = torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(starts, offs.tolist())])
    for like in (w.to(dtype), w.to(dtype).contiguous()):
        dw = gg_tma.grouped_mm_wgrad(x, dy, offs, like, BT_MAX=bt_max, gluon=True)
        kmajor = like.transpose(1, 2).is_contiguous()  # the kernel computes out = P^T Q with b contiguous
        assert gg_tma._gluon_wgrad_ok(*((dy, x, dw.transpose(1, 2)) if kmajor else (x, dy, dw)))  # taken
        err = rel_err(dw, dw_ref)
        per_expert = [rel_err(dw[i], dw_ref[i]) if counts[i] else float(dw[i].abs().max()) for i in range(len(counts))]
        assert dw.stride() == like.stride() and err < 1e-2, (err, per_expert)
        assert all(v < 1e-2 for v in per_expert), per_expert
        assert (dw[torch.tensor(counts) == 0] == 0).all()
        again = gg_tma.grouped_mm_wgrad(x, dy, offs, like, BT_MAX=bt_max, gluon=True)
        assert torch.equal(dw, again)
    from moestack.ops.moe import gluon_wgrad

    rmax = gluon_wgrad.rmax_for(bt_max)
    small = [i for i, c in enumerate(counts) if c <= rmax]
    out = torch.full((len(counts), 384, 256), float("nan"), device=DEV, dtype=dtype)  # [E, F, D]: dW^T
    gluon_wgrad.wgrad_gluon(dy, x, out, offs, rmax)  # on the experts it writes
    errs = [rel_err(out[i].T, dw_ref[i]) if counts[i] else float(out[i].abs().max()) for i in small]
    assert all(v < 1e-2 for v in errs), errs


@pytest.mark.gpu
def test_auto_gpu_no_host_sync():
    x, w, offs = make_case([64] * 56, 1024, 1024, torch.bfloat16)
    x.requires_grad_(True)
    w.requires_grad_(True)
    from moestack.ops.fp8.grouped_gemm import Fp8GroupedGemm

    # the FP8 strategy (below its cuBLAS threshold here: the Triton kernels) and the bf16 backends
    gemms = [Fp8GroupedGemm(), moe_ops.GroupedGemm("triton"), moe_ops.GroupedGemm("crossover")]
    for gemm in gemms:  # warm-up: autotuning synchronises, the tuned launches must not
        y = gemm(x, w, offs)
        y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for gemm in gemms:
            y = gemm(x, w, offs)
            y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(y.float(), grouped_mm_loop(x.float(), w.float(), offs)) < 1e-2
