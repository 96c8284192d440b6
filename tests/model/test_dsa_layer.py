"""GatedMLA (Gated MLA / DSA layer) vs a per-head loop reference; gradient isolation of the indexer; packing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moestack.config.model_spec import IndexerSpec, MLASpec, load_model_spec
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.dsa import GatedMLA
from moestack.ops import dsa as dsa_ops
from moestack.ops.dsa import reference as ref

F64 = torch.float64
D = 16


def _spec(indexer=True, q_lora=12, use_rope=False, gate=True, top_k=4, indexer_heads=2) -> MLASpec:
    return MLASpec(
        num_heads=3,
        q_lora_rank=q_lora,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        use_rope=use_rope,
        output_gate=gate,
        indexer=IndexerSpec(num_heads=indexer_heads, head_dim=8, top_k=top_k) if indexer else None,
    )


def _layer(seed=0, **kw) -> GatedMLA:
    torch.manual_seed(seed)
    m = GatedMLA(D, _spec(**kw), 1e-5).to(F64)
    m.init_weights(0.3)
    with torch.no_grad():  # non-trivial norm weights so a skipped norm cannot pass
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return m


def _x(B=2, T=12, seed=1, requires_grad=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=F64).requires_grad_(requires_grad)


# ------------------------------------------------------------------------------------------------ naive reference


def _rms(x, norm):
    """The layer's own RMSNorm module: it computes in fp32 even for fp64 inputs (by design), so a re-derivation in
    fp64 would differ at 1e-7; the norm itself is tested with moestack.model.norm."""
    return norm(x)


def _rot_interleaved(x, pos, theta):
    """Rotate pairs (2i, 2i+1) of x [..., T, (H,) R] by pos * theta^(-2i/R) using complex numbers."""
    R = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, R, 2, dtype=F64) / R)  # [T, R/2]
    if x.dim() == 4:
        ang = ang[:, None]
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(ang), ang)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def _positions(T, cu):
    if cu is None:
        return torch.arange(T)
    return torch.tensor([t - max(c for c in cu if c <= t) for t in range(T)])


def _naive_indexer(m, x, q_lat, pos):
    ix = m.indexer
    B, T, _ = x.shape
    q = (q_lat @ ix.wq.weight.T).view(B, T, ix.num_heads, ix.head_dim)
    k = F.layer_norm(x @ ix.wk.weight.T, (ix.head_dim,), ix.k_norm.weight, ix.k_norm.bias, 1e-6)
    if ix.rope_dim:
        r = ix.rope_dim
        q = torch.cat((_rot_interleaved(q[..., :r], pos, m.spec.rope_theta), q[..., r:]), -1)
        k = torch.cat((_rot_interleaved(k[..., :r], pos, m.spec.rope_theta), k[..., r:]), -1)
    w = (x @ ix.weights_proj.weight.T) / math.sqrt(ix.num_heads * ix.head_dim)
    return q, k, w


def naive_gated_mla(m: GatedMLA, x, cu=None, idx=None):
    """Per-head, per-query loops over the decompressed MLA -> (y, naive indexer scores [B,T,T], head-mean probs p).

    idx None: dense causal attention; idx [B,T,K]: each query attends only to its selected keys (-1 = none).
    """
    s = m.spec
    B, T, _ = x.shape
    H, N, R, C, V = s.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank, s.v_head_dim
    if s.q_lora_rank:
        q_lat = _rms(x @ m.q_a_proj.weight.T, m.q_a_norm)
        q = (q_lat @ m.q_b_proj.weight.T).view(B, T, H, N + R)
    else:
        q_lat = x
        q = (x @ m.q_proj.weight.T).view(B, T, H, N + R)
    kva = x @ m.kv_a_proj.weight.T
    c = _rms(kva[..., :C], m.kv_a_norm)
    k_rope = kva[..., C:]
    kvb = (c @ m.kv_b_proj.weight.T).view(B, T, H, N + V)
    k_nope, v = kvb[..., :N], kvb[..., N:]
    pos = _positions(T, cu)
    q_rope = q[..., N:]
    if s.use_rope:
        q_rope = _rot_interleaved(q_rope, pos, s.rope_theta)
        k_rope = _rot_interleaved(k_rope, pos, s.rope_theta)
    doc = None if cu is None else [max(i for i in range(len(cu) - 1) if cu[i] <= t) for t in range(T)]

    scores = None
    if m.indexer is not None:
        qi, ki, wi = _naive_indexer(m, x, q_lat, pos)
        scores = torch.full((B, T, T), float("-inf"), dtype=F64)
        for b in range(B):
            for t in range(T):
                for u in range(T):
                    if u <= t and (doc is None or doc[u] == doc[t]):
                        scores[b, t, u] = (wi[b, t] * torch.relu(qi[b, t] @ ki[b, u])).sum()
    o = torch.zeros(B, T, H, V, dtype=F64)
    p_mean = torch.zeros(B, T, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            keys = [u for u in range(T) if u <= t and (doc is None or doc[u] == doc[t])]
            if idx is not None:
                keys = [u for u in idx[b, t].tolist() if u >= 0]
            keys_t = torch.tensor(keys)
            for h in range(H):
                logits = k_nope[b, keys_t, h] @ q[b, t, h, :N] + k_rope[b, keys_t] @ q_rope[b, t, h]
                p = torch.softmax(logits * s.softmax_scale, 0)
                o[b, t, h] = p @ v[b, keys_t, h]
                p_mean[b, t, keys_t] += p / H
    if m.g_proj is not None:
        o = o * torch.sigmoid(x @ m.g_proj.weight.T).view(B, T, H, V)
    y = o.reshape(B, T, H * V) @ m.o_proj.weight.T
    return y, scores, p_mean


def _naive_kl(scores, p):
    """Mean over queries of KL(p || softmax over the keys where p > 0 ... restricted to p's support set)."""
    support = p > 0
    I = scores.masked_fill(~support, float("-inf"))
    log_q = torch.log_softmax(I, -1)
    return torch.where(support, p * (torch.log(p) - log_q), torch.zeros_like(p)).sum(-1).mean()


@pytest.fixture
def selections(monkeypatch):
    """Records every top-k selection the layer makes (so the naive reference can attend to the same keys)."""
    seen = []
    real = dsa_ops.indexer_topk_from_inputs

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(dsa_ops, "indexer_topk_from_inputs", spy)
    return seen


def _assert_is_topk(idx, scores, top_k):
    """idx holds top_k keys of the naive scores up to ties: equal selected-score multisets and equal -1 counts."""
    want = ref.indexer_topk(scores, top_k)

    def picked(i):
        vals = scores.detach().gather(-1, i.long().clamp_min(0)).masked_fill(i < 0, float("-inf"))
        return vals.sort(-1, descending=True).values

    assert torch.equal((idx < 0).sum(-1), (want < 0).sum(-1))
    torch.testing.assert_close(picked(idx), picked(want), rtol=1e-12, atol=1e-12)


def _assert_no_boundary_ties(scores, top_k):
    """Precondition for comparing two runs' selections: the top_k-th and next visible scores differ in every row."""
    vals = scores.detach().sort(-1, descending=True).values
    if vals.shape[-1] > top_k:
        kth, nxt = vals[..., top_k - 1], vals[..., top_k]
        assert torch.all((kth - nxt > 1e-9) | (nxt == float("-inf"))), "tie at the top-k boundary: change the seed"


# ------------------------------------------------------------------------------------------------ forward values


@pytest.mark.parametrize(
    "kw",
    [
        dict(indexer=False),
        dict(indexer=False, q_lora=None, gate=False),
        dict(indexer=False, use_rope=True),
    ],
)
def test_no_indexer_matches_naive(kw):
    m = _layer(**kw)
    x = _x()
    y_ref, _, _ = naive_gated_mla(m, x)
    torch.testing.assert_close(m(x), y_ref, rtol=1e-10, atol=1e-12)
    assert m.last_indexer_loss is None


@pytest.mark.parametrize("kw", [dict(), dict(use_rope=True), dict(q_lora=None)])
def test_sparse_mode_matches_naive_output_and_kl(kw, selections):
    m = _layer(**kw)
    x = _x(seed=2)
    y = m(x)
    (idx,) = selections
    y_ref, scores, p = naive_gated_mla(m, x, idx=idx)
    _assert_is_topk(idx, scores, m.indexer.top_k)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.last_indexer_loss, _naive_kl(scores, p), rtol=1e-9, atol=1e-12)
    assert m.last_indexer_loss > 0


