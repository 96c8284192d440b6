"""The MoE entries as torch.library custom ops (moestack/ops/moe/custom_ops.py): torch.library.opcheck on each op
(schema, fake tensors, autograd registration, AOT dispatch) at awkward shapes (T = 37, E = 6, K = 2, empty experts,
tail rows), and each entry under torch.compile(fullgraph=True, aot_eager) against its eager call: outputs and every
gradient bit for bit (the same kernels; Triton in the CPU interpreter), alone and as one chained MoE token path.
GPU (`-m gpu`): bf16 under inductor against eager within bf16 bounds."""

from __future__ import annotations

import os

import pytest
import torch

from moestack.ops import moe
from moestack.ops.moe import custom_ops, gemm_select, routing  # noqa: F401  (registers torch.ops.moestack.moe_*)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")

T, E, K, D = 37, 6, 2, 16
ROUTING = ["reference", "triton"]
GEMMS = ["reference", "torch", "crossover", "triton"]
LAYOUTS = [(1, None), (4, None), (1, 9)]  # dropless exact, dropless padded, capacity 9 rows (drops slots)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _logits(seed, dtype=torch.float32):
    """[T, E] with expert 1 never chosen (top-2 of 6): an empty expert."""
    logits = torch.randn(T, E, generator=_gen(seed))
    logits[:, 1] -= 20.0
    return logits.to(dtype)


def _routed(seed, backend, align=1, capacity=None):
    idx, w, _, _ = routing.route(_logits(seed), None, K, backend=backend)
    return idx, w, routing.dispatch(idx, E, align, capacity, w, backend)


