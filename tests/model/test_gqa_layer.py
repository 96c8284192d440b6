"""GQAAttention vs a naive per-head softmax loop; RoPE; packed documents; build on meta."""

from __future__ import annotations

import pytest
import torch

from moestack.config.model_spec import GQASpec
from moestack.model.gqa import GQAAttention
from moestack.model.rope import apply_rope, rope_cos_sin, rope_positions

F64 = torch.float64
D = 24


def _layer(seed=0, head_dim=8, **kw) -> GQAAttention:
    spec = GQASpec(**{"num_heads": 4, "num_kv_heads": 2, **kw})
    torch.manual_seed(seed)
    m = GQAAttention(D, spec, head_dim, 1e-5).to(F64)
    m.init_weights(0.3)
    with torch.no_grad():  # non-trivial norm weights and biases so skipping them cannot pass
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return m


def _x(B=2, T=10, seed=1) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _rot_half(x, pos, theta):
    """Rotate pairs (i, i + E/2) of x [T, E] by pos * theta^(-2i/E) with complex numbers."""
    E = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, E, 2, dtype=F64) / E)
    z = torch.complex(x[..., : E // 2], x[..., E // 2 :]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat((z.real, z.imag), dim=-1)


def naive_gqa(m: GQAAttention, x, cu=None):
    """Per-(batch, head, query) softmax loop; query head h reads key/value head h // (H / G)."""
    s = m.spec
    B, T, _ = x.shape
    H, G, E = m.num_heads, m.num_kv_heads, m.head_dim

    def lin(layer, inp):
        out = inp @ layer.weight.T
        return out if layer.bias is None else out + layer.bias

    q = lin(m.q_proj, x).view(B, T, H, E)
    k = lin(m.k_proj, x).view(B, T, G, E)
    v = lin(m.v_proj, x).view(B, T, G, E)
    if s.qk_norm:  # the RMSNorm module computes in fp32 by design; it is tested with moestack.model.norm
        q, k = m.q_norm(q), m.k_norm(k)
    doc = [0] * T if cu is None else [max(i for i in range(len(cu) - 1) if cu[i] <= t) for t in range(T)]
    pos = torch.tensor([t - (0 if cu is None else cu[doc[t]]) for t in range(T)])
    o = torch.zeros(B, T, H, E, dtype=F64)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            qh, kh = q[b, :, h], k[b, :, g]
            if s.use_rope:
                r = int(E * s.rope_fraction)
                qh = torch.cat((_rot_half(qh[:, :r], pos, s.rope_theta), qh[:, r:]), -1)
                kh = torch.cat((_rot_half(kh[:, :r], pos, s.rope_theta), kh[:, r:]), -1)
            for t in range(T):
                keys = torch.tensor([u for u in range(t + 1) if doc[u] == doc[t]])
                p = torch.softmax(kh[keys] @ qh[t] / E**0.5, 0)
                o[b, t, h] = p @ v[b, keys, g]
    if m.g_proj is not None:
        o = o * torch.sigmoid(x @ m.g_proj.weight.T).view(B, T, H, E)
    return o.reshape(B, T, H * E) @ m.o_proj.weight.T


CASES = [
    dict(num_kv_heads=2, qk_norm=True, output_gate=True, qkv_bias=True),
    dict(num_kv_heads=4),
    dict(num_heads=6, num_kv_heads=1, use_rope=False, output_gate=True),
    dict(num_kv_heads=1, qk_norm=True, rope_theta=500.0),
    dict(num_kv_heads=2, rope_fraction=0.5, output_gate=True),  # partial rotary, Qwen3-Next style
]


@pytest.mark.parametrize("kw", CASES)
def test_matches_naive_loop(kw):
    m = _layer(**kw)
    x = _x()
    torch.testing.assert_close(m(x), naive_gqa(m, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kw", CASES[:3])
def test_cu_seqlens_isolates_documents(kw):
    m = _layer(**kw)
    x = _x(B=1, T=13, seed=2)
    cu = [0, 4, 5, 13]
    y = m(x, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    torch.testing.assert_close(y, naive_gqa(m, x, cu), rtol=1e-10, atol=1e-12)
    for a, b in zip(cu[:-1], cu[1:]):
        torch.testing.assert_close(y[:, a:b], m(x[:, a:b]), rtol=1e-10, atol=1e-12)


def test_gradients_reach_every_parameter():
    m = _layer(**CASES[0])
    x = _x(seed=3).requires_grad_(True)
    (m(x) * torch.randn(2, 10, D, dtype=F64)).sum().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, n
    assert torch.isfinite(x.grad).all()


def test_bf16_autocast_close_to_fp32():
    torch.manual_seed(0)
    m = GQAAttention(D, GQASpec(num_heads=4, num_kv_heads=2, qk_norm=True, output_gate=True), 8, 1e-5)
    m.init_weights(0.2)
    x = _x(seed=4).float()
    y32 = m(x)
    with torch.autocast("cpu", torch.bfloat16):
        y = m(x)
    assert ((y.float() - y32).norm() / y32.norm()) < 5e-2


def test_rope_relative_positions_and_layouts():
    """q_m . k_n after RoPE depends only on m - n, in both pair layouts; interleaved = permuted half layout."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 1, 1, 8, generator=g, dtype=F64), torch.randn(1, 1, 1, 8, generator=g, dtype=F64)
    for interleaved in (False, True):

        def score(m, n):
            cm, sm = rope_cos_sin(torch.tensor([m]), 8, 100.0, F64)
            cn, sn = rope_cos_sin(torch.tensor([n]), 8, 100.0, F64)
            return float((apply_rope(q, cm, sm, interleaved) * apply_rope(k, cn, sn, interleaved)).sum())

        assert abs(score(7, 3) - score(104, 100)) < 1e-10
        assert abs(score(7, 3) - score(3, 7)) > 1e-3
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved pairs (2i, 2i+1) -> half pairs (i, i+4)
    cos, sin = rope_cos_sin(torch.arange(5), 8, 100.0, F64)
    x = torch.randn(1, 5, 2, 8, generator=g, dtype=F64)
    torch.testing.assert_close(apply_rope(x, cos, sin, True)[..., perm], apply_rope(x[..., perm], cos, sin, False))
    assert rope_positions(7, "cpu", torch.tensor([0, 3, 7])).tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_meta_build_and_init():
    spec = GQASpec(num_heads=32, num_kv_heads=4, qk_norm=True, qkv_bias=True, output_gate=True)
    with torch.device("meta"):
        m = GQAAttention(4096, spec, 128, 1e-6)
        m.init_weights(0.02)
    assert all(p.is_meta for p in m.parameters())
    n = sum(p.numel() for p in m.parameters())
    assert n == 4096 * 128 * (32 + 4 + 4) + 128 * (32 + 4 + 4) + 2 * 128 + 2 * 4096 * 4096  # qkv+bias, norms, g, o
    m = GQAAttention(D, GQASpec(num_heads=4, num_kv_heads=2, qk_norm=True, qkv_bias=True), 6, 1e-5)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(5.0)
    m.init_weights(0.02)
    for name, p in m.named_parameters():
        p = p.detach()
        if "norm" in name:
            assert torch.all(p == 1), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            assert 0.005 < float(p.std()) < 0.04 and abs(float(p.mean())) < 0.01, name


def test_rope_scaling_is_refused_not_ignored():
    spec = GQASpec(num_heads=4, num_kv_heads=2, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        GQAAttention(D, spec, 8, 1e-5)
