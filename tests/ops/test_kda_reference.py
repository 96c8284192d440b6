"""KDA op: chunked reference vs the token-by-token recurrence (forward, final state, every gradient), the gates,
and the backend dispatcher."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import moestack.ops.kda as kda_ops
from moestack.ops.backends import Backend
from moestack.ops.kda import (
    chunk_kda,
    kda_chunked_reference,
    kda_gate_k3,
    kda_gate_kimi_linear,
    kda_recurrent_reference,
    resolve_backend,
)

H, K, V = 3, 8, 12  # K != V on purpose


def _inputs(B, T, dtype, gate, seed=0, N=None, with_h0=True):
    """Fresh seeded leaves: q, k (L2-normalised as the layer feeds them), v, g (log-decay), beta, h0."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    if gate == "mild":  # log-decays mostly in (-0.7, 0): long memories
        g = F.logsigmoid(rnd(B, T, H, K) + 3.0)
    elif gate == "strong":  # down to -5 per token (the K3 lower bound)
        g = -5.0 * u
    else:  # "extreme": down to -20 per token (the unbounded Kimi Linear gate can get there)
        g = -20.0 * u
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    h0 = rnd(N or B, H, K, V) if with_h0 else None
    leaves = [q, k, v, g, beta] + ([h0] if with_h0 else [])
    leaves = [x.to(dtype).requires_grad_() for x in leaves]
    if not with_h0:
        leaves.append(None)
    return leaves


def _run_with_grads(fn, q, k, v, g, beta, h0, seed=1, **kw):
    """Forward, then backward of a random linear functional of (o, final_state); return outputs and grads."""
    o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    leaves = [x for x in (q, k, v, g, beta, h0) if x is not None]
    grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
    return o.detach(), S.detach(), grads


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _assert_match(got, ref, tol):
    o1, S1, g1 = got
    o0, S0, g0 = ref
    assert _rel(o1, o0) < tol, f"o rel err {_rel(o1, o0):.2e}"
    assert _rel(S1, S0) < tol, f"final state rel err {_rel(S1, S0):.2e}"
    names = ["q", "k", "v", "g", "beta", "h0"]
    for name, a, b in zip(names, g1, g0):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert _rel(a, b) < tol, f"d{name} rel err {_rel(a, b):.2e}"


@functools.lru_cache(maxsize=None)
def _recurrent_truth(B, T, dtype, gate, seed, with_h0=True):
    """The token-loop result for _inputs(...) with these arguments (cached: several chunk sizes share it)."""
    return _run_with_grads(kda_recurrent_reference, *_inputs(B, T, dtype, gate, seed=seed, with_h0=with_h0))


@pytest.mark.parametrize("gate,with_h0", [("mild", False), ("strong", True), ("strong", False)])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("T", [1, 7, 63, 100])
def test_chunked_matches_recurrent_fp64(T, chunk, with_h0, gate):
    x = _inputs(2, T, torch.float64, gate, seed=T, with_h0=with_h0)
    got = _run_with_grads(kda_chunked_reference, *x, chunk_size=chunk)
    _assert_match(got, _recurrent_truth(2, T, torch.float64, gate, T, with_h0), 1e-10)


@pytest.mark.parametrize("T,chunk,gate", [(63, 16, "extreme"), (100, 64, "strong"), (130, 64, "extreme"),
                                          (130, 64, "mild")])
def test_chunked_matches_recurrent_fp32(T, chunk, gate):
    got = _run_with_grads(kda_chunked_reference, *_inputs(2, T, torch.float32, gate, seed=T), chunk_size=chunk)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    _assert_match(got, _recurrent_truth(2, T, torch.float32, gate, T), 1e-5)
    # Against the fp64 truth the chunked fp32 path is as good as the fp32 token loop (~3e-7 here); with fp32
    # cumsum differences it was ~1e-5 for strong gates, which this bound catches.
    _assert_match(got, _recurrent_truth(2, T, torch.float64, gate, T), 2e-6)


