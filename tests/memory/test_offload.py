"""Offload: saved activations round-trip exactly (host copies, prefetch one block ahead), expert weights live on the
host and only routed experts are fetched, FP8 storage of expert inputs within its stated bound, and the Plan's
policies combined give the same loss and gradients as none."""

from __future__ import annotations

import copy

import pytest
import torch

from moestack.config.kernel_spec import KernelSpec
from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.config.plan import RecomputePolicy, make_plan
from moestack.memory.apply import apply_memory_policies
from moestack.memory.offload import ActivationOffloader, apply_activation_offload, apply_expert_offload
from moestack.memory.precision import (
    FP8_MAX,
    FP8_REL_ERR,
    dequantize_rows_fp8,
    enable_fp8_expert_inputs,
    quantize_rows_fp8,
)
from moestack.memory.recompute import apply_recompute
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.kernels import apply_kernels
from moestack.model.moe import MoE
from moestack.model.transformer import build_model

B, T = 1, 32


@pytest.fixture(scope="module")
def setup(small_spec):
    spec = small_spec
    model = build_model(spec, "cpu", seed=0)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    return model, tokens, targets


def _step(model, tokens, targets):
    set_aux_loss_scale(1.0)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref, out):
    assert torch.equal(out[0], ref[0])
    assert out[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        assert torch.equal(out[1][name], g), name


@pytest.fixture(scope="module")
def reference(setup):
    return _step(copy.deepcopy(setup[0]), *setup[1:])


# ------------------------------------------------------------------------------------------------------------
# activations


def test_activation_offload_is_exact(setup, reference):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    off = apply_activation_offload(m, "cpu", min_bytes=0)
    _assert_same(reference, _step(m, tokens, targets))
    s = off.stats
    assert s.tensors > 20 and s.bytes > 0 and s.kept > 0  # weights stay
    assert s.prefetched > 0  # block 0's tensors were prefetched when block 1's backward began
    # each offloaded tensor comes back at most once (backward leaves some unread: e.g. the detached indexer inputs)
    assert s.prefetched + s.fetched_sync <= s.tensors


def test_activation_offload_keeps_separate_copies():
    """Backward reads the host copy: changing the device tensor after forward does not change the gradient."""
    off = ActivationOffloader("cpu", min_bytes=0)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = x0 * 1.0  # a non-leaf activation that sin() and mm() save
    with off.region():
        h = torch.sin(x)
    with off.region():
        y = (h @ w).square().sum()
    with torch.no_grad():
        x.add_(100.0)  # without offload autograd would refuse (saved tensor modified in place)
        h.mul_(-3.0)
    y.backward()
    x_ref = x0.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    (torch.sin(x_ref) @ w_ref).square().sum().backward()
    assert torch.equal(x0.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)
    assert off.stats.tensors == 3 and off.stats.kept == 1  # x (sin), h (mm), h @ w (square); w is a weight
    assert off.stats.prefetched == 1  # region 1 (x) was prefetched when region 2 (h, h @ w) unpacked


def test_activation_offload_under_recompute(setup, reference):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    apply_recompute(m, RecomputePolicy(kda="full", attention="selective", moe="none", mlp="none"))
    off = apply_activation_offload(m, "cpu", min_bytes=0)
    _assert_same(reference, _step(m, tokens, targets))
    assert off.stats.tensors > 0  # the MoE part (no recompute) was offloaded


# ------------------------------------------------------------------------------------------------------------
# experts


def _route_to_first_experts(model, n: int) -> None:
    """Bias every router so that only experts 0..n-1 are picked (n == top_k)."""
    for moe in model.moe_layers().values():
        assert moe.spec.top_k == n
        with torch.no_grad():
            moe.router.selection_bias.zero_()
            moe.router.selection_bias[:n] = 10.0  # scores are sigmoids in (0, 1)


def test_expert_offload_fetches_routed_experts_only(setup, small_spec):
    model, tokens, targets = setup
    base = copy.deepcopy(model)
    K = small_spec.moe.top_k
    E = small_spec.moe.num_experts
    _route_to_first_experts(base, K)
    ref = _step(copy.deepcopy(base), tokens, targets)
    m = copy.deepcopy(base)
    off = apply_expert_offload(m, "cpu")
    out = _step(m, tokens, targets)
    _assert_same(ref, out)
    # per weight (2) and pass (forward, backward): only the K routed experts are copied in
    assert off.stats.fetched == 2 * 2 * K and off.stats.skipped == 2 * 2 * (E - K)
    assert off.stats.prefetched >= 3  # forward: router hook (both weights); backward: gate_up behind down
    for name, g in out[1].items():
        if name.endswith(("w_gate_up", "w_down")):
            assert g[K:].abs().max() == 0 and g[:K].abs().max() > 0  # idle experts: zero gradient rows


def test_expert_offload_all_experts_and_recompute(setup, reference):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    off = apply_expert_offload(m, "cpu")
    apply_recompute(m, RecomputePolicy.uniform("full"))
    _assert_same(reference, _step(m, tokens, targets))
    assert off.stats.fetched > 0 and off.stats.d2h_bytes > 0


def test_expert_offload_moved_weights_fail_clearly_and_rehome(setup):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    off = apply_expert_offload(m, "cpu")
    experts = m.moe_layers()["1"].experts
    want = experts.w_down.detach().clone()
    # what model.to_empty(device=...) does to every weight (meta stands in for a GPU here)
    torch.utils.swap_tensors(experts.w_down, torch.nn.Parameter(torch.empty_like(want, device="meta")))
    with pytest.raises(RuntimeError, match="rehome"):
        m(tokens, targets)
    off.rehome()
    assert experts.w_down.device.type == "cpu" and experts.w_down.shape == want.shape
    experts.w_down.data.copy_(want)  # (init_weights would run here)
    m.zero_grad(set_to_none=True)
    for moe in m.moe_layers().values():
        moe.router.tokens_per_expert.zero_()
    assert torch.equal(m(tokens, targets), copy.deepcopy(model)(tokens, targets))


def test_expert_offload_then_optimizer_step_matches(setup):
    """Host-resident experts step with the same AdamW math: parameters equal after two steps."""
    from moestack.config.train_spec import OptimizerSpec
    from moestack.train.optim import build_optimizer

    model, tokens, targets = setup
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    apply_expert_offload(b, "cpu")
    opts = [build_optimizer(x, OptimizerSpec(lr=1e-2)) for x in (a, b)]
    for _ in range(2):
        for m, opt in zip((a, b), opts):
            _step(m, tokens, targets)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------------------------------------------------
# FP8 storage


def test_fp8_rows_round_trip_bound():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different scales
    x[5] = 0.0
    q = quantize_rows_fp8(x)
    assert q.data_ND.dtype == torch.float8_e4m3fn and q.nbytes < x.numel() * 2  # below bf16 size
    y = dequantize_rows_fp8(q)
    assert torch.equal(y[5], x[5])
    amax = x.abs().amax(1, keepdim=True)
    normal = x.abs() >= amax * 2.0**-6  # e4m3 normal range after scaling by amax / 448
    err = (y - x).abs()
    assert (err[normal] <= FP8_REL_ERR * x.abs()[normal] * (1 + 1e-6)).all()
    assert (err <= amax * 2.0**-9 / FP8_MAX * 1.01 + FP8_REL_ERR * x.abs()).all()  # subnormals: absolute bound
    assert err.max() > 0  # it is lossy


def test_fp8_expert_inputs_saved_in_fp8():
    torch.manual_seed(5)
    spec = MoESpec(num_experts=8, top_k=2, expert_intermediate_size=24, latent_size=16, num_shared_experts=0,
                   router=RouterSpec(seq_aux_loss_coef=0.0))
    ref = MoE(32, spec, "situ_glu")
    ref.init_weights(0.3)
    m = copy.deepcopy(ref)
    enable_fp8_expert_inputs(m.experts)
    x = torch.randn(2, 24, 32)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    outs = []
    for mod in (ref, m):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mod(x)
        (y * torch.linspace(-1, 1, 32)).sum().backward()
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1])  # FP8 only changes what backward reads
    N = 2 * 24 * spec.top_k
    assert (torch.float8_e4m3fn, (N, 16)) in saved and (torch.float8_e4m3fn, (N, 24)) in saved
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        err = float((q.grad - p.grad).norm() / p.grad.norm())
        if name.startswith("experts."):
            assert 0 < err < 0.05, (name, err)  # weight gradients read the FP8 inputs
        else:
            assert err < 1e-6, (name, err)  # everything else is unaffected


