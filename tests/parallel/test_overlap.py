"""Shared experts overlapped with dispatch / combine (moestack.parallel.overlap): same outputs and gradients as the
plain layer. On CPU the side stream is a no-op and the shared experts run first, inline, through the same path;
the GPU test runs them on a real side stream (EP on 4 ranks with overlap is in test_expert.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.model.moe import MoE
from moestack.parallel.overlap import apply_shared_expert_overlap


def _pair(device: str, dtype: torch.dtype):
    spec = MoESpec(num_experts=8, top_k=2, expert_intermediate_size=32, latent_size=24, latent_norm=True,
                   num_shared_experts=1, shared_intermediate_size=48, router=RouterSpec(seq_aux_loss_coef=0.01))
    torch.manual_seed(0)
    ref = MoE(32, spec, "situ_glu").to(device=device, dtype=dtype)
    ref.init_weights(0.2)
    moe = copy.deepcopy(ref)
    assert apply_shared_expert_overlap(torch.nn.ModuleDict({"moe": moe})) == ["moe"]
    return ref, moe


def _run(m, x, w):
    x = x.clone().requires_grad_(True)
    out = m(x)
    (out.float() * w).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


def _compare(ref, moe, x, w, tol):
    (o1, dx1, g1), (o2, dx2, g2) = _run(ref, x, w), _run(moe, x, w)
    torch.testing.assert_close(o2, o1, rtol=tol, atol=tol)
    torch.testing.assert_close(dx2, dx1, rtol=tol, atol=tol)
    assert g1.keys() == g2.keys()  # parameter names unchanged by the wrapper
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=tol, atol=tol, msg=n)
    assert moe._shared_overlap_calls == 1
    assert isinstance(moe.shared, torch.nn.Module) and type(moe.shared).__name__ == "GLUMLP"  # restored


def test_overlap_matches_plain_layer_cpu():
    ref, moe = _pair("cpu", torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 32, generator=g, dtype=torch.float64)
    w = torch.randn(2, 8, 32, generator=g, dtype=torch.float64)
    _compare(ref, moe, x, w, 1e-12)


@pytest.mark.gpu
def test_overlap_matches_plain_layer_on_a_side_stream():
    ref, moe = _pair("cuda", torch.bfloat16)
    x = torch.randn(4, 512, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 512, 32, device="cuda")
    _compare(ref, moe, x, w, 2e-2)
