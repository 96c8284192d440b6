"""Triton MoE routing (fused router, counting-sort dispatch, gather / combine) vs the torch reference, and the
layer on the Triton path vs the loop reference: outputs and every gradient (router weights included).

CPU: kernels under TRITON_INTERPRET=1 in fp32 at tiny shapes. GPU (`-m gpu`): bf16 at the K3 per-device shape.
Fresh seeded random inputs; kernel outputs start NaN-poisoned so an unwritten element fails the comparison.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated
pytest.importorskip("triton")

from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.model.mlp import glu_activation
from moestack.model.moe import MoE
from moestack.ops import moe as moe_ops
from moestack.ops.moe import reference as ref
from moestack.ops.moe import routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()  # a GPU result against a CPU fp64 reference
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


pytestmark = pytest.mark.usefixtures("nan_poisoned_outputs")  # tests/ops/conftest.py


# ----------------------------------------------------------------------------------------------------------------
# router

ROUTE_CASES = [
    # score, E, K, groups, topk_groups, renormalize, bias, scaling
    ("sigmoid", 16, 4, 1, 1, True, True, 1.0),
    ("sigmoid", 16, 4, 4, 2, True, True, 2.5),
    ("sigmoid", 24, 3, 8, 3, False, True, 1.0),
    ("softmax", 20, 5, 1, 1, True, False, 1.0),
    ("softmax", 16, 5, 4, 2, False, True, 1.5),
    ("sigmoid", 8, 2, 8, 3, True, True, 1.0),  # one-expert groups: group score = the expert's score
]


@pytest.mark.parametrize("per_token_bias", [False, True], ids=["bias_E", "bias_TE"])
@pytest.mark.parametrize("case", ROUTE_CASES)
def test_router_matches_reference(case, per_token_bias):
    """bias_TE: the per-expert bias plus a selection jitter, one value per (token, expert)."""
    score, E, K, G, TG, renorm, use_bias, scaling = case
    if per_token_bias and not use_bias:
        pytest.skip("no bias in this case")
    g = torch.Generator().manual_seed(E * 100 + K)
    T = 11
    x = torch.randn(T, E, generator=g, dtype=torch.float64)
    bias = torch.randn(E, generator=g) * 0.2 if use_bias else None
    if per_token_bias:
        bias = bias + ref.selection_jitter(T, E, E + K, 0.3)
    gw, gs = torch.randn(T, K, generator=g, dtype=torch.float64), torch.randn(T, E, generator=g, dtype=torch.float64)

    xt = x.float().to(DEV).requires_grad_()
    idx, w, s, counts = routing.route(xt, None if bias is None else bias.to(DEV), K, score, G, TG, renorm, scaling,
                                      backend="triton")
    xr = x.clone().requires_grad_()
    idx_r, w_r, s_r = ref.route(xr, None if bias is None else bias.double(), K, score, G, TG, renorm, scaling)
    assert torch.equal(idx.cpu(), idx_r)
    assert torch.equal(counts.cpu(), torch.bincount(idx_r.flatten(), minlength=E))
    assert rel_err(w, w_r) < 1e-6 and rel_err(s, s_r) < 1e-6
    ((w.double().cpu() * gw).sum() + (s.double().cpu() * gs).sum()).backward()
    ((w_r * gw).sum() + (s_r * gs).sum()).backward()
    assert rel_err(xt.grad, xr.grad) < 1e-5
    # the weights' path alone (no gradient through the scores output)
    xt2 = x.float().to(DEV).requires_grad_()
    _, w2, _, _ = routing.route(xt2, None if bias is None else bias.to(DEV), K, score, G, TG, renorm, scaling,
                                backend="triton")
    xr2 = x.clone().requires_grad_()
    (ref.route(xr2, None if bias is None else bias.double(), K, score, G, TG, renorm, scaling)[1] * gw).sum().backward()
    (w2.double().cpu() * gw).sum().backward()
    assert rel_err(xt2.grad, xr2.grad) < 1e-5


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_split_bf16_router_logits_are_fp32_accurate(x_dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 96, generator=g).to(x_dtype)
    W = torch.randn(20, 96, generator=g) * 0.1
    gl = torch.randn(33, 20, generator=g, dtype=torch.float64)
    xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
    logits = routing.router_logits(xs, Ws, split_bf16=True)
    x64, W64 = x.double().requires_grad_(), W.double().requires_grad_()
    ref_logits = x64 @ W64.T
    assert logits.dtype == torch.float32 and rel_err(logits, ref_logits) < 3e-5
    (logits.double() * gl).sum().backward()
    (ref_logits * gl).sum().backward()
    assert rel_err(Ws.grad, W64.grad) < 3e-5
    assert rel_err(xs.grad, x64.grad) < (1e-2 if x_dtype == torch.bfloat16 else 3e-5)


def test_router_ties_lower_index_wins():
    """Identical logits and bias on experts 2, 5, 6 (and saturated ones): lower ids first, as the reference."""
    T, E, K = 5, 12, 3
    x = torch.randn(T, E)
    x[:, [2, 5, 6]] = 3.0
    x[0, :] = 40.0  # saturated sigmoid: every score == 1.0
    bias = torch.zeros(E)
    idx, _, _, counts = routing.route(x.to(DEV), bias.to(DEV), K, backend="triton")
    idx_r, _, _ = ref.route(x, bias, K)
    assert torch.equal(idx.cpu(), idx_r)
    assert idx_r[0].tolist() == [0, 1, 2] and idx_r[1, :2].tolist() == [2, 5]
    assert int(counts.sum()) == T * K


# ----------------------------------------------------------------------------------------------------------------
# dispatch, gather, combine


def scenario_idx(name: str, T: int, K: int, E: int, g: torch.Generator) -> torch.Tensor:
    """Random distinct experts per token; 'empty': only experts 0..K; 'hot': every token picks expert 3."""
    scores = torch.rand(T, E, generator=g)
    if name == "empty":
        scores[:, K + 1:] -= 2.0
    if name == "hot":
        scores[:, 3] += 2.0
    return scores.topk(K, dim=-1).indices


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("scenario", ["random", "empty", "hot"])
def test_dispatch_gather_combine_match_reference(scenario, align):
    T, K, E, D = 37, 3, 7, 20  # T*K = 111 slots: several partial chunks
    g = torch.Generator().manual_seed(7)
    idx = scenario_idx(scenario, T, K, E, g).to(DEV)
    d = routing.dispatch(idx, E, align, backend="triton")
    d_r = routing.dispatch(idx, E, align, backend="reference")
    for name in ("row_of_slot_N", "slot_of_row_R", "counts_E", "offs_E", "dropped"):
        assert torch.equal(getattr(d, name), getattr(d_r, name)), name
    # layout rules: blocks start at multiples of align, rows of an expert in token order
    ends = d.offs_E.long().cpu()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    assert bool((starts % align == 0).all()) and bool(((ends - starts) >= d.counts_E.cpu()).all())
    rows = d.row_of_slot_N.cpu().view(T, K)
    for e in range(E):
        r = rows[idx.cpu() == e]
        assert torch.equal(r, torch.arange(int(starts[e]), int(starts[e]) + r.numel()))

    h = torch.randn(T, D, generator=g).to(DEV).requires_grad_()
    w = torch.rand(T, K, generator=g).to(DEV).requires_grad_()
    h_r, w_r = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    x = routing.gather(h, d, "triton")
    x_r = routing.gather(h_r, d_r, "reference")
    assert torch.equal(x, x_r)  # a copy, padding rows zero
    W = torch.randn(D, D, generator=g).to(DEV)
    y = routing.combine(torch.tanh(x @ W), d, w, "triton")
    y_r = routing.combine(torch.tanh(x_r @ W), d_r, w_r, "reference")
    assert rel_err(y, y_r) < 1e-6
    gy = torch.randn(T, D, generator=g).to(DEV)
    (y * gy).sum().backward()
    (y_r * gy).sum().backward()
    assert rel_err(h.grad, h_r.grad) < 1e-5 and rel_err(w.grad, w_r.grad) < 1e-5
    assert torch.isfinite(h.grad).all()


def test_capacity_drop_accounting():
    """Static capacity: per expert the `cap` highest-priority slots stay (ties: lower slot), the rest dropped,
    counted; combine skips dropped slots; rows are e*cap + rank."""
    T, K, E, D = 16, 2, 4, 8
    g = torch.Generator().manual_seed(3)
    idx = scenario_idx("hot", T, K, E, g).to(DEV)
    prio = torch.rand(T, K, generator=g).to(DEV)
    prio[0, 0] = prio[1, 0] = 0.5  # a tie on expert 3's slots
    cap = routing.capacity_rows(T, K, E, 1.0)
    assert cap == T * K // E
    d = routing.dispatch(idx, E, capacity=cap, priority_TK=prio, backend="triton")
    counts = torch.bincount(idx.flatten().cpu(), minlength=E)
    assert int(d.dropped) == int((counts - cap).clamp_min(0).sum()) > 0
    assert torch.equal(d.offs_E.cpu(), torch.arange(1, E + 1, dtype=torch.int32) * cap)
    rows, flat, pr = d.row_of_slot_N.cpu(), idx.flatten().cpu(), prio.flatten().cpu()
    for e in range(E):
        slots = (flat == e).nonzero().flatten().tolist()
        ranked = sorted(slots, key=lambda n: (-float(pr[n]), n))
        for rank, n in enumerate(ranked):
            assert int(rows[n]) == (e * cap + rank if rank < cap else -1)
    h = torch.randn(T, D, generator=g).to(DEV).requires_grad_()
    w = torch.rand(T, K, generator=g).to(DEV).requires_grad_()
    x = routing.gather(h, d, "triton")
    assert x.shape == (E * cap, D)
    y = routing.combine(x * 2.0, d, w, "triton")
    kept = (rows >= 0).view(T, K).to(DEV)
    expect = 2.0 * (h.detach()[:, None, :] * (w.detach() * kept)[..., None]).sum(1)
    assert rel_err(y, expect) < 1e-6
    y.sum().backward()
    assert torch.isfinite(h.grad).all() and bool((w.grad[~kept] == 0).all())
    x_r = routing.gather(h.detach(), d, "reference")
    assert torch.equal(x.detach(), x_r)


def test_bad_inputs_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match="capacity_factor"):
        MoESpec(num_experts=4, top_k=2, expert_intermediate_size=8, capacity_factor=0.0)
    with pytest.raises(ValueError, match="align"):
        routing.dispatch(torch.zeros(2, 1, dtype=torch.int64), 4, align=0)
    with pytest.raises(ValueError, match="priority_TK"):
        routing.dispatch(torch.zeros(2, 1, dtype=torch.int64), 4, capacity=2)
    with pytest.raises(ValueError, match="kernels.moe.routing"):
        routing.resolve_backend("cutlass", torch.device("cpu"))


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_fused_glu_matches_eager(kind):
    from moestack.ops.moe.triton_activation import fused_glu

    g = torch.Generator().manual_seed(11)
    gu = (torch.randn(13, 2 * 40, generator=g, dtype=torch.float64) * 6).to(DEV)  # saturates tanh(g/4)
    da = torch.randn(13, 40, generator=g, dtype=torch.float64).to(DEV)
    x = gu.float().requires_grad_()
    a = fused_glu(x, kind, 4.0, 25.0)
    xr = gu.clone().requires_grad_()
    a_r = glu_activation(*xr.chunk(2, dim=-1), kind, 4.0, 25.0)
    assert a.dtype == torch.float32 and rel_err(a, a_r) < 1e-6
    (a.double() * da).sum().backward()
    (a_r * da).sum().backward()
    assert rel_err(x.grad, xr.grad) < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# the layer on the Triton path

D_, E_, K_, I_, L_ = 24, 8, 2, 16, 12

LAYER_VARIANTS = {
    "latent": {"latent_size": L_, "num_shared_experts": 1, "shared_intermediate_size": 20,
                   "router": RouterSpec(seq_aux_loss_coef=0.05)},
    "plain_softmax_groups": {"router": RouterSpec(score="softmax", num_groups=4, topk_groups=2, renormalize=False,
                                                   scaling_factor=2.0, seq_aux_loss_coef=0.01)},
}


def make_layer(variant: str, seed: int, **overrides) -> MoE:
    spec = MoESpec(num_experts=E_, top_k=K_, expert_intermediate_size=I_, **{**LAYER_VARIANTS[variant], **overrides})
    torch.manual_seed(seed)
    m = MoE(D_, spec, "situ_glu")
    m.init_weights(0.3)
    return m.to(DEV)


def run_layer(m: MoE, x: torch.Tensor, gy: torch.Tensor, backend: str):
    m.routing_backend = backend
    m.zero_grad()
    xx = x.clone().requires_grad_()
    out = m(xx)
    (out * gy).sum().backward()
    return out.detach(), xx.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("scenario", ["random", "hot_expert", "ties"])
@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_layer_triton_matches_reference_and_loop(variant, scenario):
    m = make_layer(variant, seed=1)
    with torch.no_grad():
        if scenario == "hot_expert":
            m.router.selection_bias[3] = 5.0
        if scenario == "ties":
            m.router.weight[5] = m.router.weight[2]
            m.router.weight[6] = m.router.weight[2]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, D_, generator=g).to(DEV)
    gy = torch.randn(2, 5, D_, generator=g).to(DEV)
    out, gx, gp = run_layer(m, x, gy, "triton")
    counts = m.last_expert_counts
    out_r, gx_r, gp_r = run_layer(m, x, gy, "reference")
    assert torch.equal(counts, m.last_expert_counts)
    assert rel_err(out, out_r) < 2e-5 and rel_err(gx, gx_r) < 2e-5
    for name in gp_r:
        assert rel_err(gp[name], gp_r[name]) < 2e-5, name
    assert gp["router.weight"].norm() > 0
    # routed part against the loop reference (fixed routing from the reference router)
    with torch.no_grad():
        xt = x.reshape(-1, D_)
        idx, w, _ = m.router(xt)
        h = m.down_proj(xt) if m.down_proj is not None else xt
        d = routing.dispatch(idx, E_, backend="triton")
        y = routing.combine(m.experts(routing.gather(h, d, "triton"), d.offs_E), d, w, "triton")
        y_loop = ref.moe_loop_reference(h, idx, w, m.experts.w_gate_up, m.experts.w_down,
                                        lambda a, b: glu_activation(a, b, "situ_glu"))
    assert rel_err(y, y_loop) < 2e-5


def test_layer_padding_and_capacity():
    """row_align pads blocks without changing the result; a capacity that fits everything equals dropless; a
    tight one drops, counts the drops, and still trains (finite gradients)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, D_, generator=g).to(DEV)
    gy = torch.randn(2, 6, D_, generator=g).to(DEV)
    m = make_layer("latent", seed=4)
    base = run_layer(m, x, gy, "triton")
    m.row_align = 8
    padded = run_layer(m, x, gy, "triton")
    roomy = run_layer(make_layer("latent", seed=4, capacity_factor=float(E_)), x, gy, "triton")
    for other in (padded, roomy):
        assert rel_err(other[0], base[0]) < 1e-6 and rel_err(other[1], base[1]) < 1e-6
        assert all(rel_err(other[2][n], base[2][n]) < 1e-6 for n in base[2])
    tight = make_layer("latent", seed=4, capacity_factor=0.5)
    with torch.no_grad():
        tight.router.selection_bias[3] = 5.0
    out, gx, gp = run_layer(tight, x, gy, "triton")
    assert int(tight.last_dropped) >= 12 - 3  # expert 3 gets all 12 tokens, keeps ceil(0.5 * 24 / 8) = 2 rows
    assert torch.isfinite(out).all() and torch.isfinite(gx).all()
    assert all(torch.isfinite(v).all() for v in gp.values())
    out_r, gx_r, _ = run_layer(tight, x, gy, "reference")
    assert rel_err(out, out_r) < 2e-5 and rel_err(gx, gx_r) < 2e-5


