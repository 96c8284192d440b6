"""Fused short convolution + SiLU (moestack/ops/kda/short_conv.py) against its PyTorch spec.

CPU: the Triton kernels under TRITON_INTERPRET=1 in fp32 at tiny shapes (fp64 reference); GPU: bf16 at K3 width.
Outputs and gradients are compared with fresh random inputs, packed documents included.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are decorated
pytest.importorskip("triton")

from moestack.model.kda import ShortConv, _doc_positions  # noqa: E402
from moestack.ops.kda.short_conv import short_conv_silu, short_conv_silu_reference  # noqa: E402


def rel(a, b):
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_case(B, T, C, W, cu, dtype, device, tol):
    gen = torch.Generator().manual_seed(T + C)
    x = torch.randn(B, T, C, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.rand(C, 1, W, generator=gen) - 0.5).to(device).requires_grad_()
    pos = None if cu is None else _doc_positions(T, torch.tensor(cu), torch.device(device))
    y = short_conv_silu(x, w, pos)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y_ref = short_conv_silu_reference(x64, w64[:, 0, :], pos)
    dy = torch.randn(y.shape, generator=gen).to(device)
    (y.float() * dy).sum().backward()
    (y_ref * dy.double()).sum().backward()
    errs = {"y": rel(y, y_ref), "dx": rel(x.grad, x64.grad), "dw": rel(w.grad, w64.grad)}
    assert y.dtype == dtype and w.grad.dtype == w.dtype
    assert max(errs.values()) < tol, errs
    return errs


@pytest.mark.parametrize("B,T,C,W,cu", [(2, 70, 40, 4, None), (1, 90, 130, 4, [0, 3, 50, 90]), (1, 33, 8, 2, None)])
def test_matches_reference_cpu(B, T, C, W, cu):
    run_case(B, T, C, W, cu, torch.float32, "cpu", 1e-5)


def test_reference_is_the_module():
    """The spec is what model.kda.ShortConv + SiLU computes, packed documents included."""
    conv = ShortConv(12, 4).double()
    conv.init_weights(0.02)
    x = torch.randn(1, 30, 12, dtype=torch.float64)
    pos = _doc_positions(30, torch.tensor([0, 7, 30]), x.device)
    torch.testing.assert_close(short_conv_silu_reference(x, conv.weight[:, 0, :], pos),
                               torch.nn.functional.silu(conv(x, pos)), rtol=1e-12, atol=1e-12)


def test_bad_weight_shape():
    with pytest.raises(ValueError, match="w must be"):
        short_conv_silu(torch.randn(1, 4, 8), torch.randn(6, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [None, [0, 1000, 1001, 4096]])
def test_gpu_bf16(cu):
    errs = run_case(1 if cu else 2, 4096, 4096, 4, cu, torch.bfloat16, "cuda", 1e-2)
    print("\nSHORTCONV_GPU_ERR " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
