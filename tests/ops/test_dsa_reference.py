"""DSA reference ops vs loop-clear brute force; gradients by gradcheck; the dispatcher's selection rules."""

from __future__ import annotations

import math

import pytest
import torch

from moestack.ops import dsa as dsa_ops
from moestack.ops.backends import Backend
from moestack.ops.dsa import reference as ref

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _indexer_inputs(B=2, T=11, Hi=3, Di=5, seed=0, dtype=F64):
    g = _gen(seed)
    q = torch.randn(B, T, Hi, Di, generator=g, dtype=dtype)
    k = torch.randn(B, T, Di, generator=g, dtype=dtype)
    w = torch.randn(B, T, Hi, generator=g, dtype=dtype)
    return q, k, w


def _visible(t: int, s: int, doc: list[int] | None) -> bool:
    return s <= t and (doc is None or doc[s] == doc[t])


def _docs(cu: list[int], T: int) -> list[int]:
    return [max(i for i in range(len(cu) - 1) if cu[i] <= t) for t in range(T)]


def _random_causal_idx(B, T, K, seed, doc=None):
    """A random selection per query among its visible keys, -1 padded, in random slot order."""
    g = _gen(seed)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            vis = [s for s in range(T) if _visible(t, s, doc)]
            n = int(torch.randint(1, min(K, len(vis)) + 1, (1,), generator=g))
            pick = [vis[i] for i in torch.randperm(len(vis), generator=g)[:n].tolist()]
            slots = torch.randperm(K, generator=g)[:n]
            idx[b, t, slots] = torch.tensor(pick, dtype=torch.int32)
    return idx


# ------------------------------------------------------------------------------------------------ indexer


