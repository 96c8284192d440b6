"""torch.library custom ops at the Triton entries' autograd seam (moestack/ops/custom_ops.py), Triton interpreter on
CPU (fp32): torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch), and the entry points
under torch.compile(fullgraph=True) give the eager Function's outputs and gradients bit for bit (the same kernels)."""

from __future__ import annotations

import pytest
import torch

from moestack.ops import custom_ops  # noqa: F401  (registers torch.ops.moestack.*)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET")
                                != "1", reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def _glu_inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(37, 2 * 24, generator=g) * 2).to(device).requires_grad_()


def _norm_inputs(device="cpu"):
    g = torch.Generator().manual_seed(1)
    o = torch.randn(3, 5, 2, 20, generator=g).to(device).requires_grad_()
    z = torch.randn(3, 5, 2, 20, generator=g).to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(20, generator=g)).to(device).requires_grad_()
    return o, z, w


def test_opcheck():
    gu = _glu_inputs()
    torch.library.opcheck(torch.ops.moestack.fused_glu.default, (gu, "situ_glu", 4.0, 25.0))
    o, z, w = _norm_inputs()
    torch.library.opcheck(torch.ops.moestack.gated_rmsnorm.default, (o, z, w, 1e-5, "sigmoid"))


def _grads(fn, inputs, seed):
    out = fn(*inputs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return (out, *torch.autograd.grad(out, inputs, dy))


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_fused_glu_compiles_whole(kind):
    from moestack.ops.moe.triton_activation import fused_glu

    gu = _glu_inputs()
    eager = _grads(lambda x: fused_glu(x, kind), (gu,), 2)
    torch._dynamo.reset()
    compiled = _grads(torch.compile(lambda x: fused_glu(x, kind) * 1.0, backend="aot_eager", fullgraph=True),
                      (gu,), 2)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("act", ["sigmoid", "silu"])
def test_gated_rmsnorm_compiles_whole(act):
    from moestack.ops.kda.gated_norm import gated_rmsnorm

    inputs = _norm_inputs()
    eager = _grads(lambda o, z, w: gated_rmsnorm(o, z, w, 1e-5, act), inputs, 3)
    torch._dynamo.reset()
    fn = torch.compile(lambda o, z, w: gated_rmsnorm(o, z, w, 1e-5, act) + 0.0, backend="aot_eager", fullgraph=True)
    compiled = _grads(fn, inputs, 3)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