# ------------------------------------------------------------------------------------------------------------
# the Plan's policies together


def test_apply_memory_policies_combined_is_exact(setup, reference):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    plan = make_plan(model="tiny", cluster="cpu", devices=1, seq_len=T, global_batch_size=B,
                     recompute={"kda": "selective", "attention": "full", "moe": "selective", "mlp": "none"},
                     offload={"experts": True, "activations": True})
    apply_memory_policies(m, plan)
    pol = m.memory_policies
    assert pol.expert_offload is not None and pol.activation_offload is not None and not pol.fp8_expert_inputs
    assert pol.recompute == {"layers.0.attn": "selective", "layers.1.attn": "full", "layers.1.ffn": "selective"}
    _assert_same(reference, _step(m, tokens, targets))
    assert pol.expert_offload.stats.fetched > 0
    with pytest.raises(RuntimeError, match="already applied"):
        apply_memory_policies(m, plan)
    fp8 = copy.deepcopy(model)
    apply_memory_policies(fp8, plan.model_copy(update={"precision": "fp8"}))
    assert fp8.memory_policies.fp8_expert_inputs
    assert "fp8 saved expert inputs" in fp8.memory_policies.summary()


# ------------------------------------------------------------------------------------------------------------
# GPU (scripts/gpu_check.sh): pinned memory, side streams, device memory actually freed


