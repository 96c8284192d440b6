"""MXFP4 (compressed-tensors mxfp4-pack-quantized): dequantisation against a plain-Python reference of the E2M1 +
E8M0 spec and against compressed-tensors' own unpacking (optional dependency); quantisation against a plain-Python
reference of the documented scale choice; round-trip error bounds."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moestack.ops.mxfp4 import MXFP4Error, dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4, round_e2m1

# ---------------------------------------------------------------------------------------------- reference (spec)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_e2m1(code: int) -> float:
    """E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def ref_dequant(packed: list[list[int]], scale: list[list[int]], group: int = 32) -> list[list[float]]:
    out = []
    for prow, srow in zip(packed, scale):
        row = []
        for i in range(2 * len(prow)):
            byte = prow[i // 2]
            code = byte & 0xF if i % 2 == 0 else byte >> 4  # element 2i low nibble, 2i+1 high nibble
            row.append(ref_e2m1(code) * 2.0 ** (srow[i // group] - 127))
        out.append(row)
    return out


def ref_round(v: float) -> int:
    """Nearest E2M1 magnitude code, ties to the even code, clip at 6; sign bit unless the result is 0."""
    a = abs(v)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))
    return best | (8 if v < 0 and best else 0)


def ref_quant(w: list[list[float]], group: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    packed, scales = [], []
    for row in w:
        codes, srow = [], []
        for g in range(0, len(row), group):
            vals = row[g:g + group]
            amax = max(abs(v) for v in vals)
            if amax == 0:
                e0 = 0
            else:
                e0 = math.floor(math.log2(amax)) - 2
                if 2.0 ** (e0 + 2) > amax:  # log2 rounding near a power of two
                    e0 -= 1
                if 2.0 ** (e0 + 3) <= amax:
                    e0 += 1
            best = None
            for e in (e0, e0 + 1):
                s = min(max(e + 127, 0), 254)
                m = 2.0 ** (s - 127)
                cs = [ref_round(v / m) for v in vals]
                err = sum((ref_e2m1(c) * m - v) ** 2 for c, v in zip(cs, vals))
                if best is None or err < best[0]:
                    best = (err, s, cs)
            srow.append(best[1])
            codes.extend(best[2])
        packed.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        scales.append(srow)
    return packed, scales


def _random_packed(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(100, 140, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return packed, scale


# ---------------------------------------------------------------------------------------------- dequantisation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_matches_spec_reference(dtype):
    packed, scale = _random_packed(5, 96, 0)
    scale[0, 0], scale[1, 1] = 0, 200  # 2^-127 (an fp32 subnormal) and a large exponent
    got = dequantize_mxfp4(packed, scale, dtype)
    want = torch.tensor(ref_dequant(packed.tolist(), scale.tolist()), dtype=torch.float64)
    assert got.dtype == dtype and got.shape == (5, 96)
    assert torch.equal(got.double(), want)  # exact in both dtypes


def test_dequant_leading_dims_and_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[:, None] | (codes.flip(0)[:, None] << 4)).repeat(1, 16).reshape(2, 8, 16)  # [2, 8, 16]
    scale = torch.full((2, 8, 1), 127, dtype=torch.uint8)
    got = dequantize_mxfp4(packed, scale, torch.float32)
    want = torch.tensor(ref_dequant(packed.reshape(16, 16).tolist(), scale.reshape(16, 1).tolist()))
    assert torch.equal(got.reshape(16, 32), want)


def test_dequant_refuses_bad_input():
    packed, scale = _random_packed(2, 64, 1)
    with pytest.raises(MXFP4Error, match="does not fit"):
        dequantize_mxfp4(packed, scale[:, :1])
    scale[1, 0] = 255
    with pytest.raises(MXFP4Error, match="NaN code 255"):
        dequantize_mxfp4(packed, scale)
    scale[1, 0] = 254
    packed[1, 0] = 0x77  # 6 * 2^127 overflows
    with pytest.raises(MXFP4Error, match="overflow"):
        dequantize_mxfp4(packed, scale, torch.float32)


def test_dequant_matches_compressed_tensors():
    """compressed-tensors' own MXFP4 decompression (unpack_fp4_from_uint8 + E8M0 scales + dequantize) on random
    packed tensors. Optional dependency; its dequantised bf16 output must equal ours exactly."""
    mx = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
    quant = pytest.importorskip("compressed_tensors.quantization")
    args = quant.QuantizationArgs(num_bits=4, type="float", symmetric=True, group_size=32, strategy="group",
                                  scale_dtype=torch.uint8)
    scheme = quant.QuantizationScheme(targets=["Linear"], weights=args)
    for seed, (rows, cols) in enumerate([(3, 64), (7, 160), (16, 32)]):
        packed, scale = _random_packed(rows, cols, seed + 10)
        theirs = mx.MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)
        ours = dequantize_mxfp4(packed, scale, torch.bfloat16)
        assert theirs["weight"].shape == ours.shape
        assert torch.equal(theirs["weight"].to(torch.bfloat16), ours)
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # the nibble order alone

    packed, _ = _random_packed(4, 64, 3)
    ones = torch.full((4, 2), 127, dtype=torch.uint8)
    assert torch.equal(unpack_fp4_from_uint8(packed, 4, 64, torch.float32), dequantize_mxfp4(packed, ones,
                                                                                              torch.float32))


# ---------------------------------------------------------------------------------------------- quantisation


def test_round_e2m1_ties_and_clipping():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.2, -0.26, -5.1, 0.0, -0.0])
    got = [int(c) for c in round_e2m1(x)]
    assert got == [ref_round(float(v)) for v in x]
    assert got[:9] == [0, 2, 2, 4, 4, 6, 6, 7, 7]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quant_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 128, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 6, dtype=torch.float64)[:, None]
    w[0, :32] = 0.0  # an all-zero group
    w[1, 5] = 2.0 ** -3 * 7.9  # near-boundary group maxima
    w[2, 40] = 6.0 * 2.0 ** -2
    w = w.float()
    packed, scale = quantize_mxfp4(w)
    rp, rs = ref_quant(w.double().tolist())
    assert packed.tolist() == rp and scale.tolist() == rs


