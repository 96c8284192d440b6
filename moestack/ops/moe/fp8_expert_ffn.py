"""The FP8 v3 expert FFN as one autograd node, with the GLU activation computed inside the down GEMM's quantiser.

Unfused (Experts.forward on the "fp8" backend: two v3 grouped GEMMs around triton_activation.fused_glu), the
activation a [N, I] goes through memory in bf16 only to be read again by quantize_dual. Here
fp8_quant.quantize_glu_dual computes a per 128x128 tile from gate_up and writes only its fp8 copies: at K3 EP16
(131040 rows, I = 3072) 0.8 GB less written and read per layer forward, one kernel launch and the bf16 activation's
memory less. The numbers are the unfused path's: the fused quantiser runs the activation's fp32 operations and
rounds to gate_up's dtype before quantising, so every fp8 byte and scale is the same (GPU test), and the GEMMs,
weight cache and weight gradients are Fp8GroupedMMv3's (fp8_grouped_gemm.py). The backward runs the activation's
gradient kernel and quantize_dual as unfused: a fused gradient quantiser (d gate and d up of a tile pair from one
load of gate_up and da) was slower on the H200, 2.6 vs 2.2 ms, as was the fused activation at 8 warps (the math
is MUFU- and latency-bound once the tile's quantisation shares its registers; benchmarks/RESULTS.md session 12).

Where it applies (`expert_ffn` returns None otherwise and the caller runs the unfused pair): v3 on, both GEMMs on
the many-rows path (mean rows per expert >= fp8_scaled_mm.cublas_min_rows(), widths multiples of 512, the
cuBLAS blockwise probe passed), I a multiple of 128, and not MOESTACK_FP8_TMA_WGRAD=1 (the Triton weight
gradient is only wired in the unfused path). With MOESTACK_FP8_ROWS_GEMM=gluon the forward / dX GEMMs are the
Gluon kernel's, as unfused. Saves for backward what the unfused pair saves: x's token tiles, gate_up, a's token
tiles, the two parameters.

Opt-in ($MOESTACK_FP8_FUSED_FFN=1; benchmarks/moe.py variant fp8v3-fusedffn(-proj)): the fused quantiser is 5%
faster than the activation kernel + quantize_dual it replaces (1.31-1.32 vs 1.37-1.38 ms at K3 EP16), but the K3
EP16 layer showed no measurable change (+0.6 and -0.5 ms fwd+bwd in two paired runs; benchmarks/RESULTS.md
session 12).

Legend: N rows, D model (latent) width, I expert intermediate size, E experts.
"""

from __future__ import annotations

import os

import torch

from moestack.ops.moe import fp8_grouped_gemm as f8
from moestack.ops.moe import fp8_quant as fq
from moestack.ops.moe import fp8_scaled_mm as fsm
from moestack.ops.moe import fp8_weight_cache
from moestack.ops.moe.triton_activation import glu_backward

ENV = "MOESTACK_FP8_FUSED_FFN"


def enabled() -> bool:
    """$MOESTACK_FP8_FUSED_FFN (read per call): "1" or "0" (the default: no measurable gain in the layer)."""
    choice = os.environ.get(ENV, "0")
    if choice not in ("0", "1"):
        raise ValueError(f"{ENV}={choice!r}: use 1 (the activation inside the quantiser) or 0 (unfused, the default)")
    return choice == "1"


def applies(x_ND: torch.Tensor, w_gu_ED2I: torch.Tensor, w_down_EID: torch.Tensor) -> bool:
    """Whether expert_ffn takes these operands (module doc)."""
    N, D = x_ND.shape
    E, _, two_i = w_gu_ED2I.shape
    inter = two_i // 2
    if not (enabled() and f8.use_v3(None) and f8.use_v2(None)):
        return False
    if N == 0 or N < fsm.cublas_min_rows() * E or not fq.fused_sources_ok(inter):
        return False
    if os.environ.get(f8.TMA_WGRAD_ENV, "0") == "1":
        return False
    return fsm.shapes_ok(D, two_i) and fsm.shapes_ok(inter, D) and fsm.available(x_ND.device)


