"""KDA's gated output norm fused: y = RMSNorm(o) * weight * act(z), act = sigmoid (KDA) or silu (Gated DeltaNet).

    y[r, :] = o[r, :] * rsqrt(mean(o[r, :]^2) + eps) * weight * act(z[r, :])     (one row per token and head)

`gated_rmsnorm_reference` is the spec (model.kda's RMSNorm then the gate); `gated_rmsnorm` is one Triton kernel
each way, fp32 inside, saving only its inputs (the PyTorch form makes ~8 elementwise passes and keeps fp32 copies).

Shape legend: R rows (tokens x heads), V row width (head dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestack.ops import custom_ops
from moestack.ops.kda.triton_fwd import _configs
from moestack.ops.launch import pruner

_prune = {"early_config_prune": pruner("tile")}  # [BR, BV] fp32 tiles: shared memory only for the row sums

__all__ = ["gated_rmsnorm", "gated_rmsnorm_reference"]

_ACTS = {"sigmoid": 0, "silu": 1}


def gated_rmsnorm_reference(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                            act: str = "sigmoid") -> torch.Tensor:
    """The spec in fp32 or wider; returns z's dtype. o, z [..., V]; weight [V]."""
    dt = torch.promote_types(o.dtype, torch.float32)
    of = o.to(dt)
    n = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dt)
    zf = z.to(dt)
    g = torch.sigmoid(zf) if act == "sigmoid" else torch.nn.functional.silu(zf)
    return (n * g).to(z.dtype)


@triton.jit
def _gate(z, ACT: tl.constexpr):
    """act(z) and act'(z), fp32."""
    s = tl.sigmoid(z)
    if ACT == 0:
        return s, s * (1.0 - s)
    return z * s, s * (1.0 + z * (1.0 - s))


@triton.autotune(configs=_configs([triton.Config({"BR": 32}, num_warps=4), triton.Config({"BR": 64}, num_warps=8)]),
                 key=["V", "ACT"], prune_configs_by=_prune)
@triton.jit
def gated_rmsnorm_fwd_kernel(o, z, w, y, R, eps, V: tl.constexpr, BV: tl.constexpr, ACT: tl.constexpr,
                             BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BV)
    m = (rows < R)[:, None] & (cols < V)[None, :]
    off = rows.to(tl.int64)[:, None] * V + cols[None, :]
    b_o = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(z + off, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + cols, mask=cols < V, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_o * b_o, 1) / V + eps)
    g, _ = _gate(b_z, ACT)
    tl.store(y + off, (b_o * r[:, None] * b_w[None, :] * g).to(y.dtype.element_ty), mask=m)


# reset_to_zero: pdw has a row per 32-row block; a BR=64 run writes only the first half, so rows an earlier
# autotuning run (BR=32) wrote must not survive into the caller's sum.
@triton.autotune(configs=_configs([triton.Config({"BR": 32}, num_warps=4), triton.Config({"BR": 64}, num_warps=8)]),
                 key=["V", "ACT"], reset_to_zero=["pdw"], prune_configs_by=_prune)
@triton.jit
def gated_rmsnorm_bwd_kernel(o, z, w, dy, do, dz, pdw, R, eps, V: tl.constexpr, BV: tl.constexpr,
                             ACT: tl.constexpr, BR: tl.constexpr):
    """n = o r, a = n w, y = a g: dz = dy a g', dw = sum_rows dy g n, do = r (dn - n mean(dn n)), dn = dy g w."""
    i_r = tl.program_id(0)
    rows = i_r * BR + tl.arange(0, BR)
    cols = tl.arange(0, BV)
    m = (rows < R)[:, None] & (cols < V)[None, :]
    off = rows.to(tl.int64)[:, None] * V + cols[None, :]
    b_o = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(z + off, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + cols, mask=cols < V, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_o * b_o, 1) / V + eps)
    b_n = b_o * r[:, None]
    g, dg = _gate(b_z, ACT)
    tl.store(dz + off, (b_dy * b_n * b_w[None, :] * dg).to(dz.dtype.element_ty), mask=m)
    b_da = b_dy * g
    tl.store(pdw + i_r.to(tl.int64) * V + cols, tl.sum(b_da * b_n, 0), mask=cols < V)
    b_dn = b_da * b_w[None, :]
    b_do = r[:, None] * (b_dn - b_n * (tl.sum(b_dn * b_n, 1) / V)[:, None])
    tl.store(do + off, b_do.to(do.dtype.element_ty), mask=m)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, weight, eps, act):
        V = o.shape[-1]
        o2, z2 = o.reshape(-1, V).contiguous(), z.reshape(-1, V).contiguous()
        R = o2.shape[0]
        y = torch.empty_like(z2)
        BV = triton.next_power_of_2(V)
        gated_rmsnorm_fwd_kernel[lambda meta: (triton.cdiv(R, meta["BR"]),)](o2, z2, weight, y, R, eps, V=V, BV=BV,
                                                                             ACT=act)
        ctx.save_for_backward(o2, z2, weight)
        ctx.eps, ctx.act, ctx.shapes = eps, act, (o.shape, z.shape)
        return y.view(z.shape)

    @staticmethod
    def backward(ctx, dy):
        o2, z2, weight = ctx.saved_tensors
        R, V = o2.shape
        dy2 = dy.reshape(R, V).contiguous()
        do, dz = torch.empty_like(o2), torch.empty_like(z2)
        pdw = torch.zeros(triton.cdiv(R, 32), V, device=o2.device, dtype=torch.float32)  # 32 = smallest BR
        gated_rmsnorm_bwd_kernel[lambda meta: (triton.cdiv(R, meta["BR"]),)](
            o2, z2, weight, dy2, do, dz, pdw, R, ctx.eps, V=V, BV=triton.next_power_of_2(V), ACT=ctx.act)
        return do.view(ctx.shapes[0]), dz.view(ctx.shapes[1]), pdw.sum(0).to(weight.dtype), None, None


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                  act: str = "sigmoid") -> torch.Tensor:
    """Fused RMSNorm(o) * weight * act(z) over the last dim (module docstring). o, z [..., V] on CUDA (or CPU
    under TRITON_INTERPRET=1), same shape; weight [V]. Returns z's dtype; gradients for o, z and weight."""
    if act not in _ACTS:
        raise ValueError(f"act must be one of {sorted(_ACTS)}, got '{act}'")
    if o.shape != z.shape or weight.shape != o.shape[-1:]:
        raise ValueError(f"o, z must have one shape [..., V] and weight [V]: got {tuple(o.shape)}, "
                         f"{tuple(z.shape)}, {tuple(weight.shape)}")
    if torch.compiler.is_compiling():  # one node of the compiled graph (moestack/ops/custom_ops.py)
        return custom_ops.gated_rmsnorm(o, z, weight, float(eps), act)
    return _GatedRMSNorm.apply(o, z, weight, float(eps), _ACTS[act])
