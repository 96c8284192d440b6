"""Rotary position embedding (RoFormer): used by GQA and by MLA when `use_rope` is True (K3 is NoPE).

Two pair layouts exist in public checkpoints: "half" (Llama / Qwen HF: dims i and i + D/2 form a pair) and
"interleaved" (DeepSeek MLA: dims 2i and 2i + 1 form a pair). Angles are computed in fp64, the rotation in fp32
(fp64 inputs stay fp64).

Legend: B batch, T tokens, H heads, D rotated dims (even), P = D // 2 rotation pairs, N documents.
"""

from __future__ import annotations

import math

import torch

from moestack.config.model_spec import RopeScalingSpec


def rope_positions(T: int, device: torch.device | str, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids [T] int64: 0..T-1, or restarting at 0 at every document start of packed `cu_seqlens` [N+1]."""
    pos_T = torch.arange(T, device=device)
    if cu_seqlens is None:
        return pos_T
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc_T = torch.searchsorted(cu[1:], pos_T, right=True)  # document of each token
    return pos_T - cu[doc_T]


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1 or mscale 0)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScalingSpec, device=None) -> torch.Tensor:
    """YaRN frequencies (Peng et al. 2023, "NTK-by-parts"), fp64 [dim // 2]: pairs that turn more than beta_fast
    times over the original context keep their frequency, pairs that turn less than beta_slow times are
    interpolated (frequency / factor), a linear ramp over the pair index blends the two in between."""
    P = dim // 2
    base_P = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    ctx = scaling.original_max_position_embeddings
    assert ctx is not None, "yarn needs original_max_position_embeddings"
    beta_fast = 32.0 if scaling.beta_fast is None else scaling.beta_fast
    beta_slow = 1.0 if scaling.beta_slow is None else scaling.beta_slow

    def pair_at(rotations: float) -> float:  # the (fractional) pair index turning `rotations` times over ctx
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(pair_at(beta_fast)), 0)
    hi = min(math.ceil(pair_at(beta_slow)), dim - 1)
    if hi == lo:
        hi += 0.001  # a ramp of zero width would divide by zero
    ramp_P = ((torch.arange(P, device=device, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return base_P / scaling.factor * ramp_P + base_P * (1 - ramp_P)


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype = torch.float32,
    scaling: RopeScalingSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotation angles: positions [..., T] (int) -> two tensors [..., T, dim // 2] of `dtype`.

    scaling: only "yarn" (DeepSeek's form: frequencies from `yarn_inv_freq`, cos / sin times
    yarn_mscale(factor, mscale (default 1)) / yarn_mscale(factor, mscale_all_dim (default 0)); with mscale_all_dim
    set, the attention also multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim) ** 2: GatedMLA)."""
    assert dim % 2 == 0, f"rotary dim must be even, got {dim}"
    mult = 1.0
    if scaling is None:
        inv_freq_P = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
    elif scaling.type == "yarn":
        inv_freq_P = yarn_inv_freq(dim, theta, scaling, positions.device)
        mult = (yarn_mscale(scaling.factor, 1.0 if scaling.mscale is None else scaling.mscale)
                / yarn_mscale(scaling.factor, scaling.mscale_all_dim or 0.0))
    else:
        raise NotImplementedError(f"rope_scaling '{scaling.type}' is not implemented (yarn is)")
    angles = positions.to(torch.float64)[..., None] * inv_freq_P  # fp64 so long positions keep their phase
    return (angles.cos() * mult).to(dtype), (angles.sin() * mult).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [B, T, H, D] by angles cos/sin [T, P] or [B, T, P]; returns x's dtype.

    interleaved=False pairs dims (i, i + P); interleaved=True pairs dims (2i, 2i + 1).
    """
    cos_TP = cos.unsqueeze(-2)  # broadcast over heads
    sin_TP = sin.unsqueeze(-2)
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 math (fp64 stays fp64)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = torch.stack((x1 * cos_TP - x2 * sin_TP, x2 * cos_TP + x1 * sin_TP), dim=-1).flatten(-2)
    else:
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat((x1 * cos_TP - x2 * sin_TP, x2 * cos_TP + x1 * sin_TP), dim=-1)
    return out.to(x.dtype)