class Fp8ExpertFFN(torch.autograd.Function):
    """y [N, D] = act(x w_gu) w_down per expert, v3 GEMMs, the activation inside the down GEMM's quantiser."""

    @staticmethod
    def forward(ctx, x_ND, w_gu_ED2I, w_down_EID, offs_E, kind: str, beta: float, lin_beta: float,
                q_dtype: torch.dtype = fq.FP8):
        dtype, qd = x_ND.dtype, q_dtype  # q_dtype float32: unrounded "fp8" for the interpreter tests
        glu = (kind, float(beta), float(lin_beta))
        (qwg, swg), (_, swgT) = fp8_weight_cache.pair(w_gu_ED2I, qd)
        (qwd, swd), (_, swdT) = fp8_weight_cache.pair(w_down_EID, qd)
        tiles_gu, tiles_down = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        qx, sx, qxT, sxT = fq.quantize_dual(x_ND, offs_E, qd, expert_major=True, tiles=tiles_gu)
        gluon = f8._gluon_rows_gemm(x_ND)
        if gluon is not None and not gluon.supported(qx, qwg):
            gluon = None
        # the host read of the offsets (cuBLAS path) after the quantiser's launch, so the GPU has work meanwhile
        ends = None if gluon is not None else fsm.host_offsets(offs_E)
        gate_up = _rows_mm(gluon, qx, sx, qwg, swg, swgT, offs_E, ends, dtype)
        qa, sa, qaT, saT = fq.quantize_glu_dual(gate_up, offs_E, *glu, qd, expert_major=True, tiles=tiles_down)
        y = _rows_mm(gluon, qa, sa, qwd, swd, swdT, offs_E, ends, dtype)
        ctx.save_for_backward(qxT, sxT, gate_up, qaT, saT, w_gu_ED2I, w_down_EID, offs_E)
        ctx.glu, ctx.gluon, ctx.ends, ctx.dtype, ctx.q_dtype = glu, gluon, ends, dtype, qd
        # the weight gradients need the offsets on the host: the Gluon forward did not read them, so copy now
        ctx.offs_host = f8._offsets_to_host_async(offs_E) if ends is None and (tiles_gu or tiles_down) else None
        return y

    @staticmethod
    def backward(ctx, dy_ND):
        qxT, sxT, gate_up, qaT, saT, w_gu, w_down, offs_E = ctx.saved_tensors
        need_dx, need_dwg, need_dwd = ctx.needs_input_grad[:3]
        gluon, ends, dtype, qd = ctx.gluon, ctx.ends, ctx.dtype, ctx.q_dtype
        if ends is None and (need_dwg or need_dwd):
            ends = f8._offsets_from_host(ctx.offs_host, offs_E)
        qdy, sdy, qdyT, sdyT = fq.quantize_dual(dy_ND, offs_E, qd, expert_major=True, tiles=need_dwd)
        dx = dw_gu = dw_down = da = None
        if need_dx or need_dwg:
            (_, swd), (qwdT, swdT) = fp8_weight_cache.pair(w_down, qd)
            da = _rows_mm(gluon, qdy, sdy, qwdT, swdT, swd, offs_E, ends, dtype)
        if need_dwd:
            dw_down = fsm.wgrad(qaT, saT, qdyT, sdyT, ends, like=w_down)
        if da is not None:
            # the activation's gradient stays its own kernel: fused into the quantiser (both halves of a tile pair
            # from one load) it ran 2.6 ms against 2.2 for the pair (benchmarks/RESULTS.md session 12)
            dgate_up = glu_backward(gate_up, da, *ctx.glu)  # the unfused path's kernel, so the same bytes
            qdg, sdg, qdgT, sdgT = fq.quantize_dual(dgate_up, offs_E, qd, expert_major=True, tiles=need_dwg)
            del dgate_up
            if need_dx:
                (_, swg), (qwgT, swgT) = fp8_weight_cache.pair(w_gu, qd)
                dx = _rows_mm(gluon, qdg, sdg, qwgT, swgT, swg, offs_E, ends, dtype)
            if need_dwg:
                dw_gu = fsm.wgrad(qxT, sxT, qdgT, sdgT, ends, like=w_gu)
        return dx, dw_gu, dw_down, None, None, None, None, None


def _rows_mm(gluon, q, s, qw, sw, swT, offs_E, ends, dtype) -> torch.Tensor:
    """The v3 forward / dX GEMM on quantize_dual's operands: Gluon's kernel where chosen, else per-expert cuBLAS."""
    if gluon is not None and gluon.supported(q, qw):
        return gluon.grouped_mm(q, s, qw, sw, offs_E, dtype)
    return fsm.rows_mm(q, s, qw, sw, swT, ends if ends is not None else fsm.host_offsets(offs_E), dtype)


def expert_ffn(x_ND: torch.Tensor, w_gu_ED2I: torch.Tensor, w_down_EID: torch.Tensor, offs_E: torch.Tensor,
               kind: str, beta: float, lin_beta: float) -> torch.Tensor | None:
    """act(x w_gu) w_down per expert ([N, D] -> [N, D]; w_gu [E, D, 2I] and w_down [E, I, D] as the grouped GEMM
    sees them, gate columns then up columns) through Fp8ExpertFFN; None where it does not apply (module doc)."""
    from moestack.ops.moe.reference import _compute_dtype

    if not applies(x_ND, w_gu_ED2I, w_down_EID):
        return None
    dtype = _compute_dtype(x_ND, w_gu_ED2I)
    return Fp8ExpertFFN.apply(x_ND.to(dtype), w_gu_ED2I, w_down_EID, offs_E.contiguous(), kind, beta, lin_beta)