@pytest.mark.parametrize("chunk", [16, 64])
def test_cu_seqlens_equals_separate_documents(chunk):
    lengths = [5, 37, 1, 0, 57]  # uneven, one single token and one empty document
    T = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    q, k, v, g, beta, h0 = _inputs(1, T, torch.float64, "strong", seed=3, N=len(lengths))
    got = _run_with_grads(kda_chunked_reference, q, k, v, g, beta, h0, cu_seqlens=cu, chunk_size=chunk)
    ref = _run_with_grads(kda_recurrent_reference, q, k, v, g, beta, h0, cu_seqlens=cu.long())
    _assert_match(got, ref, 1e-10)

    # Each document on its own (B = 1, no cu_seqlens) gives the same outputs and final states.
    o, S = got[0], got[1]
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, S_n = kda_recurrent_reference(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
            initial_state=h0[n : n + 1], output_final_state=True,
        )
        if e > s:
            assert _rel(o[:, s:e], o_n) < 1e-10
        assert _rel(S[n : n + 1], S_n) < 1e-10


def test_recurrent_single_step_is_the_matrix_formula():
    """T = 1 from a random state, written with explicit matrices: S1 = (I - b k k^T) Diag(a) S0 + b k v^T."""
    q, k, v, g, beta, h0 = (x.detach() if x is not None else None for x in _inputs(1, 1, torch.float64, "strong"))
    o, S1 = kda_recurrent_reference(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    for h in range(H):
        kk, vv, b = k[0, 0, h][:, None], v[0, 0, h][:, None], beta[0, 0, h]
        S_exp = (torch.eye(K, dtype=torch.float64) - b * kk @ kk.T) @ torch.diag(g[0, 0, h].exp()) @ h0[0, h]
        S_exp = S_exp + b * kk @ vv.T
        torch.testing.assert_close(S1[0, h], S_exp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o[0, 0, h], S_exp.T @ (0.7 * q[0, 0, h]), rtol=1e-12, atol=1e-12)


def test_reference_ignores_outer_autocast():
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(1, 40, torch.float32, "strong", seed=5))
    o_ref, S_ref = kda_chunked_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    with torch.autocast("cpu", torch.bfloat16):
        o, S = kda_chunked_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=0)


def test_low_precision_inputs_compute_in_fp32():
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(2, 33, torch.float32, "mild", seed=6))
    o32, _ = kda_chunked_reference(q, k, v, g, beta, initial_state=h0, chunk_size=16)
    bf = [x.bfloat16() for x in (q, k, v, g, beta)]
    o_bf, S_bf = kda_chunked_reference(*bf, initial_state=h0, output_final_state=True, chunk_size=16)
    assert o_bf.dtype == torch.bfloat16 and S_bf.dtype == torch.float32
    assert _rel(o_bf, o32) < 5e-2  # only input rounding, no bf16 accumulation


# ---- gates -------------------------------------------------------------------------------------------------------


def _gate_inputs(D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, H, D, generator=gen)
    A_log = torch.rand(H, generator=gen) * math.log(16.0)
    dt_bias = torch.randn(H * D, generator=gen)
    return x, A_log, dt_bias


