"""Fused GLU activation of the routed experts: gate_up [N, 2I] -> act(gate, up) [N, I], one pass each way.

The eager activation (moestack.model.mlp.glu_activation, the spec) runs ~10 fp32 elementwise kernels and keeps
their intermediates for backward; here forward reads gate_up once and writes the output once (math in fp32,
output in gate_up's dtype), and backward recomputes from gate_up (the only tensor saved) and writes d gate_up.

    situ_glu: a = b tanh(g/b) sigmoid(g) * c tanh(u/c)
        da/dg = c tanh(u/c) * [(1 - tanh(g/b)^2) sigmoid(g) + b tanh(g/b) sigmoid(g) (1 - sigmoid(g))]
        da/du = b tanh(g/b) sigmoid(g) * (1 - tanh(u/c)^2)
    swiglu:   a = g sigmoid(g) * u
        da/dg = u sigmoid(g) (1 + g (1 - sigmoid(g))),  da/du = g sigmoid(g)

Legend: N rows, I expert intermediate size; gate = columns [0, I), up = columns [I, 2I) (Experts' layout).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moestack.ops import custom_ops
from moestack.ops.launch import pruner

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
KINDS = {"situ_glu": 0, "swiglu": 1}


def _configs(configs: list[triton.Config]) -> list[triton.Config]:
    return configs[:1] if INTERPRET else configs


@triton.jit
def _tanh(x):
    # tanh from one exp, sign-symmetric so it never overflows
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def glu_act(b_g, b_u, beta, lin_beta, KIND: tl.constexpr):
    """act(gate, up) in fp32 (module doc).
    x / beta as x * (1 / beta): the divisions (MUFU reciprocals) are what bounds these kernels' instruction rate."""
    b_sig = 1.0 / (1.0 + tl.exp(-b_g))
    if KIND == 0:
        b_a = beta * _tanh(b_g * (1.0 / beta)) * b_sig * (lin_beta * _tanh(b_u * (1.0 / lin_beta)))
    else:
        b_a = b_g * b_sig * b_u
    return b_a


@triton.jit
def glu_grads(b_g, b_u, b_da, beta, lin_beta, KIND: tl.constexpr):
    """(d act / d gate, d act / d up) times da, fp32 (module doc)."""
    b_sig = 1.0 / (1.0 + tl.exp(-b_g))
    if KIND == 0:
        b_tg = _tanh(b_g * (1.0 / beta))
        b_tu = _tanh(b_u * (1.0 / lin_beta))
        b_actg = beta * b_tg * b_sig
        b_dg = b_da * lin_beta * b_tu * ((1.0 - b_tg * b_tg) * b_sig + b_actg * (1.0 - b_sig))
        b_du = b_da * b_actg * (1.0 - b_tu * b_tu)
    else:
        b_dg = b_da * b_u * b_sig * (1.0 + b_g * (1.0 - b_sig))
        b_du = b_da * b_g * b_sig
    return b_dg, b_du


_PRUNE = {"early_config_prune": pruner("tile")}  # fixed [BN, BI] fp32 tiles, no dots
_CONFIGS = _configs([
    triton.Config({"BN": 4, "BI": 1024}, num_warps=4),
    triton.Config({"BN": 8, "BI": 512}, num_warps=4),
    triton.Config({"BN": 16, "BI": 256}, num_warps=8),
])


@triton.autotune(configs=_CONFIGS, key=["I", "KIND"], prune_configs_by=_PRUNE)
@triton.jit
def glu_fwd_kernel(gu_ptr, a_ptr, N, I, beta, lin_beta, KIND: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr):
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    o_i = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (o_n < N)[:, None] & (o_i < I)[None, :]
    p_g = gu_ptr + o_n.to(tl.int64)[:, None] * (2 * I) + o_i[None, :]
    b_g = tl.load(p_g, mask=m, other=0.0).to(tl.float32)  # [BN, BI]
    b_u = tl.load(p_g + I, mask=m, other=0.0).to(tl.float32)
    b_a = glu_act(b_g, b_u, beta, lin_beta, KIND)
    tl.store(a_ptr + o_n.to(tl.int64)[:, None] * I + o_i[None, :], b_a.to(a_ptr.dtype.element_ty), mask=m)


@triton.autotune(configs=_CONFIGS, key=["I", "KIND"], prune_configs_by=_PRUNE)
@triton.jit
def glu_bwd_kernel(
    gu_ptr, da_ptr, dgu_ptr, N, I, beta, lin_beta, KIND: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr
):
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    o_i = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (o_n < N)[:, None] & (o_i < I)[None, :]
    off_gu = o_n.to(tl.int64)[:, None] * (2 * I) + o_i[None, :]
    b_g = tl.load(gu_ptr + off_gu, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(gu_ptr + off_gu + I, mask=m, other=0.0).to(tl.float32)
    b_da = tl.load(da_ptr + o_n.to(tl.int64)[:, None] * I + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    b_dg, b_du = glu_grads(b_g, b_u, b_da, beta, lin_beta, KIND)
    tl.store(dgu_ptr + off_gu, b_dg.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dgu_ptr + off_gu + I, b_du.to(dgu_ptr.dtype.element_ty), mask=m)


def _grid(N: int, I: int):
    return lambda meta: (triton.cdiv(N, meta["BN"]), triton.cdiv(I, meta["BI"]))


class _FusedGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up_N2I, kind, beta, lin_beta):
        gu = gate_up_N2I.contiguous()
        N, I = gu.shape[0], gu.shape[1] // 2
        a_NI = torch.empty((N, I), dtype=gu.dtype, device=gu.device)
        glu_fwd_kernel[_grid(N, I)](gu, a_NI, N, I, float(beta), float(lin_beta), KIND=KINDS[kind])
        ctx.save_for_backward(gu)
        ctx.cfg = (kind, float(beta), float(lin_beta))
        return a_NI

    @staticmethod
    def backward(ctx, da_NI):
        (gu,) = ctx.saved_tensors
        return glu_backward(gu, da_NI, *ctx.cfg), None, None, None


def glu_backward(gate_up_N2I: torch.Tensor, da_NI: torch.Tensor, kind: str, beta: float,
                 lin_beta: float) -> torch.Tensor:
    """d gate_up [N, 2I] from gate_up (contiguous) and da [N, I]: fused_glu's backward kernel."""
    N, I = gate_up_N2I.shape[0], gate_up_N2I.shape[1] // 2
    dgu = torch.empty_like(gate_up_N2I)
    glu_bwd_kernel[_grid(N, I)](gate_up_N2I, da_NI.contiguous(), dgu, N, I, float(beta), float(lin_beta),
                                KIND=KINDS[kind])
    return dgu


def fused_glu(gate_up_N2I: torch.Tensor, kind: str = "situ_glu", beta: float = 4.0,
              lin_beta: float = 25.0) -> torch.Tensor:
    """act(gate_up[:, :I], gate_up[:, I:]) [N, I] in gate_up's dtype, fp32 math; saves only gate_up."""
    if kind not in KINDS:
        raise ValueError(f"activation must be one of {tuple(KINDS)}, got {kind!r}")
    if gate_up_N2I.dim() != 2 or gate_up_N2I.shape[1] % 2:
        raise ValueError(f"gate_up must be [N, 2I], got shape {tuple(gate_up_N2I.shape)}")
    if torch.compiler.is_compiling():  # one node of the compiled graph (moestack/ops/custom_ops.py)
        return custom_ops.fused_glu(gate_up_N2I, kind, float(beta), float(lin_beta))
    return _FusedGLU.apply(gate_up_N2I, kind, beta, lin_beta)
