"""FP8 e4m3 quantisation, the torch spec (loop-clear, CPU-testable): the kernels in quant.py and gluon_quant.py
write exactly these numbers (up to one fp8 step at exact ties: they scale by x * (448 / amax)).

One fp32 scale = amax(|group|) / 448 per group (1 for an all-zero group), q = x / scale rounded to e4m3 (values
saturate at +-448 by construction), over three groupings:
    rows 1x128      x [N, K] -> q [N, K], s [N, ceil(K/128)]            activations along the reduction dim
                    (forward x, and dY for the input gradient)
    blocks 128x128  w [E, K, F] -> q [E, K, F], s [E, ceil(K/128), ceil(F/128)]   weights; q is laid out with K
                    (dim 1, the reduction) contiguous, so the same function serves w (forward) and w^T (dX)
    token tiles 128x1 along tokens, per expert: x [N, D], offs -> qT [D, P], s [G, D]   operands of the weight
                    gradient, whose reduction runs over each expert's tokens. Tile g covers 128 rows of one expert
                    (expert tiles are numbered in expert order); rows past the expert's end are zeros. Stored
                    transposed (tokens contiguous: the reduction dim contiguous, the layout Hopper's FP8 MMA wants).
                    G = ceil(N/128) + E bounds the tile count without reading offs on the host; P = 128 G.
Rounding: every element within 2^-4 relative of its value (3 mantissa bits, round to nearest) for values above the
group's amax * 2^-9 / 448 (e4m3 subnormals below), zero groups stay zero.

Legend: N rows, K reduction width, F output width, E experts, D width, G token tiles, P = 128 G padded tokens.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # tile / block edge of every grouping
FP8_REL_ERR = 2.0**-4  # round-to-nearest with 3 mantissa bits: |q - x| <= 2^-4 |x| for normal values


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _cast(v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(out_dtype)


def num_token_tiles(N: int, E: int) -> int:
    """Upper bound on the per-expert 128-row tiles of N rows over E experts (host-known, no sync)."""
    return -(-N // GROUP) + E


def quantize_rows_ref(x_NK: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = x_NK.shape
    nk = -(-K // GROUP)
    xp = torch.nn.functional.pad(x_NK.float(), (0, nk * GROUP - K)).view(N, nk, GROUP)
    s = _scale(xp.abs().amax(-1))  # [N, nk]
    q = _cast(xp / s[..., None], out_dtype).view(N, nk * GROUP)[:, :K]
    return q, s


def quantize_blocks_ref(w_EKF: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    E, K, F = w_EKF.shape
    nk, nf = -(-K // GROUP), -(-F // GROUP)
    wp = torch.nn.functional.pad(w_EKF.float(), (0, nf * GROUP - F, 0, nk * GROUP - K))
    blocks = wp.view(E, nk, GROUP, nf, GROUP)
    s = _scale(blocks.abs().amax(dim=(2, 4)))  # [E, nk, nf]
    q = _cast(blocks / s[:, :, None, :, None], out_dtype).view(E, nk * GROUP, nf * GROUP)[:, :K, :F]
    return q, s


def quantize_token_tiles_ref(
    x_ND: torch.Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    N, D = x_ND.shape
    E = offs_E.numel()
    G = num_token_tiles(N, E)
    qT = torch.zeros((D, G * GROUP), dtype=out_dtype, device=x_ND.device)
    s = torch.ones((G, D), dtype=torch.float32, device=x_ND.device)
    g, start = 0, 0
    for end in offs_E.tolist():
        for r0 in range(start, end, GROUP):
            tile = x_ND[r0:min(r0 + GROUP, end)].float()  # [<=128, D]
            s[g] = _scale(tile.abs().amax(0))
            qT[:, g * GROUP:g * GROUP + tile.shape[0]] = _cast(tile / s[g], out_dtype).t()
            g += 1
        start = end
    return qT, s


def expert_major_layout(counts: list[int]) -> tuple[list[int], list[int]]:
    """Host-side view of quantize_dual's expert-major row scales: (base_e, Mp_e) per expert; expert e's block
    starts at element base_e * ceil(K/128) and is [ceil(K/128), Mp_e] contiguous."""
    mp = [(c + 3) // 4 * 4 for c in counts]
    base, acc = [], 0
    for m in mp:
        base.append(acc)
        acc += m
    return base, mp


def expert_major_scales_ref(s_NK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Plain row scales [N, nk] -> the expert-major flat layout of quantize_dual (zeros in the padding)."""
    N, nk = s_NK.shape
    E = offs_E.numel()
    out = torch.zeros(nk * (N + 3 * E), dtype=torch.float32, device=s_NK.device)
    ends = offs_E.tolist()
    starts = [0] + ends[:-1]
    base, mp = expert_major_layout([max(b - a, 0) for a, b in zip(starts, ends)])
    for e in range(E):
        n = max(ends[e] - starts[e], 0)
        if n:
            blk = out[base[e] * nk: (base[e] + mp[e]) * nk].view(nk, mp[e])
            blk[:, :n] = s_NK[starts[e]:ends[e]].t()
    return out


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [N, K] * s [N, ceil(K/128)] broadcast over each 128-column group, fp32."""
    return q.float() * s.repeat_interleave(GROUP, dim=1)[:, : q.shape[1]]


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [E, K, F] * s [E, ceil(K/128), ceil(F/128)] broadcast over each 128x128 block, fp32."""
    K, F = q.shape[1:]
    full = s.repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)[:, :K, :F]
    return q.float() * full


def grouped_mm_fp8_reference(x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The expert GEMM's forward spec: dequantise(quantise(x)) @ dequantise(quantise(w)) per expert, fp32."""
    from moestack.ops.moe.reference import grouped_mm_loop

    qx, sx = quantize_rows_ref(x_ND)
    qw, sw = quantize_blocks_ref(w_EDF)
    return grouped_mm_loop(dequantize_rows(qx, sx), dequantize_blocks(qw, sw), offs_E)