def _gemm_case(seed, tail=3):
    """x [N, D] (3 tail rows past offs[-1]), w [E, D, F] as the transposed view of [E, F, D] (Experts' layout),
    offs with empty experts (0 and 3)."""
    g = _gen(seed)
    offs = torch.tensor([0, 5, 19, 19, 20, 31], dtype=torch.int32)
    x = torch.randn(31 + tail, D, generator=g).requires_grad_()
    w = torch.randn(E, 24, D, generator=g).div(4).transpose(1, 2).requires_grad_()
    return x, w, offs


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _run(fn, inputs, seed):
    """fn's float outputs, then the gradients of each input that requires grad under random output weights."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    floats = [o for o in outs if o.is_floating_point()]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    g = _gen(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in floats)
    return (*outs, *torch.autograd.grad(loss, leaves))


def _assert_same(fn, inputs, seed=100):
    eager = _run(fn, inputs, seed)
    compiled = _run(_compiled(fn), inputs, seed)
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), (i, (a.double() - b.double()).abs().max())


# ---------------------------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("backend", ROUTING)
def test_opcheck_routing(backend):
    logits = _logits(1).requires_grad_()
    for args in [(None, K, "sigmoid", 1, 1, True, 1.0), (torch.randn(E, generator=_gen(2)), K, "softmax", 3, 2,
                                                          False, 2.5)]:
        torch.library.opcheck(torch.ops.moestack.moe_route.default, (logits, *args, backend))
    idx, w, _ = _routed(3, backend)
    h = torch.randn(T, D, generator=_gen(4), requires_grad=True)
    for align, cap in LAYOUTS:
        torch.library.opcheck(torch.ops.moestack.moe_dispatch.default, (idx, E, align, cap, w, backend))
        d = routing.dispatch(idx, E, align, cap, w, backend)
        rows = (d.slot_of_row_R, d.row_of_slot_N)
        torch.library.opcheck(torch.ops.moestack.moe_gather.default, (h, *rows, K, d.exact, backend))
        y = torch.randn(d.slot_of_row_R.shape[0], D, generator=_gen(5), requires_grad=True)
        torch.library.opcheck(torch.ops.moestack.moe_combine.default, (y, w.clone().requires_grad_(), *rows, d.exact,
                                                               backend))


def test_opcheck_router_logits():
    x = torch.randn(T, D, generator=_gen(6), requires_grad=True)
    weight = torch.randn(E, D, generator=_gen(7), requires_grad=True)
    for split in (False, True):
        torch.library.opcheck(torch.ops.moestack.moe_router_logits.default, (x, weight, split))


@pytest.mark.parametrize("backend", GEMMS)
def test_opcheck_grouped_mm(backend):
    x, w, offs = _gemm_case(8)
    for rows in (None, 4):
        torch.library.opcheck(torch.ops.moestack.moe_grouped_mm.default, (x, w, offs, backend, rows))
    torch.library.opcheck(torch.ops.moestack.moe_grouped_mm.default, (x, w.detach().contiguous().requires_grad_(), offs,
                                                               backend, None))


# ---------------------------------------------------------------------------------------------------------------
# each entry compiled whole vs eager, bit for bit


@pytest.mark.parametrize("split", [False, True])
def test_router_logits_compiles_whole(split):
    x = torch.randn(T, D, generator=_gen(10), requires_grad=True)
    weight = torch.randn(E, D, generator=_gen(11), requires_grad=True)
    _assert_same(lambda a, b: routing.router_logits(a, b, split), (x, weight))


@pytest.mark.parametrize("backend", ROUTING)
@pytest.mark.parametrize("cfg", [("sigmoid", 1, 1, True, 1.0, False), ("softmax", 3, 2, False, 2.5, True),
                                 ("sigmoid", 2, 1, True, 1.5, True)])
def test_route_compiles_whole(backend, cfg):
    score, groups, topk_groups, renorm, scaling, biased = cfg
    logits = _logits(12).requires_grad_()
    bias = torch.randn(E, generator=_gen(13)) * 0.1 if biased else None

    def fn(lg):
        return routing.route(lg, bias, K, score, groups, topk_groups, renorm, scaling, backend)

    _assert_same(fn, (logits,))


def test_route_reference_fp64_compiles_whole():
    """fp64 logits take the reference on every backend (and its backward differentiates it again)."""
    _assert_same(lambda lg: routing.route(lg, None, K, backend="triton"), (_logits(14, torch.float64)
                                                                           .requires_grad_(),))


@pytest.mark.parametrize("backend", ROUTING)
@pytest.mark.parametrize("align,capacity", LAYOUTS)
def test_dispatch_gather_combine_compile_whole(backend, align, capacity):
    idx, w, d = _routed(15, backend, align, capacity)
    fn = _compiled(lambda i, p: routing.dispatch(i, E, align, capacity, p, backend))
    dc = fn(idx, w)
    assert (dc.top_k, dc.exact) == (d.top_k, d.exact)
    for a, b in zip(d[:5], dc[:5], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    h = torch.randn(T, D, generator=_gen(16), requires_grad=True)
    _assert_same(lambda x: routing.gather(x, d, backend), (h,))
    y = torch.randn(d.slot_of_row_R.shape[0], D, generator=_gen(17), requires_grad=True)
    _assert_same(lambda a, b: routing.combine(a, d, b, backend), (y, w.clone().requires_grad_()))


@pytest.mark.parametrize("backend", GEMMS)
def test_grouped_mm_compiles_whole(backend):
    x, w, offs = _gemm_case(18)
    _assert_same(lambda a, b: moe.grouped_mm(a, b, offs, backend), (x, w))


def test_grouped_mm_table_and_frozen_weights_compile_whole():
    """A crossover table rides in the op as its row threshold; a weight without grad gets no gradient."""
    x, w, offs = _gemm_case(19)
    table = gemm_select.CrossoverTable(4, {f"{D}x24": 64})
    _assert_same(lambda a, b: moe.grouped_mm(a, b, offs, "crossover", table), (x, w))
    _assert_same(lambda a: moe.GroupedGemm("triton")(a, w.detach(), offs), (x,))


@pytest.mark.parametrize("backend,gemm", [("reference", "torch"), ("triton", "triton")])
def test_chain_compiles_whole(backend, gemm):
    """router_logits -> route -> dispatch -> gather -> grouped_mm -> combine in one graph (fullgraph: no break),
    fp32: output and the gradients of x, the router weight and the expert weights bit for bit."""
    g = _gen(20)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    router_w = torch.randn(E, D, generator=g, requires_grad=True)
    w_up = torch.randn(E, 24, D, generator=g).div(4).requires_grad_()
    bias = torch.zeros(E)
    bias[1] = -5.0  # expert 1 empty

    def chain(x, router_w, w_up):
        logits = routing.router_logits(x, router_w)
        idx, topk_w, scores, counts = routing.route(logits, bias, K, backend=backend)
        d = routing.dispatch(idx, E, 1, None, topk_w.detach(), backend)
        h = routing.gather(x * 2.0, d, backend)
        y = moe.grouped_mm(h, w_up.transpose(1, 2), d.offs_E, gemm)
        out = routing.combine(torch.relu(y)[:, :D], d, topk_w, backend)
        return out + scores.sum(-1, keepdim=True), counts

    _assert_same(chain, (x, router_w, w_up))


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16, inductor vs eager


def _close(a, b, tol=2e-2):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "crossover", "triton", "torch"])
def test_grouped_mm_inductor_bf16_gpu(backend):
    """~1000 rows per expert (the torch path's regime under "auto"), Experts' weight layout, bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([1100, 0, 950, 1024, 870, 1000, 1200, 0])
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(int(counts.sum()), 512, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8, 768, 512, device="cuda", generator=g) / 512**0.5).bfloat16().transpose(1, 2)
    w.requires_grad_()

    def fn(a, b):
        return moe.grouped_mm(a, b, offs, backend) * 1.0

    dy = torch.randn(x.shape[0], 768, device="cuda", generator=g).bfloat16()
    eager = (fn(x, w), *torch.autograd.grad(fn(x, w), (x, w), dy))
    torch._dynamo.reset()
    cf = torch.compile(fn, fullgraph=True)
    out = cf(x, w)
    compiled = (out, *torch.autograd.grad(out, (x, w), dy))
    for a, b in zip(eager, compiled, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and _close(b, a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_inductor_bf16_gpu():
    g = torch.Generator(device="cuda").manual_seed(1)
    Tn, En, Dn, Fn = 2048, 16, 512, 1024
    x = torch.randn(Tn, Dn, device="cuda", generator=g).bfloat16().requires_grad_()
    router_w = (torch.randn(En, Dn, device="cuda", generator=g) * 0.05).requires_grad_()
    w_up = (torch.randn(En, Fn, Dn, device="cuda", generator=g) / Dn**0.5).bfloat16().requires_grad_()
    w_down = (torch.randn(En, Dn, Fn, device="cuda", generator=g) / Fn**0.5).bfloat16().requires_grad_()

    def chain(x, router_w, w_up, w_down):
        logits = routing.router_logits(x, router_w)
        idx, topk_w, _, _ = routing.route(logits, None, 4)
        d = routing.dispatch(idx, En, 1, None, topk_w.detach())
        h = moe.grouped_mm(routing.gather(x, d), w_up.transpose(1, 2), d.offs_E)
        y = moe.grouped_mm(torch.nn.functional.silu(h), w_down.transpose(1, 2), d.offs_E)
        return routing.combine(y, d, topk_w)

    inputs = (x, router_w, w_up, w_down)
    dy = torch.randn(Tn, Dn, device="cuda", generator=g).bfloat16()
    out = chain(*inputs)
    eager = (out, *torch.autograd.grad(out, inputs, dy))
    torch._dynamo.reset()
    cf = torch.compile(chain, fullgraph=True)
    out = cf(*inputs)
    compiled = (out, *torch.autograd.grad(out, inputs, dy))
    for a, b in zip(eager, compiled, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and _close(b, a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transposed", [True, False])
def test_grouped_mm_backward_native_dw_in_weight_layout_gpu(transposed):
    """torch's grouped GEMM path of the custom backward writes dW in w's layout itself: values as the per-expert
    loop's, the fake's strides, and no copy kernel after the GEMMs (a strided copy of every expert gradient cost
    the K3 slice 97 ms per step on the H200)."""
    from moestack.ops.moe import reference

    g = torch.Generator(device="cuda").manual_seed(3)
    counts = torch.tensor([300, 0, 257, 512, 64, 0, 400, 128])
    offs = counts.cumsum(0).to(torch.int32).cuda()
    n, d_in, d_out = int(counts.sum()) + 16, 256, 384  # 16 tail rows past offs[-1]
    x = torch.randn(n, d_in, device="cuda", generator=g).bfloat16()
    dy = torch.randn(n, d_out, device="cuda", generator=g).bfloat16()
    w = torch.randn(8, d_out, d_in, device="cuda", generator=g).bfloat16().transpose(1, 2)
    w = w if transposed else w.contiguous()
    assert reference.native_grouped_mm_supported(x, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dx, dw = custom_ops.grouped_mm_backward(x, w, offs, dy, "torch", None, True, True)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # torch's elementwise copies (cutlass GEMM names contain "Copy_Atom", which is not one)
    copies = [k for k in names if any(s in k for s in ("direct_copy", "copy_kernel", "nocast"))]
    want = torch.stack([x[s:e].double().t() @ dy[s:e].double()
                        for s, e in zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True)])
    err = ((dw.double() - want).norm() / want.norm()).item()
    facts = dict(kernels=names, strides=(dw.stride(), custom_ops._empty_dw_like(w).stride()), rel_err=err)
    assert names and not copies, facts
    assert dw.stride() == custom_ops._empty_dw_like(w).stride(), facts
    assert _close(dw, want, 1e-2), facts