@pytest.mark.parametrize("cu", [None, [0, 4, 11]])
def test_indexer_scores_match_loop(cu):
    q, k, w = _indexer_inputs()
    B, T, Hi, _ = q.shape
    cu_t = None if cu is None else torch.tensor(cu)
    doc = None if cu is None else _docs(cu, T)
    got = ref.indexer_scores(q, k, w, cu_t)
    assert got.dtype == F64 and got.shape == (B, T, T)
    for b in range(B):
        for t in range(T):
            for s in range(T):
                if not _visible(t, s, doc):
                    assert got[b, t, s] == float("-inf")
                    continue
                want = sum(float(w[b, t, j]) * max(0.0, float(q[b, t, j] @ k[b, s])) for j in range(Hi))
                assert math.isclose(float(got[b, t, s]), want, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("cu", [None, [0, 3, 9, 14]])
def test_topk_matches_bruteforce_with_padding(cu):
    T, K = 14, 5
    q, k, w = _indexer_inputs(T=T, seed=1)
    cu_t = None if cu is None else torch.tensor(cu)
    doc = None if cu is None else _docs(cu, T)
    scores = ref.indexer_scores(q, k, w, cu_t)
    idx = ref.indexer_topk(scores, K)
    assert idx.dtype == torch.int32 and idx.shape == (2, T, K)
    for b in range(2):
        for t in range(T):
            vis = [s for s in range(T) if _visible(t, s, doc)]
            want = sorted((float(scores[b, t, s]) for s in vis), reverse=True)[:K]
            row = idx[b, t].tolist()
            chosen = [s for s in row if s >= 0]
            assert len(set(chosen)) == len(chosen) and set(chosen) <= set(vis)
            # equal score multisets: the same set up to ties (ReLU makes exact-zero scores common)
            assert sorted((float(scores[b, t, s]) for s in chosen), reverse=True) == want
            assert row.count(-1) == K - len(want)  # early queries see fewer than K keys


def test_topk_wider_than_sequence_pads():
    q, k, w = _indexer_inputs(T=4, seed=2)
    idx = ref.indexer_topk(ref.indexer_scores(q, k, w), 7)
    assert idx.shape == (2, 4, 7)
    for t in range(4):
        assert sorted(s for s in idx[0, t].tolist() if s >= 0) == list(range(t + 1))
        assert (idx[:, t] == -1).sum(-1).tolist() == [7 - (t + 1)] * 2


@pytest.mark.parametrize("cu", [None, [0, 5, 6, 13]])
def test_topk_from_inputs_blockwise_equals_full(cu):
    T, K = 13, 4
    q, k, w = _indexer_inputs(T=T, Hi=2, seed=3)
    cu_t = None if cu is None else torch.tensor(cu)
    scores = ref.indexer_scores(q, k, w, cu_t)
    full = ref.indexer_topk(scores, K)

    def picked(idx):  # selected scores per row, sorted (equal up to ties), -inf for -1 slots
        vals = scores.gather(-1, idx.long().clamp_min(0)).masked_fill(idx < 0, float("-inf"))
        return vals.sort(-1, descending=True).values

    for block_bytes in (1, 2 * T * 4 * 4 * 3, 1 << 30):  # 1 row, 3 rows,, everything at once
        got = ref.indexer_topk_from_inputs(q, k, w, K, cu_seqlens=cu_t, max_block_bytes=block_bytes)
        assert got.dtype == torch.int32 and torch.equal((got < 0).sum(-1), (full < 0).sum(-1))
        torch.testing.assert_close(picked(got), picked(full), rtol=0, atol=0)
    via_dispatch = dsa_ops.indexer_topk_from_inputs(q, k, w, K, cu_seqlens=cu_t)
    torch.testing.assert_close(picked(via_dispatch), picked(full), rtol=0, atol=0)


def test_indexer_scores_at_equals_gather_incl_blockwise_grads():
    q, k, w = (t.requires_grad_(True) for t in _indexer_inputs(T=9, seed=4))
    idx = _random_causal_idx(2, 9, 4, seed=5)
    full = ref.indexer_scores(q, k, w)
    got = ref.indexer_scores_at(q, k, w, idx)
    want = full.gather(-1, idx.long().clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    assert torch.equal(got == float("-inf"), idx < 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dI = torch.randn(got.shape, generator=_gen(6), dtype=F64).masked_fill(idx < 0, 0.0)
    g_want = torch.autograd.grad((got.masked_fill(idx < 0, 0.0) * dI).sum(), (q, k, w))
    one_row = 2 * 4 * (5 + 2 * 3) * 4
    blk = ref.indexer_scores_at_blockwise(q, k, w, idx, max_block_bytes=2 * one_row)  # 2 rows per block
    torch.testing.assert_close(blk, got, rtol=1e-12, atol=1e-12)
    g_blk = torch.autograd.grad((blk.masked_fill(idx < 0, 0.0) * dI).sum(), (q, k, w))
    for a, b in zip(g_blk, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ attention


def _attn_inputs(B=2, T=10, H=3, D=7, seed=0, dtype=F64, requires_grad=False):
    g = _gen(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype).requires_grad_(requires_grad)
    kv = torch.randn(B, T, D, generator=g, dtype=dtype).requires_grad_(requires_grad)
    return q, kv


def _loop_sparse(q, kv, idx, v_dim, scale):
    """Gather-then-softmax per (b, t, h) with Python loops: the plainest statement of sparse MQA attention."""
    B, T, H, _ = q.shape
    o = torch.zeros(B, T, H, v_dim, dtype=F64)
    lse = torch.zeros(B, T, H, dtype=F64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in idx[b, t].tolist() if s >= 0]
            for h in range(H):
                logits = [scale * float(q[b, t, h] @ kv[b, s]) for s in keys]
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                lse[b, t, h] = m + math.log(z)
                for x, s in zip(logits, keys):
                    o[b, t, h] += math.exp(x - m) / z * kv[b, s, :v_dim]
    return o, lse


def test_sparse_attention_matches_loop():
    B, T, H, D, V, K = 2, 9, 3, 7, 4, 4
    q, kv = _attn_inputs(B, T, H, D, seed=6)
    idx = _random_causal_idx(B, T, K, seed=7)
    o, lse = ref.sparse_mqa_attention(q, kv, idx, V, 0.37)
    o_ref, lse_ref = _loop_sparse(q, kv, idx, V, 0.37)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cu", [None, [0, 6, 11]])
@pytest.mark.parametrize("top_k", [11, 16])
def test_sparse_equals_dense_when_all_keys_selected(cu, top_k):
    B = 1 if cu else 2
    T, V = 11, 5
    q, kv = _attn_inputs(B, T, 4, 8, seed=8)
    qi, ki, wi = _indexer_inputs(B, T, seed=9)
    cu_t = None if cu is None else torch.tensor(cu)
    idx = ref.indexer_topk(ref.indexer_scores(qi, ki, wi, cu_t), top_k)
    o_s, lse_s = ref.sparse_mqa_attention(q, kv, idx, V, 0.3)
    o_d, lse_d = ref.dense_mqa_attention(q, kv, V, 0.3, cu_t)
    torch.testing.assert_close(o_s, o_d, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse_s, lse_d, rtol=1e-10, atol=1e-10)


def test_dense_attention_matches_loop():
    q, kv = _attn_inputs(1, 8, 2, 6, seed=10)
    all_keys = torch.tensor([[[s if s <= t else -1 for s in range(8)] for t in range(8)]], dtype=torch.int32)
    o, lse = ref.dense_mqa_attention(q, kv, 3, 0.5)
    o_ref, lse_ref = _loop_sparse(q, kv, all_keys, 3, 0.5)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_sparse_attention_gradcheck():
    q, kv = _attn_inputs(1, 5, 2, 4, seed=11, requires_grad=True)
    idx = _random_causal_idx(1, 5, 3, seed=12)
    assert torch.autograd.gradcheck(lambda a, b: ref.sparse_mqa_attention(a, b, idx, 3, 0.6), (q, kv))


def test_dense_attention_gradcheck():
    q, kv = _attn_inputs(1, 5, 2, 4, seed=13, requires_grad=True)
    cu = torch.tensor([0, 2, 5])
    assert torch.autograd.gradcheck(lambda a, b: ref.dense_mqa_attention(a, b, 3, 0.6, cu), (q, kv))


def test_blockwise_sparse_attention_equals_direct_with_grads():
    B, T, H, D, V, K = 2, 12, 3, 6, 4, 5
    q, kv = _attn_inputs(B, T, H, D, seed=14, requires_grad=True)
    idx = _random_causal_idx(B, T, K, seed=15)
    g = _gen(16)
    do, dlse = torch.randn(B, T, H, V, generator=g, dtype=F64), torch.randn(B, T, H, generator=g, dtype=F64)
    o, lse = ref.sparse_mqa_attention(q, kv, idx, V, 0.4)
    want = torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), (q, kv))
    one_row = B * K * (D + 2 * H) * 4
    for block_bytes in (one_row, 5 * one_row):  # T not a multiple of the block
        ob, lseb = ref.sparse_mqa_attention_blockwise(q, kv, idx, V, 0.4, max_block_bytes=block_bytes)
        got = torch.autograd.grad((ob * do).sum() + (lseb * dlse).sum(), (q, kv))
        torch.testing.assert_close(ob, o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lseb, lse, rtol=1e-12, atol=1e-12)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sparse_attention_under_bf16_autocast_keeps_fp32_math():
    q, kv = _attn_inputs(2, 16, 4, 32, seed=17, dtype=torch.float32)
    idx = _random_causal_idx(2, 16, 6, seed=18)
    o32, lse32 = ref.sparse_mqa_attention(q, kv, idx, 16, 32**-0.5)
    with torch.autocast("cpu", torch.bfloat16):
        o, lse = ref.sparse_mqa_attention(q.bfloat16(), kv.bfloat16(), idx, 16, 32**-0.5)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), o32, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(lse, lse32, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------ KL target & loss


def _probs_loop(q, kv, scale, keys_of):
    """Head-mean of per-head softmax over keys_of(b, t) -> dict {(b, t): {s: p}}."""
    B, T, H, _ = q.shape
    out = {}
    for b in range(B):
        for t in range(T):
            keys = keys_of(b, t)
            acc = dict.fromkeys(keys, 0.0)
            for h in range(H):
                logits = torch.stack([scale * (q[b, t, h] @ kv[b, s]) for s in keys])
                for s, p in zip(keys, torch.softmax(logits, 0).tolist()):
                    acc[s] += p / H
            out[(b, t)] = acc
    return out


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("block_bytes", [1, 1 << 30])  # one query row per block / all rows at once
def test_attention_probs_target_dense_and_sparse(with_lse, block_bytes):
    B, T, H, D, V, K = 2, 8, 3, 6, 4, 3
    q, kv = _attn_inputs(B, T, H, D, seed=19)
    cu = torch.tensor([0, 3, 8])
    qb, kvb = q[:1], kv[:1]
    _, lse_d = ref.dense_mqa_attention(qb, kvb, V, 0.5, cu)
    lse_d = lse_d if with_lse else None
    p_d = ref.attention_probs_target(qb, kvb, 0.5, lse=lse_d, cu_seqlens=cu, max_block_bytes=block_bytes)
    doc = _docs([0, 3, 8], T)
    want = _probs_loop(qb, kvb, 0.5, lambda b, t: [s for s in range(T) if _visible(t, s, doc)])
    for (b, t), row in want.items():
        for s in range(T):
            assert math.isclose(float(p_d[b, t, s]), row.get(s, 0.0), rel_tol=1e-10, abs_tol=1e-12)

    idx = _random_causal_idx(B, T, K, seed=20)
    _, lse_s = ref.sparse_mqa_attention(q, kv, idx, V, 0.5)
    lse_s = lse_s if with_lse else None
    p_s = ref.attention_probs_target(q, kv, 0.5, lse=lse_s, idx=idx, max_block_bytes=block_bytes)
    want = _probs_loop(q, kv, 0.5, lambda b, t: [s for s in idx[b, t].tolist() if s >= 0])
    for b in range(B):
        for t in range(T):
            for slot, s in enumerate(idx[b, t].tolist()):
                expect = 0.0 if s < 0 else want[(b, t)][s]
                assert math.isclose(float(p_s[b, t, slot]), expect, rel_tol=1e-10, abs_tol=1e-12)


def _kl_loop(scores, p):
    """mean over rows of sum_s p log(p / softmax(scores)) over finite scores."""
    total, rows = 0.0, 0
    for row_i, row_p in zip(scores.reshape(-1, scores.shape[-1]), p.reshape(-1, p.shape[-1])):
        keep = [j for j in range(len(row_i)) if row_i[j] != float("-inf")]
        m = max(float(row_i[j]) for j in keep)
        log_z = m + math.log(sum(math.exp(float(row_i[j]) - m) for j in keep))
        for j in keep:
            pj = float(row_p[j])
            if pj > 0:
                total += pj * (math.log(pj) - (float(row_i[j]) - log_z))
        rows += 1
    return total / rows


def _dense_kl_case(seed=21, T=7):
    qi, ki, wi = _indexer_inputs(1, T, seed=seed)
    scores = ref.indexer_scores(qi, ki, wi)
    q, kv = _attn_inputs(1, T, 2, 5, seed=seed + 1)
    p = ref.attention_probs_target(q, kv, 0.5)
    return scores, p


def test_kl_loss_matches_loop_and_is_zero_only_at_the_target():
    scores, p = _dense_kl_case()
    kl = ref.indexer_kl_loss(scores, p)
    assert math.isclose(float(kl), _kl_loop(scores, p), rel_tol=1e-10)
    assert float(kl) > 1e-3
    own = torch.softmax(scores, -1)  # the indexer's own distribution
    assert abs(float(ref.indexer_kl_loss(scores, own))) < 1e-12
    assert abs(float(ref.indexer_kl_loss(torch.log(p).masked_fill(p == 0, float("-inf")), p))) < 1e-12


def test_kl_sparse_mode_restricts_both_distributions():
    T, K = 9, 4
    scores, p = _dense_kl_case(seed=23, T=T)
    idx = _random_causal_idx(1, T, K, seed=24)
    got = ref.indexer_kl_loss(scores, p, idx)
    sel_scores = scores.gather(-1, idx.long().clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    sel_p = p.gather(-1, idx.long().clamp_min(0)).masked_fill(idx < 0, 0.0)
    sel_p = sel_p / sel_p.sum(-1, keepdim=True)
    assert math.isclose(float(got), _kl_loop(sel_scores, sel_p), rel_tol=1e-10)
    # selecting every visible key reproduces dense mode
    all_idx = ref.indexer_topk(scores, T + 2)
    assert math.isclose(float(ref.indexer_kl_loss(scores, p, all_idx)), float(ref.indexer_kl_loss(scores, p)),
                        rel_tol=1e-12)
    assert math.isclose(float(dsa_ops.indexer_kl_loss(scores, p, idx)), float(got), rel_tol=1e-12)


def test_kl_loss_gradcheck_dense_and_sparse():
    scores, p = _dense_kl_case(seed=25, T=5)
    scores = scores.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: ref.indexer_kl_loss(s, p), (scores,))
    idx = _random_causal_idx(1, 5, 3, seed=26)
    assert torch.autograd.gradcheck(lambda s: ref.indexer_kl_loss(s, p, idx), (scores,))
    # p is a constant: no gradient reaches it
    p_leaf = p.clone().requires_grad_(True)
    ref.indexer_kl_loss(scores, p_leaf).backward()
    assert p_leaf.grad is None and torch.isfinite(scores.grad).all()


def test_kl_loss_gradient_flows_to_indexer_inputs():
    qi, ki, wi = (t.requires_grad_(True) for t in _indexer_inputs(1, 5, Hi=2, Di=3, seed=27))
    q, kv = _attn_inputs(1, 5, 2, 4, seed=28)
    p = ref.attention_probs_target(q, kv, 0.5)
    assert torch.autograd.gradcheck(lambda a, b, c: ref.indexer_kl_loss(ref.indexer_scores(a, b, c), p),
                                    (qi, ki, wi))


# ------------------------------------------------------------------------------------------------ dispatcher


@pytest.fixture
def registry():
    """A private copy of the backend registries so test registrations never leak."""
    saved = {op: dict(r._backends) for op, r in dsa_ops.REGISTRIES.items()}
    yield
    for op, r in dsa_ops.REGISTRIES.items():
        r._backends.clear()
        r._backends.update(saved[op])


class _Fake(Backend):
    name = "triton"

    def __init__(self, on_cpu: bool):
        self.on_cpu, self.calls = on_cpu, []

    def unavailable(self, device):
        return None if self.on_cpu or device.type == "cuda" else "CUDA only"

    def prefers(self, device):
        return True

    def fn(self, q, kv, idx, v_dim, scale):
        self.calls.append("fake")
        return ref.sparse_mqa_attention(q, kv, idx, v_dim, scale)


def test_dispatcher_defaults_to_reference(registry):
    q, kv = _attn_inputs(1, 6, 2, 4, seed=29)
    for op in dsa_ops.OPS:
        assert dsa_ops.select_backend(op, q) == "reference"
    idx = _random_causal_idx(1, 6, 3, seed=30)
    o, lse = dsa_ops.sparse_mqa_attention(q, kv, idx, 3, 0.5)
    o_ref, lse_ref = ref.sparse_mqa_attention(q, kv, idx, 3, 0.5)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_dispatcher_preference_and_explicit(registry):
    q, kv = _attn_inputs(1, 6, 2, 4, seed=31)
    idx = _random_causal_idx(1, 6, 3, seed=32)
    dsa_ops.register_backend("sparse_mqa_attention", _Fake(on_cpu=False))  # cannot run on CPU
    assert dsa_ops.select_backend("sparse_mqa_attention", q) == "reference"
    with pytest.raises(ValueError, match="cannot run this call: CUDA only"):
        dsa_ops.sparse_mqa_attention(q, kv, idx, 3, 0.5, backend="triton")
    # a named backend without this op falls back to the op's own choice
    assert dsa_ops.select_backend("indexer_kl_loss", q, "triton") == "reference"

    fake = _Fake(on_cpu=True)  # now runs everywhere: preferred over reference
    dsa_ops.register_backend("sparse_mqa_attention", fake)
    dsa_ops.sparse_mqa_attention(q, kv, idx, 3, 0.5)
    assert fake.calls == ["fake"]
    dsa_ops.sparse_mqa_attention(q, kv, idx, 3, 0.5, backend="reference")  # explicit beats preference
    assert fake.calls == ["fake"]


def test_dispatcher_rejects_unknown_names(registry):
    q, _ = _attn_inputs(1, 4, 1, 2, seed=33)
    with pytest.raises(ValueError, match="not registered"):
        dsa_ops.select_backend("sparse_mqa_attention", q, "cutlass")
    with pytest.raises(ValueError, match="unknown DSA op"):
        dsa_ops.register_backend("flash", _Fake(True))
