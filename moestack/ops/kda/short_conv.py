"""KDA's short convolution fused with its SiLU: y = silu(causal depthwise conv1d(x, w)), never across documents.

    y[t, c] = silu(z[t, c]),   z[t, c] = sum_{j < W} w[c, W-1-j] * x[t-j, c] * [pos[t] >= j]

pos[t] is the position of token t inside its packed document (None: one document per row), so a tap never reads
the previous document. `short_conv_silu_reference` is the spec (the same sums as `model.kda.ShortConv`);
`short_conv_silu` runs one Triton kernel forward and two backward (dz and the dw partials, then dx from dz; each x
tile loaded W times). Nothing is saved but x. The PyTorch form makes ~3W elementwise passes each way and keeps W
shifted copies of x for backward. (A single-kernel backward, dz recomputed at W row shifts, spilled ~20 KB per
thread and ran 0.79x torch; it was removed: README.md.)

Shape legend: B batch, T tokens, C channels, W taps (kernel width).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moestack.ops.kda import custom_ops as kda_custom_ops
from moestack.ops.kda.triton_fwd import _configs
from moestack.ops.launch import pruner

_prune = {"early_config_prune": pruner("tile")}  # fixed [BT, BC] fp32 tiles, no dots

__all__ = ["short_conv_silu", "short_conv_silu_reference"]

DW_ROWS = 32  # rows per dw partial in the two-pass backward (fixed: the partials' shape must not depend on tuning)


def short_conv_silu_reference(x_BTC: torch.Tensor, w_CW: torch.Tensor, pos_T: torch.Tensor | None = None):
    """The spec, in x's dtype: x [B, T, C], w [C, W] (w[:, W-1] multiplies the current token), pos [T] or None."""
    W, T = w_CW.shape[1], x_BTC.shape[1]
    w_CW = w_CW.to(x_BTC.dtype)
    x_pad = F.pad(x_BTC, (0, 0, W - 1, 0))
    z = x_BTC * w_CW[:, W - 1]
    for j in range(1, W):
        x_j = x_pad[:, W - 1 - j : W - 1 - j + T]
        if pos_T is not None:
            x_j = x_j * (pos_T >= j).to(x_j.dtype)[None, :, None]
        z = z + x_j * w_CW[:, W - 1 - j]
    return F.silu(z)


