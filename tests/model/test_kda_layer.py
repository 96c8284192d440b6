"""KDAAttention layer: shapes, causality, packed documents, gradients, variants, init, meta build, autocast."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moestack.config.model_spec import KDASpec, load_model_spec
from moestack.model.kda import DT_MAX, DT_MIN, KDAAttention, ShortConv

D = 24  # hidden


def _layer(dtype=torch.float64, seed=0, **overrides) -> KDAAttention:
    spec = KDASpec(**{"num_heads": 2, "head_dim": 8, "gate_rank": 6, "chunk_size": 16, **overrides})
    torch.manual_seed(seed)
    layer = KDAAttention(D, spec, norm_eps=1e-5)
    layer.init_weights(0.2)  # larger than 0.02 so the tiny layer's outputs and gradients are O(1)
    return layer.to(dtype)


def _x(B, T, dtype=torch.float64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_output_shape_and_dtype():
    layer = _layer()
    y = layer(_x(2, 21))
    assert y.shape == (2, 21, D) and y.dtype == torch.float64 and torch.isfinite(y).all()


@pytest.mark.parametrize("t", [0, 9, 16, 30])  # inside the first chunk, at a chunk start, in a later chunk
def test_causal(t):
    layer = _layer()
    x = _x(2, 40)
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn(x2[:, t + 1 :].shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype)
    y, y2 = layer(x), layer(x2)
    torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y2[:, t + 1 :], y[:, t + 1 :])  # the future does change


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("lengths", [[5, 11, 1, 19], [3, 16, 17]])
def test_packed_documents_equal_separate_runs(lengths):
    layer = _layer()
    x = _x(1, sum(lengths))
    cu = _cu(lengths)
    y = layer(x, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(y[:, s:e], layer(x[:, s:e]), rtol=1e-10, atol=1e-12)
    # Without cu_seqlens the documents would see each other: the test above can fail.
    assert not torch.allclose(layer(x)[:, lengths[0] :], y[:, lengths[0] :])


def test_short_conv_is_causal_depthwise_conv1d_and_respects_documents():
    torch.manual_seed(0)
    conv = ShortConv(6, 4).double()
    conv.init_weights(0.02)
    x = _x(2, 13)[..., :6]
    # Same convention as nn.Conv1d(groups=C) with left padding W-1, so HF conv weights load unchanged.
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, groups=6).transpose(1, 2)
    torch.testing.assert_close(conv(x), ref, rtol=1e-12, atol=1e-12)
    # Packed: every document convolves only its own tokens.
    lengths = [2, 1, 6, 4]
    cu = _cu(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])
    y = conv(x[:1], pos)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(y[:, s:e], conv(x[:1, s:e]), rtol=1e-12, atol=1e-12)


VARIANTS = [
    {},
    {"gate": "kimi_linear"},
    {"decay": "head"},
    {"gate": "kimi_linear", "decay": "head", "gate_rank": None},
    {"output_gate_rank": 5},
    {"conv_kernel_size": 1},
    {"gate": "kimi_linear", "decay": "head", "num_v_heads": 4, "output_gate_act": "silu"},  # Gated DeltaNet
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_every_parameter_gets_a_gradient(overrides):
    layer = _layer(**overrides)
    x = _x(2, 19).requires_grad_()
    w = torch.randn(2, 19, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (layer(x) * w).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert p.grad is not None, f"{name}: no grad"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite grad"
        assert p.grad.abs().max() > 0, f"{name}: zero grad"


def test_parameter_names_and_shapes():
    layer = _layer(output_gate_rank=5)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    HK = 16
    assert shapes == {
        "q_proj.weight": (HK, D), "k_proj.weight": (HK, D), "v_proj.weight": (HK, D),
        "q_conv.weight": (HK, 1, 4), "k_conv.weight": (HK, 1, 4), "v_conv.weight": (HK, 1, 4),
        "f_a_proj.weight": (6, D), "f_b_proj.weight": (HK, 6), "A_log": (2,), "dt_bias": (HK,),
        "b_proj.weight": (2, D), "g_a_proj.weight": (5, D), "g_b_proj.weight": (HK, 5),
        "o_norm.weight": (8,), "o_proj.weight": (D, HK),
    }  # fmt: skip
    head = _layer(decay="head", gate_rank=None)
    assert head.f_proj.weight.shape == (2, D) and head.dt_bias.shape == (2,)


def test_grouped_value_heads_equal_repeated_qk_heads():
    """num_v_heads = 2 * num_heads: value head j reads q/k head j // 2. A layer with 4 q/k heads whose q/k weights
    repeat each head twice must give the same output."""
    common = {"decay": "head", "gate": "kimi_linear"}
    gva = _layer(num_v_heads=4, **common)
    full = _layer(num_heads=4, seed=5, **common)
    K = 8

    def repeat_heads(w):  # [2*K, ...] -> [4*K, ...]: head h -> heads 2h, 2h+1
        return w.view(2, K, *w.shape[1:]).repeat_interleave(2, dim=0).reshape(4 * K, *w.shape[1:])

    with torch.no_grad():
        for name, p in full.named_parameters():
            src = gva.get_parameter(name)
            p.copy_(repeat_heads(src) if name.split(".")[0] in ("q_proj", "k_proj", "q_conv", "k_conv") else src)
    x = _x(2, 21)
    torch.testing.assert_close(gva(x), full(x), rtol=1e-12, atol=1e-12)
    assert gva.v_proj.weight.shape == (32, D) and gva.q_proj.weight.shape == (16, D)
    assert gva.A_log.shape == (4,) and gva.dt_bias.shape == (4,) and gva.b_proj.weight.shape == (4, D)


def test_output_gate_activation():
    sig = _layer()
    silu = _layer(output_gate_act="silu")
    silu.load_state_dict(sig.state_dict())
    x = _x(1, 9)
    assert not torch.allclose(sig(x), silu(x))
    # With g_proj = 0 the gate pre-activation is 0: silu(0) = 0 silences the layer, sigmoid(0) = 1/2 does not.
    with torch.no_grad():
        silu.g_proj.weight.zero_()
        sig.g_proj.weight.zero_()
    torch.testing.assert_close(silu(x), torch.zeros_like(x), rtol=0, atol=0)
    assert sig(x).abs().max() > 1e-3


@pytest.mark.parametrize("gate", ["k3", "kimi_linear"])
def test_init_weights(gate):
    with torch.device("meta"):
        layer = KDAAttention(D, KDASpec(num_heads=2, head_dim=8, gate=gate), norm_eps=1e-5)
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.init_weights(0.02)
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    assert layer.A_log.dtype == torch.float32 and layer.dt_bias.dtype == torch.float32
    A = layer.A_log.exp()
    assert ((A >= 1) & (A <= 16)).all()
    assert layer.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert (layer.o_norm.weight == 1).all()
    assert layer.v_conv.weight.abs().max() <= 0.5 and layer.v_conv.weight.std() > 0.1
    # With zero decay input the log-decay starts at -A * dt, dt in [DT_MIN, DT_MAX], for either gate.
    g0 = layer._gate(torch.zeros(1, 1, 2, 8))[0, 0]  # [H, K]
    dt = -g0 / A[:, None]
    assert (dt >= DT_MIN * 0.999).all() and (dt <= DT_MAX * 1.001).all()
    assert dt.max() / dt.min() > 5  # a spread of time scales, not one constant


def test_meta_build_k3_parameter_count():
    spec = load_model_spec("kimi-k3")
    with torch.device("meta"):
        layer = KDAAttention(spec.hidden_size, spec.kda, spec.norm_eps)
    n = sum(p.numel() for p in layer.parameters())
    d, H, K, r, W = 7168, 96, 128, 128, 4
    expected = 3 * d * H * K + 3 * H * K * W + d * r + r * H * K + H + H * K + d * H + d * H * K + K + H * K * d
    assert n == expected == 443_740_384
    assert abs(n - 443_737_312) / 443_737_312 < 5e-4  # MODEL.md: 443.7M


def test_cpu_bf16_autocast_smoke():
    layer = _layer(torch.float32)
    x = _x(2, 33, torch.float32).requires_grad_()
    y32 = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    rel = ((y.float() - y32).norm() / y32.norm()).item()
    assert rel < 5e-2, rel
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert layer.A_log.grad.dtype == torch.float32
    assert math.isfinite(x.grad.abs().sum().item())
