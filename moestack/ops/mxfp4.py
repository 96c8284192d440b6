"""MXFP4 (OCP Microscaling FP4) weights as compressed-tensors' `mxfp4-pack-quantized` format stores them.

Format (the released Kimi K3 routed experts; compressed-tensors MXFP4PackedCompressor):
  weight_packed  uint8 [rows, cols/2]   two E2M1 codes per byte along the row: element 2i in the LOW nibble,
                                        element 2i+1 in the HIGH nibble
  weight_scale   uint8 [rows, cols/32]  one E8M0 exponent per group of 32 consecutive elements of a row:
                                        scale = 2^(s - 127); s = 255 is NaN (OCP MX spec)
  E2M1 code      bit 3 sign, bits 0-2 magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6)
  value          E2M1[code] * scale

Dequantisation is exact in bf16 and fp32 (an E2M1 value has 2 significant bits; every scale 2^-127..2^127 times
it is a bf16 number, subnormals included, unless it overflows: 6 * 2^127 is inf, and is reported).

Quantisation (`quantize_mxfp4`, export and quantisation-aware training): per group of 32 the shared exponent is
one of two candidates, e0 = floor(log2(amax)) - 2 (the OCP choice: amax / 2^e0 in [4, 8), values above 6 clip)
and e0 + 1 (no clipping, coarser steps), whichever gives the smaller squared error of the group (e0 on a tie);
elements round to the nearest E2M1 value, ties to the even code (round-half-even, as compressed-tensors rounds).
An all-zero group stores s = 127. The plain-Python reference of both directions is in tests/ops/test_mxfp4.py.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 255
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes


class MXFP4Error(ValueError):
    """Packed data that cannot be (de)quantised: wrong shapes, NaN scales, non-finite values. One line."""


def _e2m1_table(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # [16]: code -> value


def _e8m0_table(device: torch.device) -> torch.Tensor:
    """[256] fp32: s -> 2^(s-127) built from bits (exact, 2^-127 is the subnormal 0x00400000), 255 -> NaN."""
    bits = torch.arange(256, dtype=torch.int32, device=device) << 23
    bits[0] = 0x00400000
    table = bits.view(torch.float32).clone()
    table[E8M0_NAN] = float("nan")
    return table


def check_packed_shapes(packed_shape, scale_shape, cols: int | None = None, group: int = GROUP,
                        where: str = "mxfp4") -> int:
    """The logical number of columns of packed [.., C/2] with scales [.., C/group]; MXFP4Error if inconsistent."""
    packed_shape, scale_shape = tuple(packed_shape), tuple(scale_shape)
    c = 2 * packed_shape[-1] if packed_shape else 0
    if cols is not None and c != cols:
        raise MXFP4Error(f"{where}: weight_packed {list(packed_shape)} holds {c} columns, the model has {cols}")
    if len(packed_shape) != len(scale_shape) or packed_shape[:-1] != scale_shape[:-1] or c % group \
            or scale_shape[-1] != c // group:
        raise MXFP4Error(f"{where}: weight_scale {list(scale_shape)} does not fit weight_packed {list(packed_shape)}"
                         f" (expected {[*packed_shape[:-1], c // group]}: one scale per {group} elements)")
    return c


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     group: int = GROUP, where: str = "mxfp4") -> torch.Tensor:
    """packed uint8 [..., C/2], scale uint8 [..., C/group] -> [..., C] in dtype (bf16 / fp32: exact).

    Raises MXFP4Error for inconsistent shapes, a NaN scale (s = 255) or an overflow to inf.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"{where}: weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
    cols = check_packed_shapes(packed.shape, scale.shape, group=group, where=where)
    if bool((scale == E8M0_NAN).any()):
        raise MXFP4Error(f"{where}: weight_scale holds the E8M0 NaN code 255 in {int((scale == 255).sum())} "
                         "group(s); the checkpoint is damaged")
    lead = packed.shape[:-1]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, cols)  # [..., C]: low nibble first
    values = _e2m1_table(packed.device)[codes.long()].view(*lead, cols // group, group)
    mult = _e8m0_table(packed.device)[scale.long()].unsqueeze(-1)  # [..., C/group, 1]
    out = (values * mult).view(*lead, cols)
    if not bool(torch.isfinite(out).all()):
        raise MXFP4Error(f"{where}: dequantised values overflow (scale exponent too large for 6 * 2^(s-127))")
    return out.to(dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by the group scale) -> E2M1 codes (uint8 0..15), nearest value, ties to the
    even code, magnitudes above 6 clip to 6. x must be finite."""
    a = x.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=a.dtype, device=a.device)
    idx = torch.bucketize(a, mids)  # number of midpoints strictly below a: the nearest magnitude, ties low
    tie = (a == mids[idx.clamp(max=len(_MIDPOINTS) - 1)]) & (idx < len(_MIDPOINTS))  # a on the midpoint above
    idx = idx + (tie & (idx % 2 == 1)).to(idx.dtype)  # a tie went to an odd code: take the even one above
    sign = (torch.signbit(x) & (idx > 0)).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def _group_exponents(amax: torch.Tensor) -> torch.Tensor:
    """e0 = floor(log2(amax)) - 2 per group (int32), exact via frexp; all-zero groups get 0 (s = 127)."""
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    e0 = e.to(torch.int32) - 3
    return torch.where(amax > 0, e0, torch.zeros_like(e0))


def quantize_mxfp4(w: torch.Tensor, group: int = GROUP, where: str = "mxfp4") -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] float (C a multiple of group) -> (packed uint8 [..., C/2], scale uint8 [..., C/group]).

    Per group the better of the two candidate exponents (module docstring). Raises MXFP4Error on non-finite w or
    a C that is not a multiple of the group.
    """
    cols = w.shape[-1]
    if cols % group:
        raise MXFP4Error(f"{where}: {cols} columns is not a multiple of the MXFP4 group size {group}")
    x = w.detach().float().reshape(*w.shape[:-1], cols // group, group)
    if not bool(torch.isfinite(x).all()):
        raise MXFP4Error(f"{where}: non-finite weights cannot be quantised to MXFP4")
    e8m0 = _e8m0_table(x.device)
    e2m1 = _e2m1_table(x.device)
    e0 = _group_exponents(x.abs().amax(-1))
    best_codes, best_s, best_err = None, None, None
    for shift in (0, 1):
        s = (e0 + shift + E8M0_BIAS).clamp(0, 254)  # stored exponent (saturates at the format's range)
        mult = e8m0[s.long()].unsqueeze(-1)
        codes = round_e2m1(x / mult)
        err = ((e2m1[codes.long()] * mult - x) ** 2).sum(-1)
        if best_err is None:
            best_codes, best_s, best_err = codes, s, err
            continue
        better = err < best_err  # ties keep e0
        best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
        best_s = torch.where(better, s, best_s)
        best_err = torch.minimum(err, best_err)
    codes = best_codes.reshape(*w.shape[:-1], cols)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), best_s.to(torch.uint8).contiguous()


def fake_quantize_mxfp4(w: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The MXFP4 round trip of w (dequantize(quantize(w)), in w's dtype) with a straight-through gradient: the
    forward sees exactly the values an MXFP4 export stores, the backward passes the gradient to w unchanged."""
    packed, scale = quantize_mxfp4(w, group)
    q = dequantize_mxfp4(packed, scale, torch.float32, group).to(w.dtype)
    return w + (q - w).detach()