@pytest.mark.gpu
def test_activation_offload_cuda_exact_and_frees_memory(monkeypatch, small_spec):
    # bitwise comparison: deterministic backends (the Triton DSA backward accumulates dKV with fp32 atomics)
    spec = small_spec
    model = build_model(spec, "cuda", seed=0)
    apply_kernels(model, KernelSpec(kda={"backend": "reference"}, dsa={"backend": "reference"}))
    tokens = torch.randint(0, spec.vocab_size, (2, 1024), device="cuda")
    targets = torch.randint(0, spec.vocab_size, (2, 1024), device="cuda")

    def run(m):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            loss = m(tokens, targets)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees blocks whose side-stream copies are done on a malloc
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        return held, loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    held0, loss0, g0 = run(copy.deepcopy(model))
    m = copy.deepcopy(model)
    off = apply_activation_offload(m, "cuda", min_bytes=1 << 16)
    off.timing = True
    held1, loss1, g1 = run(m)
    assert torch.equal(loss0, loss1) and all(torch.equal(g1[n], g0[n]) for n in g0)
    assert off.stats.bytes > 0 and off.stats.prefetched > 0
    assert held1 < held0 - 0.5 * off.stats.bytes  # the offloaded activations left the device
    d2h_s, h2d_s = off.copy_times()  # the transfer time the step had to hide
    assert d2h_s > 0 and h2d_s > 0 and not off._timed


@pytest.mark.gpu
def test_expert_offload_cuda_exact(monkeypatch, small_spec):
    spec = small_spec
    model = build_model(spec, "cuda", seed=0)
    apply_kernels(model, KernelSpec(dsa={"backend": "reference"}))  # deterministic dKV (see above)
    tokens = torch.randint(0, spec.vocab_size, (1, 256), device="cuda")
    targets = torch.randint(0, spec.vocab_size, (1, 256), device="cuda")
    ref = _step(copy.deepcopy(model), tokens, targets)
    m = copy.deepcopy(model)
    off = apply_expert_offload(m, "cuda")
    assert m.moe_layers()["1"].experts.w_gate_up.device.type == "cpu"
    loss, grads = _step(m, tokens, targets)
    assert torch.equal(loss, ref[0])
    for name, g in ref[1].items():
        torch.testing.assert_close(grads[name].cpu(), g.cpu(), rtol=1e-4, atol=1e-6, msg=name)
    assert off.stats.fetched > 0 and off.stats.prefetched > 0


@pytest.mark.gpu
def test_grouped_wgrad_native_matches_loop():
    """The bf16 native path of the expert weight gradient (torch._grouped_mm, 2-D x 2-D) against per-expert GEMMs,
    with empty experts in the middle and at the end."""
    from moestack.memory.offload import _grouped_wgrad

    g = torch.Generator(device="cuda").manual_seed(6)
    counts = [64, 0, 128, 16, 0]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 256, device="cuda", generator=g).bfloat16()
    dy = torch.randn(sum(counts), 128, device="cuda", generator=g).bfloat16()
    dw = _grouped_wgrad(x, dy, offs, len(counts))
    start = 0
    for e, n in enumerate(counts):
        want = (x[start:start + n].float().t() @ dy[start:start + n].float())
        torch.testing.assert_close(dw[e].float(), want, rtol=2e-2, atol=2e-2)
        start += n