@pytest.mark.parametrize("D", [K, 1])  # per-channel and per-head decay
def test_gates_match_scalar_formulas(D):
    x, A_log, dt_bias = _gate_inputs(D)
    g3 = kda_gate_k3(x.bfloat16(), A_log, dt_bias, -5.0)
    gl = kda_gate_kimi_linear(x, A_log, dt_bias)
    assert g3.dtype == torch.float32 and g3.shape == x.shape and gl.shape == x.shape
    xb = x.bfloat16().float()
    for b, t, h, c in [(0, 0, 0, 0), (1, 4, H - 1, D - 1), (0, 2, 1, D // 2)]:
        A = math.exp(A_log[h].item())
        z3 = A * (xb[b, t, h, c].item() + dt_bias[h * D + c].item())
        assert g3[b, t, h, c].item() == pytest.approx(-5.0 / (1.0 + math.exp(-z3)), rel=1e-5)
        zl = x[b, t, h, c].item() + dt_bias[h * D + c].item()
        assert gl[b, t, h, c].item() == pytest.approx(-A * math.log1p(math.exp(zl)), rel=1e-5)
    assert (g3 < 0).all() and (g3 >= -5.0).all() and (gl < 0).all()  # fp32 sigmoid may saturate to 1


# ---- dispatcher --------------------------------------------------------------------------------------------------


@pytest.fixture
def clean_registry(monkeypatch):
    saved = dict(kda_ops.REGISTRY._backends)
    yield
    kda_ops.REGISTRY._backends.clear()
    kda_ops.REGISTRY._backends.update(saved)


class _Fake(Backend):
    """A backend for the dispatch mechanism: records its calls, returns v (times `factor`)."""

    def __init__(self, name, runs_on_cpu=True, picks_cpu=False, factor=1.0):
        self.name, self.runs_on_cpu, self.picks_cpu, self.factor, self.calls = name, runs_on_cpu, picks_cpu, factor, []

    def unavailable(self, device):
        return None if self.runs_on_cpu else "not here"

    def prefers(self, device):
        return self.picks_cpu

    def fn(self, q, k, v, g, beta, **kw):
        self.calls.append(kw)
        return v * self.factor, None


def test_default_backend_on_cpu_is_reference(clean_registry, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a plain CPU process, not the Triton CPU tests
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(1, 20, torch.float32, "strong", seed=8))
    assert resolve_backend(q=q) == "reference"
    o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, S_ref = kda_chunked_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=0)


def test_triton_is_default_for_cuda_only(clean_registry):
    """Triton leads the auto order (CUDA inputs); CPU tensors still get the reference (Triton declines them)."""
    assert kda_ops.REGISTRY.names()[0] == "triton" and kda_ops.REGISTRY.names()[-1] == "reference"
    assert kda_ops.REGISTRY.auto_for_device(torch.device("cpu")) == "reference"
    assert resolve_backend(q=torch.zeros(1, 1, 1, 4)) == "reference"


def test_auto_selection_respects_availability_and_support(clean_registry):
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in _inputs(1, 4, torch.float32, "mild"))
    kda_ops.REGISTRY.register(_Fake("fake", runs_on_cpu=False, picks_cpu=True), first=True)
    assert resolve_backend(q=q) == "reference"  # cannot run here
    kda_ops.REGISTRY.register(_Fake("fake", picks_cpu=False), first=True)
    assert resolve_backend(q=q) == "reference"  # runs, but auto does not pick it for CPU tensors
    fake = _Fake("fake", picks_cpu=True)
    kda_ops.REGISTRY.register(fake, first=True)
    assert resolve_backend(q=q) == "fake"
    o, _ = chunk_kda(q, k, v, g, beta, scale=0.5, chunk_size=16)
    torch.testing.assert_close(o, v)
    assert fake.calls == [dict(scale=0.5, initial_state=None, output_final_state=False, cu_seqlens=None,
                               chunk_size=16)]


def test_explicit_backend_wins(clean_registry):
    kda_ops.REGISTRY.register(_Fake("fake", factor=2.0))
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in _inputs(1, 4, torch.float32, "mild"))
    assert resolve_backend("fake", q) == "fake"
    torch.testing.assert_close(chunk_kda(q, k, v, g, beta, backend="fake")[0], v * 2)
    o_ref, _ = kda_chunked_reference(q, k, v, g, beta)
    torch.testing.assert_close(chunk_kda(q, k, v, g, beta, backend="reference")[0], o_ref, rtol=0, atol=0)


def test_unknown_backend_names_valid_ones(clean_registry):
    with pytest.raises(ValueError, match="unknown KDA backend 'nope'.*reference"):
        resolve_backend("nope")


def test_fla_backend_registered_but_optional(clean_registry):
    assert "fla" in kda_ops.registered_backends()
    try:
        import fla  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="fla is not installed"):
            resolve_backend("fla")
