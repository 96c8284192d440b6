"""moestack/ops/accumulate.py: the Triton pass against the torch reference, bit for bit (the widening is exact, the
add one fp32 rounding), at sizes around the block, into a fresh tensor and into an existing one, NaN carried.

CPU: the kernel under TRITON_INTERPRET=1; GPU: the dispatching entry at K3 expert size.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernel is decorated
pytest.importorskip("triton")

from moestack.ops.accumulate import BLOCK, accumulate_into, accumulate_reference, accumulate_triton  # noqa: E402


def _pair(n: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(n, generator=gen) * 3).to(torch.bfloat16).to(device)
    dst = torch.randn(n, generator=gen).to(device)
    return dst, src


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 5])
def test_triton_matches_reference_bitwise(n):
    dst, src = _pair(n, "cpu", n)
    want = accumulate_reference(dst.clone(), src, torch.float32)
    got = accumulate_triton(dst.clone(), src)
    assert torch.equal(got, want)
    fresh = accumulate_triton(None, src)
    assert fresh.dtype == torch.float32 and torch.equal(fresh, src.float())


def test_writes_into_dst_and_carries_nan():
    dst, src = _pair(BLOCK + 3, "cpu", 7)
    src[5] = float("nan")
    dst[BLOCK + 1] = float("nan")
    out = accumulate_triton(dst, src)
    assert out is dst
    assert torch.isnan(out[5]) and torch.isnan(out[BLOCK + 1]) and int(torch.isnan(out).sum()) == 2


def test_entry_off_cuda_is_the_reference():
    dst, src = _pair(100, "cpu", 3)
    want = dst.clone().add_(src)
    out = accumulate_into(dst, src)
    assert out is dst and torch.equal(out, want)
    assert torch.equal(accumulate_into(None, src), src.float())
    assert accumulate_into(None, src, torch.float64).dtype == torch.float64


@pytest.mark.gpu
def test_gpu_bitwise_at_expert_size():
    dst, src = _pair(56 * 512 * 2048 + 17, "cuda", 11)
    want = dst.clone().add_(src)
    out = accumulate_into(dst, src)
    assert out is dst and torch.equal(out, want)
    fresh = accumulate_into(None, src.view(-1, 1))
    assert fresh.shape == (src.numel(), 1) and torch.equal(fresh.view(-1), src.float())
    strided = src.view(-1)[: 2 * (src.numel() // 2)].view(-1, 2).t()  # not contiguous: the reference path
    assert torch.equal(accumulate_into(None, strided), strided.float())