@pytest.mark.parametrize("kw", [dict(), dict(use_rope=True)])
def test_dense_mode_matches_naive_output_and_kl(kw):
    m = _layer(**kw)
    m.sparse = False
    x = _x(seed=3)
    y_ref, scores, p = naive_gated_mla(m, x)
    torch.testing.assert_close(m(x), y_ref, rtol=1e-10, atol=1e-12)
    kl = ref.indexer_kl_loss(scores, p)  # dense KL over all causal keys
    torch.testing.assert_close(m.last_indexer_loss, kl, rtol=1e-9, atol=1e-12)
    assert m.last_indexer_loss > 0


@pytest.mark.parametrize("use_rope", [False, True])
def test_sparse_equals_dense_when_top_k_covers_sequence(use_rope):
    T = 12
    for top_k in (T, T + 5):
        m = _layer(use_rope=use_rope, top_k=top_k)
        x = _x(T=T, seed=4)
        y_sparse = m(x)
        kl_sparse = m.last_indexer_loss
        m.sparse = False
        y_dense = m(x)
        torch.testing.assert_close(y_sparse, y_dense, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(kl_sparse, m.last_indexer_loss, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ causality & packing


@pytest.mark.parametrize("mode", ["none", "dense", "sparse"])
def test_causal(mode):
    m = _layer(indexer=mode != "none", use_rope=True, top_k=3)
    m.sparse = mode == "sparse"
    x = _x(T=12, seed=5)
    y = m(x)
    x2 = x.clone()
    x2[:, 7:] += torch.randn_like(x2[:, 7:])
    y2 = m(x2)
    torch.testing.assert_close(y2[:, :7], y[:, :7], rtol=0, atol=1e-13)
    assert (y2[:, 7:] - y[:, 7:]).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["none", "dense", "sparse"])
@pytest.mark.parametrize("use_rope", [False, True])
def test_cu_seqlens_isolates_documents(mode, use_rope, selections):
    m = _layer(indexer=mode != "none", use_rope=use_rope, top_k=3, indexer_heads=8)
    m.sparse = mode == "sparse"
    x = _x(B=1, T=14, seed=6)
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    y = m(x, cu_seqlens=cu)
    idx = selections[0] if selections else None
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(y[:, a:b], m(x[:, a:b]), rtol=1e-10, atol=1e-12)
    y_ref, scores, _ = naive_gated_mla(m, x, cu=cu.tolist(), idx=idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    if idx is not None:
        _assert_is_topk(idx, scores, 3)  # selections respect document boundaries
        _assert_no_boundary_ties(scores, 3)  # so the per-document runs above had to pick the same keys


# ------------------------------------------------------------------------------------------------ gradients


def _main_params(m):
    return {n: p for n, p in m.named_parameters() if not n.startswith("indexer.")}


def _indexer_params(m):
    return {n: p for n, p in m.named_parameters() if n.startswith("indexer.")}


@pytest.mark.parametrize("sparse", [True, False])
def test_main_loss_reaches_every_main_param_but_no_indexer_param(sparse):
    m = _layer(use_rope=True)
    m.sparse = sparse
    m.indexer_loss_coef = 0.0  # main loss only
    x = _x(seed=7, requires_grad=True)
    (m(x) * torch.randn(2, 12, D, dtype=F64)).sum().backward()
    for n, p in _main_params(m).items():
        assert p.grad is not None and p.grad.abs().max() > 0, n
    for n, p in _indexer_params(m).items():
        assert p.grad is None or not p.grad.any(), n


@pytest.mark.parametrize("sparse", [True, False])
def test_kl_loss_reaches_only_indexer_params(sparse):
    m = _layer()
    m.sparse = sparse
    x = _x(seed=8, requires_grad=True)
    y = m(x)
    (y * 0.0).sum().backward()  # no main-loss gradient; the attached KL still backpropagates (scale 1)
    for n, p in _main_params(m).items():
        assert p.grad is None or not p.grad.any(), n
    assert not x.grad.any()  # indexer inputs are detached
    for n, p in _indexer_params(m).items():
        assert p.grad is not None and p.grad.abs().max() > 0, n


def test_attached_kl_gradient_equals_coef_times_kl_gradient(selections):
    m = _layer()
    x = _x(seed=9)
    m.indexer_loss_coef = 2.5
    (m(x) * 0.0).sum().backward()
    got = {n: p.grad.clone() for n, p in _indexer_params(m).items()}
    m.zero_grad(set_to_none=True)
    # the KL written out with the naive indexer and the naive sparse attention target
    _, _, p = naive_gated_mla(m, x, idx=selections[0])
    with torch.no_grad():
        q_lat = _rms(x @ m.q_a_proj.weight.T, m.q_a_norm)
    qi, ki, wi = _naive_indexer(m, x, q_lat, torch.arange(12))
    scores = ref.indexer_scores(qi, ki, wi)
    (2.5 * _naive_kl(scores, p)).backward()
    for n, p_ in _indexer_params(m).items():
        torch.testing.assert_close(got[n], p_.grad, rtol=1e-9, atol=1e-12)


def test_aux_loss_scale_applies_to_kl():
    m = _layer()
    x = _x(seed=10)
    grads = []
    for scale in (1.0, 0.25):
        set_aux_loss_scale(scale)
        try:
            m.zero_grad(set_to_none=True)
            (m(x) * 0.0).sum().backward()
        finally:
            set_aux_loss_scale(1.0)
        grads.append(m.indexer.wq.weight.grad.clone())
    torch.testing.assert_close(grads[1], 0.25 * grads[0], rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------ precision, build


@pytest.mark.parametrize("sparse", [True, False])
def test_bf16_autocast_close_to_fp32(sparse):
    torch.manual_seed(0)
    m = GatedMLA(D, _spec(top_k=5), 1e-5)
    m.init_weights(0.3)
    m.sparse = sparse
    x = _x(seed=11).float()
    y32 = m(x)
    kl32 = m.last_indexer_loss
    with torch.autocast("cpu", torch.bfloat16):
        y = m(x)
    y.float().sum().backward()
    assert torch.isfinite(m.last_indexer_loss)
    assert ((y.float() - y32).norm() / y32.norm()) < 5e-2
    assert abs(float(m.last_indexer_loss) - float(kl32)) < 5e-2 * float(kl32) + 1e-3
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in _main_params(m).values())


def test_init_weights_sets_every_parameter():
    m = GatedMLA(D, _spec(), 1e-5)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(7.0)
    m.init_weights(0.02)
    for n, p in m.named_parameters():
        p = p.detach()
        if n.endswith("norm.weight"):
            assert torch.all(p == 1), n
        elif n.endswith("norm.bias"):
            assert torch.all(p == 0), n
        else:
            assert abs(float(p.mean())) < 0.01 and 0.01 < float(p.std()) < 0.03, n


def test_meta_build_and_k3_parameter_count():
    k3 = load_model_spec("kimi-k3")
    with torch.device("meta"):
        m = GatedMLA(k3.hidden_size, k3.mla, k3.norm_eps)
        m.init_weights(0.02)
    assert all(p.is_meta for p in m.parameters())
    assert sum(p.numel() for p in m.parameters()) == 232_196_096  # MODEL.md: ~232.2M per K3 MLA layer
    k31 = load_model_spec("kimi-k3.1-pro")
    with torch.device("meta"):
        m = GatedMLA(k31.hidden_size, k31.mla, k31.norm_eps)
    n_idx = sum(p.numel() for p in m.indexer.parameters())
    assert n_idx == 1536 * 32 * 128 + 7168 * 128 + 2 * 128 + 7168 * 32
    names = {n for n, _ in m.named_parameters()}
    assert names == {
        "q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_a_proj.weight", "kv_a_norm.weight",
        "kv_b_proj.weight", "g_proj.weight", "o_proj.weight", "indexer.wq.weight", "indexer.wk.weight",
        "indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.weights_proj.weight",
    }


def test_tiny_preset_layer_runs_forward_backward():
    tiny = load_model_spec("tiny")
    torch.manual_seed(0)
    m = GatedMLA(tiny.hidden_size, tiny.mla, tiny.norm_eps)
    m.init_weights(tiny.init_std)
    x = torch.randn(2, 64, tiny.hidden_size, requires_grad=True)
    y = m(x)
    y.square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all()
    assert float(m.last_indexer_loss) > 0


def test_rope_scaling_other_than_yarn_is_refused_not_ignored():
    scaling = {"type": "linear", "factor": 4.0}
    spec = MLASpec.model_validate({**_spec(use_rope=True).model_dump(), "rope_scaling": scaling})
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        GatedMLA(D, spec, 1e-5)


def test_yarn_changes_the_rope_and_the_softmax_scale():
    """DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1): softmax scale x (0.1 ln 40 + 1)^2, rotations
    of the low-frequency pairs interpolated, so the layer's output differs from the plain-rope layer's."""
    base = _spec(use_rope=True)
    scaling = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    yarn = MLASpec.model_validate({**base.model_dump(), "rope_scaling": scaling})
    torch.manual_seed(0)
    plain = GatedMLA(D, base, 1e-5).double()
    scaled = GatedMLA(D, yarn, 1e-5).double()
    scaled.load_state_dict(plain.state_dict())
    assert scaled.scale == pytest.approx(plain.scale * (0.1 * math.log(40) + 1) ** 2)
    x = torch.randn(2, 64, D, dtype=torch.float64)
    assert not torch.allclose(plain(x), scaled(x))
