"""The whole expert FFN (gate/up GEMM -> GLU activation -> down GEMM) in FP8 v3, activation fused with quantisation.

FP8 v3 (fp8_grouped_gemm.Fp8GroupedMMv3) quantises each GEMM's activation operand with quantize_dual; two of
those operands are written in bf16 by the activation kernels just before: a = glu(gate_up) (the down GEMM's x) and
d_gate_up = glu_bwd(gate_up, da) (the gate/up GEMM's dY). Fp8ExpertFFN runs the layer's three GEMMs per direction
on v3's per-expert cuBLAS path and produces those two operands with gluon_glu_quant.py's kernels, which write
quantize_dual's outputs straight from the activation (no bf16 a / d_gate_up in memory):
    forward   q_x = quantize_dual(x); gu = rows_mm(q_x, w_gate_up) (bf16); q_a = glu_quant_fwd(gu);
              y = rows_mm(q_a, w_down)
    backward  q_dy = quantize_dual(dy); dW_down = wgrad(qT_a, qT_dy); da = rows_mm(q_dy, w_down^T) (bf16);
              q_dgu = glu_quant_bwd(gu, da); dW_gate_up = wgrad(qT_x, qT_dgu); dx = rows_mm(q_dgu, w_gate_up^T)
Saved for backward: x's and a's fp8 token tiles (the wgrad operands), gu (bf16; the activation's input, as
triton_activation's fused GLU saves), the weights (the parameters' views, no copies), offs and the host offsets.
The numbers equal the unfused composition Fp8GroupedMMv3 -> fused_glu -> Fp8GroupedMMv3 on the cuBLAS path.

Which path (decided per call, as Fp8GroupedMMv3 decides its cuBLAS path): both GEMMs on cuBLAS (mean rows per
expert >= fsm.cublas_min_rows(), widths multiples of 512, fsm.available) -> Fp8ExpertFFN; there the fused Gluon
kernels where they run (sm_90, bf16, I % 128 == 0), else the same steps with the unfused kernels (activation,
then fq.quantize_dual: the CPU tests' path, with an emulated torch._scaled_mm). Otherwise the plain composition
(two Fp8GroupedMMv3 calls and the fused GLU), no fusion.

Legend: N rows (sorted by expert), E experts, L expert width (latent), I expert intermediate width.
"""

from __future__ import annotations

import torch
import triton

from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe import fp8_scaled_mm as fsm
from moestack.ops.moe import fp8_weight_cache
from moestack.ops.moe.fp8_grouped_gemm import Fp8GroupedMMv3
from moestack.ops.moe.triton_activation import KINDS, fused_glu, glu_bwd_kernel


def _gluon_kernels(gate_up_N2I: torch.Tensor):
    """gluon_glu_quant where its kernels run for this tensor (sm_90, Gluon, bf16, I % 128 == 0), else None."""
    if not gate_up_N2I.is_cuda:
        return None
    try:
        from moestack.ops.moe import gluon_glu_quant
    except ImportError:  # a Triton without Gluon's Hopper pieces
        return None
    index = gate_up_N2I.device.index if gate_up_N2I.device.index is not None else torch.cuda.current_device()
    ok = gluon_glu_quant.supported(index) and gluon_glu_quant.supported_shape(gate_up_N2I)
    return gluon_glu_quant if ok else None


def _glu_quant_fwd(gu, offs_E, q_dtype, kind, beta, lin_beta):
    """quantize_dual(glu(gu)) in the cuBLAS path's layout: fused where supported, else the unfused kernels."""
    fused = _gluon_kernels(gu) if q_dtype == fq.FP8 else None
    if fused is not None:
        return fused.glu_quant_fwd(gu, offs_E, kind, beta, lin_beta)
    a = fused_glu(gu, kind, beta, lin_beta)  # grad mode is off inside autograd.Function.forward
    return fq.quantize_dual(a, offs_E, q_dtype, expert_major=True, tiles=True)


def _glu_quant_bwd(gu, da, offs_E, q_dtype, kind, beta, lin_beta):
    """quantize_dual(glu_bwd(gu, da)) in the cuBLAS path's layout: fused where supported, else unfused."""
    fused = _gluon_kernels(gu) if q_dtype == fq.FP8 and da.dtype == gu.dtype else None
    if fused is not None:
        return fused.glu_quant_bwd(gu, da.contiguous(), offs_E, kind, beta, lin_beta)
    return fq.quantize_dual(glu_bwd(gu, da, kind, beta, lin_beta), offs_E, q_dtype, expert_major=True, tiles=True)


def glu_bwd(gate_up_N2I: torch.Tensor, da_NI: torch.Tensor, kind: str, beta: float, lin_beta: float) -> torch.Tensor:
    """d gate_up [N, 2I] from triton_activation.glu_bwd_kernel (what fused_glu's backward computes)."""
    N, I = gate_up_N2I.shape[0], gate_up_N2I.shape[1] // 2
    dgu = torch.empty_like(gate_up_N2I)
    grid = lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(I, meta["BI"]))
    glu_bwd_kernel[grid](gate_up_N2I, da_NI.contiguous(), dgu, N, I, float(beta), float(lin_beta), KIND=KINDS[kind])
    return dgu