def test_quant_roundtrip_error_and_idempotence():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 256, generator=g)
    q = dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)
    # per group, the error is at most that of the non-clipping exponent e0 + 1, whose step near amax is 2^(e0+1)
    amax = w.view(64, 8, 32).abs().amax(-1, keepdim=True)
    step = 2.0 ** (torch.floor(torch.log2(amax)) - 1)
    assert bool(((q - w).view(64, 8, 32).abs() <= step * 1.0 + 1e-12).all())
    rel = float((q - w).norm() / w.norm())
    assert 0.05 < rel < 0.2, rel  # E2M1 with a shared power-of-two scale: ~10% relative RMS error on Gaussians
    # values already on the MXFP4 grid come back unchanged
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(q), torch.float32), q)


def test_quant_refuses_bad_input():
    with pytest.raises(MXFP4Error, match="multiple of the MXFP4 group"):
        quantize_mxfp4(torch.randn(2, 48))
    w = torch.randn(2, 64)
    w[1, 3] = float("nan")
    with pytest.raises(MXFP4Error, match="non-finite"):
        quantize_mxfp4(w)


def test_fake_quant_straight_through():
    w = torch.randn(4, 64, requires_grad=True)
    y = fake_quantize_mxfp4(w)
    assert torch.equal(y.detach(), dequantize_mxfp4(*quantize_mxfp4(w.detach()), torch.float32))
    g = torch.randn(4, 64)
    y.backward(g)
    assert torch.equal(w.grad, g)


def test_random_reference_cross_check():
    """Quantise random rows with the reference, dequantise with the fast path: the two directions agree."""
    rnd = random.Random(7)
    rows = [[rnd.gauss(0, 1) * 10 ** rnd.uniform(-2, 2) for _ in range(64)] for _ in range(3)]
    rp, rs = ref_quant(rows)
    got = dequantize_mxfp4(torch.tensor(rp, dtype=torch.uint8), torch.tensor(rs, dtype=torch.uint8), torch.float32)
    assert torch.equal(got.double(), torch.tensor(ref_dequant(rp, rs), dtype=torch.float64))