@triton.jit
def _conv_pre(x, w, pos, i_b, t_rows, o_c, T, C, W: tl.constexpr, HAS_POS: tl.constexpr, BT: tl.constexpr,
              BC: tl.constexpr):
    """z [BT, BC] fp32 at rows t_rows (any ints; rows outside [0, T) give 0) and channels o_c."""
    m_c = o_c < C
    m_row = (t_rows >= 0) & (t_rows < T)
    if HAS_POS:
        p = tl.load(pos + t_rows, mask=m_row, other=0)
    z = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):
        t_src = t_rows - j
        m = m_row & (t_src >= 0)
        if HAS_POS:
            m = m & (p >= j)
        b_x = tl.load(x + (i_b * T + t_src).to(tl.int64)[:, None] * C + o_c[None, :],
                      mask=m[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_w = tl.load(w + o_c * W + (W - 1 - j), mask=m_c, other=0.0).to(tl.float32)
        z += b_x * b_w[None, :]
    return z


@triton.autotune(configs=_configs([triton.Config({"BT": 64, "BC": 128}, num_warps=4),
                                   triton.Config({"BT": 32, "BC": 256}, num_warps=4)]), key=["C", "W"],
                 prune_configs_by=_prune)
@triton.jit
def short_conv_silu_fwd_kernel(x, w, pos, y, T, C, W: tl.constexpr, HAS_POS: tl.constexpr,
                               BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_rows = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    z = _conv_pre(x, w, pos, i_b, t_rows, o_c, T, C, W, HAS_POS, BT, BC)
    m = (t_rows < T)[:, None] & (o_c < C)[None, :]
    tl.store(y + (i_b * T + t_rows).to(tl.int64)[:, None] * C + o_c[None, :],
             (z * tl.sigmoid(z)).to(y.dtype.element_ty), mask=m)


# 16 fp32 elements per thread per tile: ptxas hoists the W tile loads (more bytes in flight), <= ~130 registers.
@triton.autotune(configs=_configs([triton.Config({"BC": 128}, num_warps=8),
                                   triton.Config({"BC": 64}, num_warps=4),
                                   triton.Config({"BC": 256}, num_warps=8)]), key=["C", "W"],
                 prune_configs_by=_prune)
@triton.jit
def short_conv_silu_bwd_dz_kernel(x, w, pos, dy, dz, pdw, T, C, W: tl.constexpr, HAS_POS: tl.constexpr,
                                  BT: tl.constexpr, BC: tl.constexpr):
    """Two-pass backward, pass 1: dz = dy * silu'(z) (z recomputed from W shifted x tiles) stored fp32, and
    pdw[block, b, W-1-j, c] = sum over the block's BT rows t of dz[t] x[t-j] [pos[t] >= j] (x tiles re-read:
    L1 hits, fewer live registers than keeping W of them)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_rows = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_rows = t_rows < T
    m_c = o_c < C
    m = m_rows[:, None] & m_c[None, :]
    offs = (i_b * T + t_rows).to(tl.int64)[:, None] * C + o_c[None, :]
    z = _conv_pre(x, w, pos, i_b, t_rows, o_c, T, C, W, HAS_POS, BT, BC)
    s = tl.sigmoid(z)
    b_dz = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32) * s * (1.0 + z * (1.0 - s))
    tl.store(dz + offs, b_dz, mask=m)
    if HAS_POS:
        p = tl.load(pos + t_rows, mask=m_rows, other=0)
    n_b = tl.num_programs(2)
    for j in tl.static_range(W):
        t_src = t_rows - j
        m_j = m_rows & (t_src >= 0)
        if HAS_POS:
            m_j = m_j & (p >= j)
        b_x = tl.load(x + (i_b * T + t_src).to(tl.int64)[:, None] * C + o_c[None, :],
                      mask=m_j[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        tl.store(pdw + ((i_t * n_b + i_b) * W + (W - 1 - j)).to(tl.int64) * C + o_c, tl.sum(b_dz * b_x, 0),
                 mask=m_c)


@triton.autotune(configs=_configs([triton.Config({"BT": 32, "BC": 128}, num_warps=8),
                                   triton.Config({"BT": 16, "BC": 128}, num_warps=4),
                                   triton.Config({"BT": 64, "BC": 128}, num_warps=8)]), key=["C", "W"],
                 prune_configs_by=_prune)
@triton.jit
def short_conv_silu_bwd_dx_kernel(dz, w, pos, dx, T, C, W: tl.constexpr, HAS_POS: tl.constexpr,
                                  BT: tl.constexpr, BC: tl.constexpr):
    """Two-pass backward, pass 2: dx[t] = sum_j w[W-1-j] dz[t+j] [pos[t+j] >= j] (dz fp32 from pass 1)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_rows = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_rows = t_rows < T
    m_c = o_c < C
    b_dx = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):
        t_j = t_rows + j
        m_j = m_rows & (t_j < T)
        if HAS_POS:
            m_j = m_j & (tl.load(pos + t_j, mask=m_j, other=0) >= j)
        b_dz = tl.load(dz + (i_b * T + t_j).to(tl.int64)[:, None] * C + o_c[None, :],
                       mask=m_j[:, None] & m_c[None, :], other=0.0)
        b_w = tl.load(w + o_c * W + (W - 1 - j), mask=m_c, other=0.0).to(tl.float32)
        b_dx += b_dz * b_w[None, :]
    tl.store(dx + (i_b * T + t_rows).to(tl.int64)[:, None] * C + o_c[None, :], b_dx.to(dx.dtype.element_ty),
             mask=m_rows[:, None] & m_c[None, :])


def _bwd_two_pass(x, w, pos, dy):
    """dx, dw (fp32 [C, W]) through the two-pass kernels."""
    B, T, C = x.shape
    W = w.shape[-1]
    dz = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    n_blocks = triton.cdiv(T, DW_ROWS)
    pdw = torch.empty(n_blocks, B, W, C, device=x.device, dtype=torch.float32)  # every element written
    pos_arg = x if pos is None else pos
    short_conv_silu_bwd_dz_kernel[lambda meta: (n_blocks, triton.cdiv(C, meta["BC"]), B)](
        x, w, pos_arg, dy, dz, pdw, T, C, W=W, HAS_POS=pos is not None, BT=DW_ROWS)
    short_conv_silu_bwd_dx_kernel[lambda meta: (triton.cdiv(T, meta["BT"]), triton.cdiv(C, meta["BC"]), B)](
        dz, w, pos_arg, dx, T, C, W=W, HAS_POS=pos is not None)
    return dx, pdw.sum((0, 1)).t()


def _operands(x, w, pos):
    C, W = x.shape[-1], w.shape[-1]
    pos_c = None if pos is None else pos.to(device=x.device, dtype=torch.int32).contiguous()
    return x.contiguous(), w.reshape(C, W).contiguous(), pos_c


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, pos):
        B, T, C = x.shape
        x_c, w_c, pos_c = _operands(x, w, pos)
        y = torch.empty_like(x_c)

        def grid(meta):
            return (triton.cdiv(T, meta["BT"]), triton.cdiv(C, meta["BC"]), B)

        short_conv_silu_fwd_kernel[grid](x_c, w_c, x_c if pos_c is None else pos_c, y, T, C, W=w_c.shape[-1],
                                         HAS_POS=pos_c is not None)
        ctx.save_for_backward(x_c, w_c, pos_c)
        ctx.w_shape = w.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, pos = ctx.saved_tensors
        dx, dw_CW = _bwd_two_pass(x, w, pos, dy.contiguous())
        return dx, dw_CW.reshape(ctx.w_shape).to(w.dtype), None


def short_conv_silu_grads(x, w, pos, dy):
    """(dx, dw in w's shape and dtype) from the inputs: _ShortConvSiLU's backward, for the custom op's."""
    x_c, w_c, pos_c = _operands(x, w, pos)
    dx, dw_CW = _bwd_two_pass(x_c, w_c, pos_c, dy.contiguous())
    return dx.contiguous(), dw_CW.reshape(w.shape).to(w.dtype).contiguous()  # the custom op's fake strides


def short_conv_silu(x_BTC: torch.Tensor, w: torch.Tensor, pos_T: torch.Tensor | None = None) -> torch.Tensor:
    """Fused silu(causal depthwise conv) (module docstring). x [B, T, C] (CUDA, or CPU under TRITON_INTERPRET=1);
    w [C, W] or [C, 1, W] (nn.Conv1d layout), any float dtype (gradient in w's dtype); pos [T] int or None.
    Computes in fp32, returns x's dtype. Under torch.compile one custom op (custom_ops.py)."""
    if x_BTC.dim() != 3:
        raise ValueError(f"x_BTC must be [B, T, C], got shape {tuple(x_BTC.shape)}")
    if w.numel() % x_BTC.shape[-1] or w.shape[0] != x_BTC.shape[-1]:
        raise ValueError(f"w must be [C, W] or [C, 1, W] with C = {x_BTC.shape[-1]}, got {tuple(w.shape)}")
    if torch.compiler.is_compiling():
        return kda_custom_ops.short_conv_silu(x_BTC, w, pos_T)
    return _ShortConvSiLU.apply(x_BTC, w, pos_T)
