"""MoE reference ops vs brute-force loops: routing, permute / combine, grouped GEMM (+ backends registry)."""

from __future__ import annotations

import math

import pytest
import torch

from moestack.ops import moe as moe_ops
from moestack.ops.backends import Backend
from moestack.ops.moe import reference as ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------------------
# routing


def brute_route(logits, bias, top_k, score, num_groups, topk_groups, renormalize, scaling):
    """Per-token Python loops in fp64, ties -> lower id; returns (idx list of lists, weights list of lists)."""
    T, E = logits.shape
    S = E // num_groups
    idx_out, w_out = [], []
    for t in range(T):
        row = [float(v) for v in logits[t]]
        if score == "sigmoid":
            s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            s = [v / sum(ex) for v in ex]
        c = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        eligible = list(range(E))
        if num_groups > 1:
            gscore = [sum(sorted(c[g * S:(g + 1) * S], reverse=True)[:2]) for g in range(num_groups)]
            groups = sorted(range(num_groups), key=lambda g: (-gscore[g], g))[:topk_groups]
            eligible = [e for e in range(E) if e // S in groups]
        chosen = sorted(eligible, key=lambda e: (-c[e], e))[:top_k]
        w = [s[e] for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        idx_out.append(chosen)
        w_out.append([v * scaling for v in w])
    return idx_out, w_out


ROUTE_CASES = [
    # score, E, K, groups, topk_groups, renormalize, use_bias, scaling
    ("sigmoid", 16, 4, 1, 1, True, True, 1.0),
    ("sigmoid", 16, 4, 4, 2, True, True, 2.5),
    ("sigmoid", 24, 3, 8, 3, False, True, 1.0),
    ("sigmoid", 12, 2, 1, 1, False, False, 1.0),
    ("softmax", 16, 4, 1, 1, True, False, 1.0),
    ("softmax", 16, 4, 1, 1, False, False, 1.0),
    ("softmax", 16, 5, 4, 2, False, True, 1.5),
    ("sigmoid", 8, 2, 8, 3, True, True, 1.0),  # groups of one expert: group score = the expert's score
]


@pytest.mark.parametrize("case", range(len(ROUTE_CASES)))
def test_route_matches_brute_force(case):
    score, E, K, G, TG, renorm, use_bias, scaling = ROUTE_CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    T = 37
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.3 if use_bias else None
    idx, w, scores = ref.route(logits, bias, K, score, G, TG, renorm, scaling)
    b_idx, b_w = brute_route(logits, bias, K, score, G, TG, renorm, scaling)
    assert idx.dtype == torch.int64 and idx.shape == (T, K)
    assert idx.tolist() == b_idx
    torch.testing.assert_close(w, torch.tensor(b_w, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    expect_s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    torch.testing.assert_close(scores, expect_s, rtol=1e-12, atol=1e-14)


def test_route_fp32_math_from_bf16_logits():
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    idx, w, scores = ref.route(logits, None, 2)
    assert w.dtype == torch.float32 and scores.dtype == torch.float32
    b_idx, b_w = brute_route(logits.double(), None, 2, "sigmoid", 1, 1, True, 1.0)
    assert idx.tolist() == b_idx
    torch.testing.assert_close(w, torch.tensor(b_w, dtype=torch.float32), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("G,TG", [(1, 1), (4, 2)])
def test_route_ties_pick_lower_expert_id(G, TG):
    # integer logits from a tiny set: most rows have many exact ties, among experts and among groups
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(-1, 2, (64, 16), generator=g).double()
    bias = torch.randint(0, 2, (16,), generator=g).double() * 0.25
    idx, w, _ = ref.route(logits, bias, 4, "sigmoid", G, TG, True, 1.0)
    b_idx, b_w = brute_route(logits, bias, 4, "sigmoid", G, TG, True, 1.0)
    assert idx.tolist() == b_idx
    torch.testing.assert_close(w, torch.tensor(b_w, dtype=torch.float64))
    # and the same answer on a second call (no hidden randomness)
    assert torch.equal(ref.route(logits, bias, 4, "sigmoid", G, TG, True, 1.0)[0], idx)


def test_bias_changes_selection_not_weights():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 8, generator=g, dtype=torch.float64)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[[5, 6]] = 10.0  # dominates any sigmoid score difference
    idx0, _, _ = ref.route(logits, None, 2, renormalize=False)
    idx, w, scores = ref.route(logits, bias, 2, renormalize=False)
    assert sorted(set(idx.flatten().tolist())) == [5, 6]
    assert not torch.equal(idx0, idx)
    # weights are the unbiased scores at the chosen ids
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, idx))
    assert (w < 1).all()


def test_route_gradient_of_weights():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.1
    for score, renorm in (("sigmoid", True), ("softmax", False), ("softmax", True)):
        assert torch.autograd.gradcheck(lambda x: ref.route(x, bias, 3, score, 2, 1, renorm, 1.7)[1], (logits,))


# ----------------------------------------------------------------------------------------------------------------
# permute / combine


def random_topk_idx(T: int, E: int, K: int, seed: int) -> torch.Tensor:
    """K distinct experts per token, like a router."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("T,E,K", [(3, 16, 2), (50, 8, 3), (1, 4, 4)])
def test_permute_matches_loops(T, E, K):
    idx = random_topk_idx(T, E, K, seed=T + E)
    perm = ref.permute(idx, E)
    counts = [sum(int(v == e) for v in idx.flatten().tolist()) for e in range(E)]
    assert perm.counts_E.tolist() == counts
    assert perm.offs_E.dtype == torch.int32
    assert perm.offs_E.tolist() == [sum(counts[: e + 1]) for e in range(E)]
    # rows grouped by expert, token order inside each expert (stable)
    expect_rows = [(t, k) for e in range(E) for t in range(T) for k in range(K) if int(idx[t, k]) == e]
    assert [(int(o) // K, int(o) % K) for o in perm.order_N] == expect_rows
    assert perm.token_ids_N.tolist() == [t for t, _ in expect_rows]
    assert torch.equal(perm.order_N[perm.inverse_N], torch.arange(T * K))
    if T * K < E:
        assert 0 in counts  # the case really has empty experts


def test_unpermute_combine_matches_loop_and_grads():
    T, E, K, D = 11, 6, 3, 5
    idx = random_topk_idx(T, E, K, seed=5)
    perm = ref.permute(idx, E)
    g = torch.Generator().manual_seed(6)
    y_sorted = torch.randn(T * K, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True)
    out = ref.unpermute_combine(y_sorted, perm, w)

    expect = []
    for t in range(T):
        acc = torch.zeros(D, dtype=torch.float64)
        for k in range(K):
            row = int((perm.order_N == t * K + k).nonzero())
            acc = acc + w[t, k] * y_sorted[row]
        expect.append(acc)
    expect = torch.stack(expect)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-14)
    R = torch.randn(T, D, generator=g, dtype=torch.float64)
    g_out = torch.autograd.grad((out * R).sum(), (y_sorted, w))
    g_ref = torch.autograd.grad((expect * R).sum(), (y_sorted, w))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # bf16 rows: the sum runs in fp32 and the result comes back in bf16
    out16 = ref.unpermute_combine(y_sorted.detach().bfloat16(), perm, w.detach().float())
    assert out16.dtype == torch.bfloat16 and rel_err(out16, expect.detach()) < 1e-2


# ----------------------------------------------------------------------------------------------------------------
# grouped GEMM


def per_expert_matmul(x, w, counts):
    """fp64 ground truth from explicit per-expert slices; rows past the last group are zero."""
    out, start = torch.zeros(x.shape[0], w.shape[-1], dtype=torch.float64), 0
    for e, c in enumerate(counts):
        out[start:start + c] = x[start:start + c].double() @ w[e].double()
        start += c
    return out


COUNT_CASES = {
    "balanced": [4, 5, 3, 4, 4, 5],
    "empty_groups": [0, 7, 0, 0, 3, 0],
    "one_hot_expert": [0, 0, 0, 40, 0, 0],
    "all_empty": [0, 0, 0, 0, 0, 0],
    "first_and_last": [9, 0, 0, 0, 0, 2],
}


def make_gmm_inputs(counts, tail=0, D=12, F=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = sum(counts) + tail
    x = torch.randn(N, D, generator=g, requires_grad=True)
    # w given as the transposed view of an [E, F, D] parameter, the layout the Experts module passes
    w_param = torch.randn(len(counts), F, D, generator=g, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w_param, offs


def padded_tight(x, w, offs):
    return ref.grouped_mm_padded(x, w, offs, int(torch.diff(offs, prepend=offs.new_zeros(1)).max()))


GMM_FNS = {
    "torch_backend": ref.grouped_mm,
    "loop": ref.grouped_mm_loop,
    "padded": padded_tight,
    "padded_extra_cap": lambda x, w, offs: ref.grouped_mm_padded(x, w, offs, 50),
    "dispatch_reference": lambda x, w, offs: moe_ops.grouped_mm(x, w, offs, backend="reference"),
}


@pytest.mark.parametrize("fn_name", list(GMM_FNS))
@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_grouped_mm_matches_per_expert_matmul(fn_name, case):
    counts = COUNT_CASES[case]
    x, w_param, offs = make_gmm_inputs(counts, seed=len(case))
    w = w_param.transpose(1, 2)
    out = GMM_FNS[fn_name](x, w, offs)
    expect = per_expert_matmul(x, w, counts)
    assert out.shape == expect.shape and out.dtype == torch.float32
    if sum(counts) == 0:
        assert out.shape[0] == 0
        return
    assert rel_err(out, expect) < 1e-6
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    gx, gw = torch.autograd.grad((out * R).sum(), (x, w_param))
    x64, w64 = x.detach().double().requires_grad_(), w_param.detach().double().requires_grad_()
    ex64 = per_expert_matmul_diff(x64, w64.transpose(1, 2), counts)
    ggx, ggw = torch.autograd.grad((ex64 * R.double()).sum(), (x64, w64))
    assert rel_err(gx, ggx) < 1e-6
    assert rel_err(gw, ggw) < 1e-6
    # empty experts get exactly zero weight gradient
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(gw[e]) == 0


def per_expert_matmul_diff(x, w, counts):
    pieces, start = [], 0
    for e, c in enumerate(counts):
        pieces.append(x[start:start + c] @ w[e])
        start += c
    return torch.cat(pieces)


@pytest.mark.parametrize("fn_name", ["torch_backend", "loop", "padded"])
def test_grouped_mm_rows_past_last_group_are_zero(fn_name):
    counts = [3, 0, 2]
    x, w_param, offs = make_gmm_inputs(counts, tail=4, seed=11)
    out = GMM_FNS[fn_name](x, w_param.transpose(1, 2), offs)
    assert out.shape == (9, w_param.shape[1])
    assert rel_err(out[:5], per_expert_matmul(x, w_param.transpose(1, 2), counts)[:5]) < 1e-6
    assert torch.count_nonzero(out[5:]) == 0


def test_grouped_mm_torch_backend_chooses_padded_or_loop(monkeypatch):
    calls = []
    monkeypatch.setattr(ref, "grouped_mm_padded", lambda *a: calls.append("padded") or torch.zeros(0))
    monkeypatch.setattr(ref, "grouped_mm_loop", lambda *a: calls.append("loop") or torch.zeros(0))
    for case in ("balanced", "one_hot_expert"):
        x, w_param, offs = make_gmm_inputs(COUNT_CASES[case])
        ref.grouped_mm(x, w_param.transpose(1, 2), offs)
    assert calls == ["padded", "loop"]


def test_grouped_mm_autocast_bf16_cpu():
    counts = COUNT_CASES["empty_groups"]
    x, w_param, offs = make_gmm_inputs(counts, D=16, F=8, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref.grouped_mm(x, w_param.transpose(1, 2), offs)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, per_expert_matmul(x, w_param.transpose(1, 2), counts)) < 2e-2
    out.float().sum().backward()
    assert x.grad is not None and w_param.grad is not None and w_param.grad.dtype == torch.float32


def test_native_grouped_mm_layout_on_cpu_forward():
    """The native kernel's forward runs on CPU fp32 (its backward does not): it checks our operand convention."""
    counts = COUNT_CASES["empty_groups"]
    x, w_param, offs = make_gmm_inputs(counts, D=16, F=8, seed=3)
    assert not ref.native_grouped_mm_supported(x, w_param.transpose(1, 2))  # CPU never takes the native path
    if ref._NATIVE_GROUPED_MM is None:
        pytest.skip("this torch has no grouped_mm")
    with torch.no_grad():
        try:
            out = ref.grouped_mm_native(x, w_param.transpose(1, 2), offs)
        except RuntimeError as e:  # a CPU build without the kernel
            pytest.skip(f"native grouped_mm unavailable on CPU: {e}")
    assert rel_err(out, per_expert_matmul(x, w_param.transpose(1, 2), counts)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["balanced", "empty_groups", "one_hot_expert"])
def test_grouped_mm_native_cuda_bf16(case):
    counts = [c * 3 + (1 if c else 0) for c in COUNT_CASES[case]]  # group sizes not multiples of 8
    x, w_param, offs = make_gmm_inputs(counts, D=64, F=128, seed=4)
    x = x.detach().cuda().bfloat16().requires_grad_()
    w_param = w_param.detach().cuda().bfloat16().requires_grad_()
    offs = offs.cuda()
    w = w_param.transpose(1, 2)
    assert ref.native_grouped_mm_supported(x, w)
    out = ref.grouped_mm(x, w, offs)
    expect = per_expert_matmul(x.float().cpu(), w.float().cpu(), counts)
    assert rel_err(out.float().cpu(), expect) < 1e-2
    R = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad((out.float() * R.float()).sum(), (x, w_param))
    lx, lw = x.detach().float().requires_grad_(), w_param.detach().float().requires_grad_()
    lout = ref.grouped_mm_loop(lx, lw.transpose(1, 2), offs)
    ggx, ggw = torch.autograd.grad((lout * R.float()).sum(), (lx, lw))
    assert rel_err(gx.float(), ggx) < 1e-2 and rel_err(gw.float(), ggw) < 1e-2


# ----------------------------------------------------------------------------------------------------------------
# the loop reference itself, and the backend registry


def test_moe_loop_reference_matches_per_token_loop():
    T, E, K, D, I = 7, 5, 2, 6, 4
    g = torch.Generator().manual_seed(8)
    idx = random_topk_idx(T, E, K, seed=8)
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, 2 * I, D, generator=g, dtype=torch.float64)
    wd = torch.randn(E, D, I, generator=g, dtype=torch.float64)

    def act(a, b):
        return torch.nn.functional.silu(a) * b

    out = ref.moe_loop_reference(h, idx, w, wgu, wd, act)
    for t in range(T):
        acc = torch.zeros(D, dtype=torch.float64)
        for k in range(K):
            e = int(idx[t, k])
            gate, up = wgu[e, :I] @ h[t], wgu[e, I:] @ h[t]
            acc += w[t, k] * (wd[e] @ act(gate, up))
        torch.testing.assert_close(out[t], acc, rtol=1e-12, atol=1e-12)


class _Fake(Backend):
    name = "fake"

    def __init__(self, runs: bool):
        self.runs, self.calls = runs, []

    def unavailable(self, device):
        return None if self.runs else "not installed"

    def prefers(self, device):
        return True

    def fn(self, x, w, offs, table=None):
        self.calls.append(x.shape)
        return ref.grouped_mm_loop(x, w, offs)


def test_backend_registry():
    cpu = torch.empty(0, 4)
    assert moe_ops.resolve_backend(None, cpu) == "torch"
    assert moe_ops.resolve_backend("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="unknown MoE grouped GEMM backend 'nope'"):
        moe_ops.resolve_backend("nope", cpu)
    saved = dict(moe_ops.REGISTRY._backends)
    try:
        moe_ops.REGISTRY.register(_Fake(runs=False), first=True)
        assert moe_ops.resolve_backend(None, cpu) == "torch"  # unavailable: skipped by auto-selection ...
        with pytest.raises(ValueError, match="cannot run this call: not installed"):
            moe_ops.resolve_backend("fake", cpu)  # ... and refused when asked for
        fake = _Fake(runs=True)
        moe_ops.REGISTRY.register(fake, first=True)
        assert moe_ops.resolve_backend(None, cpu) == "fake"  # first of the order
        x, w_param, offs = make_gmm_inputs(COUNT_CASES["balanced"])
        moe_ops.grouped_mm(x, w_param.transpose(1, 2), offs)
        assert fake.calls == [x.shape]
    finally:
        moe_ops.REGISTRY._backends.clear()
        moe_ops.REGISTRY._backends.update(saved)
