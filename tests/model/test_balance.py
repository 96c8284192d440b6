"""The router's balance losses against loop-clear formulas: the global-batch loss (over micro-batches), the router
z-loss, the fp32 router under bf16 autocast, and the recompute guard over the quantile histogram."""

from __future__ import annotations

import math

import pytest
import torch

from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.balance import global_balance_loss, router_z_loss
from moestack.model.moe import MoE

D, E, K, I = 12, 8, 2, 10


def _moe(router: RouterSpec, seed: int = 3) -> MoE:
    torch.manual_seed(seed)
    m = MoE(D, MoESpec(num_experts=E, top_k=K, expert_intermediate_size=I, router=router), "situ_glu").double()
    m.init_weights(0.4)
    return m


def _loop_global_loss(scores, load, coef):
    T = scores.shape[0]
    total = float(sum(load))
    loss = 0.0
    for i in range(E):
        P_i = sum(scores[t, i] / scores[t].sum() for t in range(T)) / T
        loss = loss + (float(load[i]) / total) * P_i
    return coef * E * loss


def _loop_z_loss(logits, coef):
    T = logits.shape[0]
    return coef * sum(math.log(sum(math.exp(float(z)) for z in logits[t])) ** 2 for t in range(T)) / T


def test_global_and_z_loss_match_loops():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, E, generator=g, dtype=torch.float64)
    scores = torch.sigmoid(logits)
    load = torch.randint(0, 9, (E,), generator=g)
    got = global_balance_loss(scores, load, 0.3)
    assert abs(float(got) - float(_loop_global_loss(scores, load, 0.3))) < 1e-13
    assert abs(float(router_z_loss(logits, 0.2)) - _loop_z_loss(logits, 0.2)) < 1e-12
    # uniform scores and balanced load give exactly coef
    assert abs(float(global_balance_loss(torch.full((5, E), 0.5), torch.full((E,), 3), 0.01)) - 0.01) < 1e-9


def test_moe_global_loss_counts_earlier_micro_batches_and_its_gradient():
    set_aux_loss_scale(1.0)
    coef = 0.5
    m = _moe(RouterSpec(seq_aux_loss_coef=0.0, global_aux_loss_coef=coef))
    m0 = _moe(RouterSpec(seq_aux_loss_coef=0.0))
    m.train(), m0.train()
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(2, 5, D, generator=g, dtype=torch.float64) for _ in range(2))
    # micro-batch 1, then its counts join the step's; micro-batch 2 sees both
    m(x1).sum().backward()
    m0(x1).sum().backward()
    c1 = m.last_expert_counts.clone()
    m.router.finish_microbatch()
    for p, p0 in zip(m.parameters(), m0.parameters()):
        p.grad = p0.grad = None
    out = m(x2)
    c2 = m.last_expert_counts.clone()
    out.sum().backward()
    m0(x2).sum().backward()
    W = m.router.weight.detach().clone().requires_grad_()
    s = torch.sigmoid(x2.reshape(-1, D) @ W.T)
    ref = _loop_global_loss(s, (c1 + c2).tolist(), coef)
    assert abs(float(m.last_global_aux_loss) - float(ref.detach())) < 1e-13
    (grad_W,) = torch.autograd.grad(ref, W)
    diff = m.router.weight.grad - m0.router.weight.grad  # the loss is the only difference
    assert grad_W.norm() > 0
    torch.testing.assert_close(diff, grad_W, rtol=1e-9, atol=1e-14)
    # the optimizer step resets the step's counts
    m.router.update_selection_bias()
    assert int(m.router.global_load.sum()) == 0


def test_moe_z_loss_gradient():
    set_aux_loss_scale(1.0)
    coef = 0.1
    m = _moe(RouterSpec(seq_aux_loss_coef=0.0, z_loss_coef=coef))
    m0 = _moe(RouterSpec(seq_aux_loss_coef=0.0))
    x = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    m(x).sum().backward()
    m0(x).sum().backward()
    W = m.router.weight.detach().clone().requires_grad_()
    ref = router_z_loss(x.reshape(-1, D) @ W.T, coef)
    assert abs(float(m.router.last_z_loss) - _loop_z_loss((x.reshape(-1, D) @ W.T).detach(), coef)) < 1e-12
    (grad_W,) = torch.autograd.grad(ref, W)
    torch.testing.assert_close(m.router.weight.grad - m0.router.weight.grad, grad_W, rtol=1e-9, atol=1e-14)
    for (n, p), (_, p0) in zip(m.named_parameters(), m0.named_parameters()):
        if n != "router.weight":
            torch.testing.assert_close(p.grad, p0.grad, rtol=1e-12, atol=1e-14)


def test_router_is_fp32_under_bf16_autocast():
    """The router's logits and scores stay fp32 under autocast (MODEL.md): the choice equals the fp32 router's."""
    torch.manual_seed(4)
    m = MoE(64, MoESpec(num_experts=16, top_k=4, expert_intermediate_size=8), "situ_glu")
    m.init_weights(0.05)
    x = torch.randn(256, 64)
    idx32, w32, s32 = m.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx, w, s = m.router(x)
    assert s.dtype == torch.float32 and w.dtype == torch.float32
    torch.testing.assert_close(s, s32, rtol=0, atol=0)
    assert torch.equal(idx, idx32)


@pytest.mark.parametrize("scope", ["step", "batch"])
def test_recompute_does_not_count_the_histogram_twice(scope):
    """The forward accumulators (step scope: the histogram; batch scope: the solved biases' sum and count) hold
    one forward's worth after a backward that recomputed it."""
    from moestack.memory.recompute import checkpoint_module

    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64, requires_grad=True)
    counters = []
    name = "quantile_hist" if scope == "step" else "batch_bias_sum"
    for recompute in (False, True):
        m = _moe(RouterSpec(bias_update="quantile", quantile_bins=64, quantile_scope=scope))
        m.train()
        if recompute:
            checkpoint_module(m, "full")
        m(x).sum().backward()
        counters.append((getattr(m.router, name).clone(), m.router.tokens_per_expert.clone()))
    if scope == "step":
        assert int(counters[0][0].sum()) == 12 * E
    else:
        assert float(counters[0][0][-1]) == 1.0 and float(counters[0][0][:-1].abs().sum()) > 0
    assert torch.equal(counters[0][0], counters[1][0]) and torch.equal(counters[0][1], counters[1][1])


@pytest.mark.parametrize("field,value", [("global_aux_loss_coef", -1.0), ("z_loss_coef", -0.1),
                                         ("quantile_bins", 2)])
def test_router_spec_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        RouterSpec(**{field: value})
