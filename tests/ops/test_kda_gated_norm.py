"""Fused gated RMSNorm (moestack/ops/kda/gated_norm.py) against its PyTorch spec and model.kda's form.

CPU: the Triton kernels under TRITON_INTERPRET=1 in fp32 at tiny shapes (fp64 reference); GPU: bf16 at K3 width.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are decorated
pytest.importorskip("triton")

from moestack.model.norm import RMSNorm  # noqa: E402
from moestack.ops.kda.gated_norm import gated_rmsnorm, gated_rmsnorm_reference  # noqa: E402


def rel(a, b):
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_case(shape, act, dtype, device, tol):
    gen = torch.Generator().manual_seed(sum(shape))
    o = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    z = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(device).requires_grad_()
    y = gated_rmsnorm(o, z, w, 1e-6, act)
    ref_in = [t.detach().double().requires_grad_() for t in (o, z, w)]
    y_ref = gated_rmsnorm_reference(*ref_in, 1e-6, act)
    dy = torch.randn(y.shape, generator=gen).to(device)
    (y.float() * dy).sum().backward()
    (y_ref * dy.double()).sum().backward()
    errs = {"y": rel(y, y_ref), "do": rel(o.grad, ref_in[0].grad), "dz": rel(z.grad, ref_in[1].grad),
            "dw": rel(w.grad, ref_in[2].grad)}
    assert y.dtype == dtype and w.grad.dtype == w.dtype
    assert max(errs.values()) < tol, errs
    return errs


@pytest.mark.parametrize("shape,act", [((2, 37, 3, 16), "sigmoid"), ((45, 24), "silu")])
def test_matches_reference_cpu(shape, act):
    run_case(shape, act, torch.float32, "cpu", 1e-5)


def test_reference_is_the_model_form():
    norm = RMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    o, z = torch.randn(5, 2, 8, dtype=torch.float64), torch.randn(5, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(gated_rmsnorm_reference(o, z, norm.weight, 1e-6), norm(o) * torch.sigmoid(z))


def test_bad_arguments():
    with pytest.raises(ValueError, match="act must be"):
        gated_rmsnorm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-6, act="relu")
    with pytest.raises(ValueError, match="weight"):
        gated_rmsnorm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(4), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["sigmoid", "silu"])
def test_gpu_bf16(act):
    errs = run_case((2, 2048, 32, 128), act, torch.bfloat16, "cuda", 1e-2)
    print(f"\nGATEDNORM_GPU_ERR act={act} " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