def cublas_path(x_NL: torch.Tensor, w_gate_up_EL2I: torch.Tensor, w_down_EIL: torch.Tensor,
                cublas_min_rows: int | None = None) -> bool:
    """Whether both GEMMs take v3's per-expert cuBLAS path (Fp8GroupedMMv3's rule for each)."""
    N, L = x_NL.shape
    E, _, I2 = w_gate_up_EL2I.shape
    min_rows = fsm.cublas_min_rows() if cublas_min_rows is None else cublas_min_rows
    return (N > 0 and N >= min_rows * E and fsm.shapes_ok(L, I2) and fsm.shapes_ok(I2 // 2, L)
            and fsm.available(x_NL.device))


class Fp8ExpertFFN(torch.autograd.Function):
    """y = down(glu(gate_up(x))) per expert in FP8 v3 on the cuBLAS path (module doc). `q_dtype` float32 runs
    the same steps on unrounded scaled values (CPU tests; the unfused kernels then)."""

    @staticmethod
    def forward(ctx, x_NL, w_gate_up_EL2I, w_down_EIL, offs_E, kind, beta, lin_beta, q_dtype=fq.FP8):
        ends = fsm.host_offsets(offs_E)
        (qw1, sw1), (_, sw1T) = fp8_weight_cache.pair(w_gate_up_EL2I, q_dtype)
        (qw2, sw2), (_, sw2T) = fp8_weight_cache.pair(w_down_EIL, q_dtype)
        qx, sx, qxT, sxT = fq.quantize_dual(x_NL, offs_E, q_dtype, expert_major=True,
                                            tiles=ctx.needs_input_grad[1])
        gu = fsm.rows_mm(qx, sx, qw1, sw1, sw1T, ends, x_NL.dtype)
        qa, sa, qaT, saT = _glu_quant_fwd(gu, offs_E, q_dtype, kind, beta, lin_beta)
        y = fsm.rows_mm(qa, sa, qw2, sw2, sw2T, ends, x_NL.dtype)
        ctx.save_for_backward(qxT, sxT, gu, qaT, saT, w_gate_up_EL2I, w_down_EIL, offs_E)
        ctx.cfg = (kind, beta, lin_beta, q_dtype, x_NL.dtype, ends)
        return y

    @staticmethod
    def backward(ctx, dy_NL):
        qxT, sxT, gu, qaT, saT, w1, w2, offs_E = ctx.saved_tensors
        kind, beta, lin_beta, q_dtype, x_dtype, ends = ctx.cfg
        need_dx, need_dw1, need_dw2 = ctx.needs_input_grad[:3]
        dx = dw1 = dw2 = None
        qdy, sdy, qdyT, sdyT = fq.quantize_dual(dy_NL, offs_E, q_dtype, expert_major=True, tiles=need_dw2)
        if need_dw2:
            dw2 = fsm.wgrad(qaT, saT, qdyT, sdyT, ends, like=w2)
        if need_dx or need_dw1:
            (_, sw2), (qw2T, sw2T) = fp8_weight_cache.pair(w2, q_dtype)
            da = fsm.rows_mm(qdy, sdy, qw2T, sw2T, sw2, ends, x_dtype)
            qg, sg, qgT, sgT = _glu_quant_bwd(gu, da, offs_E, q_dtype, kind, beta, lin_beta)
            if need_dw1:
                dw1 = fsm.wgrad(qxT, sxT, qgT, sgT, ends, like=w1)
            if need_dx:
                (_, sw1), (qw1T, sw1T) = fp8_weight_cache.pair(w1, q_dtype)
                dx = fsm.rows_mm(qg, sg, qw1T, sw1T, sw1, ends, x_dtype)
        return dx, dw1, dw2, None, None, None, None, None


def fp8_expert_ffn(x_NL: torch.Tensor, w_gate_up_EL2I: torch.Tensor, w_down_EIL: torch.Tensor, offs_E: torch.Tensor,
                   kind: str = "situ_glu", beta: float = 4.0, lin_beta: float = 25.0, q_dtype: torch.dtype = fq.FP8,
                   cublas_min_rows: int | None = None) -> torch.Tensor:
    """The expert FFN [N, L] -> [N, L] in FP8 v3 with the fused activation quantisers (module doc). w_gate_up_EL2I
    = Experts.w_gate_up.transpose(1, 2), w_down_EIL = Experts.w_down.transpose(1, 2); offs int32 [E]. Output in
    the autocast dtype inside autocast, else the promoted dtype of x and the weights (fp8_grouped_gemm.grouped_mm's
    convention); differentiable in x and both weights. cublas_min_rows None = $MOESTACK_FP8_CUBLAS_MIN_ROWS."""
    from moestack.ops.moe.reference import _compute_dtype
    from moestack.ops.moe.triton_grouped_gemm import _check

    if kind not in KINDS:
        raise ValueError(f"activation must be one of {tuple(KINDS)}, got {kind!r}")
    _check(x_NL, w_gate_up_EL2I, offs_E)
    if w_gate_up_EL2I.shape[2] != 2 * w_down_EIL.shape[1] or w_down_EIL.shape[2] != x_NL.shape[1]:
        raise ValueError(f"weights do not chain: gate_up {tuple(w_gate_up_EL2I.shape)} [E, L, 2I], down "
                         f"{tuple(w_down_EIL.shape)} [E, I, L], x {tuple(x_NL.shape)} [N, L]")
    x = x_NL.to(_compute_dtype(x_NL, w_gate_up_EL2I))
    offs_E = offs_E.contiguous()
    if cublas_path(x, w_gate_up_EL2I, w_down_EIL, cublas_min_rows):
        return Fp8ExpertFFN.apply(x, w_gate_up_EL2I, w_down_EIL, offs_E, kind, float(beta), float(lin_beta), q_dtype)
    # not on cuBLAS: v3's two GEMMs (Triton path, own thresholds) around the fused GLU, no fusion
    gu = Fp8GroupedMMv3.apply(x, w_gate_up_EL2I, offs_E, q_dtype, None, cublas_min_rows)
    a = fused_glu(gu, kind, beta, lin_beta)
    return Fp8GroupedMMv3.apply(a, w_down_EIL, offs_E, q_dtype, None, cublas_min_rows)
