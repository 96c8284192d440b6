"""Rotary position embedding (RoFormer): used by GQA and by MLA when `use_rope` is True (K3 is NoPE).

Two pair layouts exist in public checkpoints: "half" (Llama / Qwen HF: dims i and i + D/2 form a pair) and
"interleaved" (DeepSeek MLA: dims 2i and 2i + 1 form a pair). Angles are computed in fp64, the rotation in fp32
(fp64 inputs stay fp64).

Legend: B batch, T tokens, H heads, D rotated dims (even), P = D // 2 rotation pairs, N documents.
"""

from __future__ import annotations

import torch


def rope_positions(T: int, device: torch.device | str, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids [T] int64: 0..T-1, or restarting at 0 at every document start of packed `cu_seqlens` [N+1]."""
    pos_T = torch.arange(T, device=device)
    if cu_seqlens is None:
        return pos_T
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc_T = torch.searchsorted(cu[1:], pos_T, right=True)  # document of each token
    return pos_T - cu[doc_T]


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotation angles: positions [..., T] (int) -> two tensors [..., T, dim // 2] of `dtype`."""
    assert dim % 2 == 0, f"rotary dim must be even, got {dim}"
    inv_freq_P = theta ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq_P  # fp64 so long positions keep their phase
    return angles.cos().to(dtype), angles.sin().to(dtype)


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