def test_layer_triton_bitwise_deterministic():
    m = make_layer("latent", seed=6)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 7, D_, generator=g).to(DEV)
    gy = torch.randn(3, 7, D_, generator=g).to(DEV)
    a, b = run_layer(m, x, gy, "triton"), run_layer(m, x, gy, "triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at the K3 per-device shape


@pytest.mark.gpu
@pytest.mark.parametrize("per_token_bias", [False, True], ids=["bias_E", "bias_TE"])
def test_gpu_router_k3_shape(per_token_bias):
    T, E, K = 8192, 896, 16
    x = torch.randn(T, E, device="cuda") * 2
    bias = torch.randn(E, device="cuda") * 0.05
    if per_token_bias:  # with the selection jitter
        bias = bias + ref.selection_jitter(T, E, torch.tensor(7, device="cuda"), 0.03)
    x.requires_grad_()
    idx, w, _, counts = routing.route(x, bias, K, backend="triton")
    xr = x.detach().clone().requires_grad_()
    idx_r, w_r, _ = ref.route(xr, bias, K)
    same = (idx == idx_r).all(-1).float().mean().item()
    assert same > 0.999, f"router ids agree on {same:.5f} of tokens"  # 1-ulp sigmoid differences may flip near-ties
    assert torch.equal(counts, torch.bincount(idx.flatten(), minlength=E))
    ok = (idx == idx_r).all(-1)
    assert rel_err(w[ok], w_r[ok]) < 1e-5
    gw = torch.randn_like(w)
    (w * gw).sum().backward()
    (w_r * gw).sum().backward()
    assert rel_err(x.grad[ok], xr.grad[ok]) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("align", [1, 128])
def test_gpu_layer_bf16_k3_shape(align):
    """K3 EP16 per-device: 56 experts, T = 8192, top-16, latent 3584 (width cut to keep the test quick)."""
    spec = MoESpec(num_experts=56, top_k=16, expert_intermediate_size=512, latent_size=1024,
                   num_shared_experts=1, shared_intermediate_size=512)
    torch.manual_seed(0)
    m = MoE(2048, spec, "situ_glu").cuda()
    m.init_weights(0.02)
    m.row_align = align
    m.experts.gemm = moe_ops.GroupedGemm("torch")  # the routing path here; the grouped GEMMs have their own tests
    x = torch.randn(2, 4096, 2048, device="cuda")
    gy = torch.randn_like(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, gx, gp = run_layer(m, x, gy, "triton")
        out_r, gx_r, gp_r = run_layer(m, x, gy, "reference")
        out2, gx2, gp2 = run_layer(m, x, gy, "triton")
    assert rel_err(out, out_r) < 1e-2 and rel_err(gx, gx_r) < 2e-2
    for n in gp_r:
        assert rel_err(gp[n], gp_r[n]) < 2e-2, n
    assert torch.equal(out, out2) and torch.equal(gx, gx2)
    assert all(torch.equal(gp[n], gp2[n]) for n in gp)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_gpu_layer_has_no_host_sync(capacity_factor):
    """Dropless and static-capacity layers run forward + backward with no device-to-host sync (after warm-up,
    which autotunes)."""
    spec = MoESpec(num_experts=16, top_k=4, expert_intermediate_size=256, latent_size=256,
                   capacity_factor=capacity_factor)
    m = MoE(512, spec, "situ_glu").cuda().to(torch.bfloat16)
    m.init_weights(0.02)
    m.experts.gemm = moe_ops.GroupedGemm("torch")
    x = torch.randn(2, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(x).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
