"""GLU activations (SiTU-GLU, SwiGLU) and the dense GLU MLP vs hand-written formulas."""

from __future__ import annotations

import math

import pytest
import torch

from moestack.model.mlp import GLUMLP, glu_activation


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def situ_scalar(g: float, u: float, b: float, c: float) -> float:
    return b * math.tanh(g / b) / (1.0 + math.exp(-g)) * c * math.tanh(u / c)


def test_situ_glu_matches_scalar_formula():
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(5, 7, generator=g, dtype=torch.float64) * 8  # reaches the tanh-saturated range
    up = torch.randn(5, 7, generator=g, dtype=torch.float64) * 40
    for b, c in ((4.0, 25.0), (2.0, 3.0)):
        out = glu_activation(gate, up, "situ_glu", b, c)
        expect = torch.tensor([[situ_scalar(float(x), float(y), b, c) for x, y in zip(r1, r2)]
                               for r1, r2 in zip(gate, up)], dtype=torch.float64)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)


def test_situ_glu_bounded_and_fp32_math_for_bf16():
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(64, generator=g) * 100).to(torch.bfloat16)
    up = (torch.randn(64, generator=g) * 1000).to(torch.bfloat16)
    out = glu_activation(gate, up, "situ_glu")
    assert out.dtype == torch.bfloat16
    assert out.float().abs().max() <= 4.0 * 25.0
    # computed in fp32, then rounded once: equals the fp32 result cast to bf16
    assert torch.equal(out, glu_activation(gate.float(), up.float(), "situ_glu").to(torch.bfloat16))


def test_swiglu_and_unknown_kind():
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(glu_activation(gate, up, "swiglu"), gate / (1 + torch.exp(-gate)) * up)
    with pytest.raises(ValueError, match="activation must be one of"):
        glu_activation(gate, up, "gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        GLUMLP(8, 16, "relu")


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_glu_activation_gradcheck(kind):
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    up = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 10).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: glu_activation(a, b, kind, 4.0, 25.0), (gate, up))


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_glu_mlp_matches_manual_with_grads(kind):
    torch.manual_seed(4)
    m = GLUMLP(12, 20, kind, 4.0, 25.0).double()
    m.init_weights(0.5)
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    out = m(x)
    Wg, Wu, Wd = (p.detach().clone().requires_grad_() for p in (m.gate_proj.weight, m.up_proj.weight,
                                                               m.down_proj.weight))
    xr = x.detach().clone().requires_grad_()
    g, u = xr @ Wg.T, xr @ Wu.T
    if kind == "situ_glu":
        a = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    else:
        a = g * torch.sigmoid(g) * u
    expect = a @ Wd.T
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    R = torch.randn_like(out)
    (out * R).sum().backward()
    (expect * R).sum().backward()
    for got, want in ((x.grad, xr.grad), (m.gate_proj.weight.grad, Wg.grad), (m.up_proj.weight.grad, Wu.grad),
                      (m.down_proj.weight.grad, Wd.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_glu_mlp_autocast_meta_and_init():
    with torch.device("meta"):
        m = GLUMLP(7168, 33792)
    assert sum(p.numel() for p in m.parameters()) == 3 * 7168 * 33792
    m = GLUMLP(32, 48)
    m.init_weights(0.05)
    for p in m.parameters():
        assert p.shape in ((48, 32), (32, 48)) and abs(float(p.detach().std()) - 0.05) < 0.006
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    ref = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 3e-2
