"""The fast host paths: fused CPU AdamW (fp32 and bf16 states with table-noise stochastic rounding) against the
reference optimizers, and expert offload's persistent host gradients and batched shadow refresh (exact vs no
offload over steps, with gradient accumulation and zero_grad(set_to_none=False))."""

from __future__ import annotations

import copy

import torch

from moestack.config.train_spec import OptimizerSpec
from moestack.memory.adamw import AdamWBF16, CPUOffloadAdamW
from moestack.memory.host_adamw import (
    HostOffloadAdamW,
    RoundingNoise,
    _round_into,
    adamw_bf16_states_,
)
from moestack.memory.offload import apply_expert_offload
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.transformer import build_model
from moestack.train.optim import build_optimizer
from moestack.train.optimizers import Muon, build_host_aware_optimizer


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((37, 19), (3, 5, 7), (11,))]


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in ps]


def test_host_offload_adamw_fp32_matches_torch_adamw():
    a, b = _params(), _params()
    ref = torch.optim.AdamW(a, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, foreach=False)
    off = HostOffloadAdamW(b, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    for step in range(4):
        for ps, opt in ((a, ref), (b, off)):
            for p, g in zip(ps, _grads(ps, step)):
                p.grad = g
            opt.step()
    for p, q in zip(a, b):  # fused vs single-tensor kernels: equal up to last-bit rounding
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    assert isinstance(off, CPUOffloadAdamW) and int(off.state[b[0]]["step"]) == 4


def test_host_offload_adamw_bf16_states_tracks_adamw_bf16():
    a, b, c = _params(), _params(), _params()
    ref = AdamWBF16(a, lr=1e-2, weight_decay=0.1)
    off = HostOffloadAdamW(b, lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
    fp32 = torch.optim.AdamW(c, lr=1e-2, weight_decay=0.1)
    for step in range(20):
        for ps, opt in ((a, ref), (b, off), (c, fp32)):
            for p, g in zip(ps, _grads(ps, step)):
                p.grad = g
            opt.step()
    for p, q, r in zip(a, b, c):
        assert off.state[q]["exp_avg"].dtype == torch.bfloat16
        # both bf16-state optimizers stay as close to fp32 AdamW as each other (lr 1e-2, 20 steps: |dp| ~ 0.2)
        err_ref = (p.detach() - r.detach()).abs().max()
        err_off = (q.detach() - r.detach()).abs().max()
        assert err_off < 2e-3 and err_off < 3 * err_ref + 1e-4, (float(err_off), float(err_ref))


def test_chunked_bf16_update_is_chunk_independent_and_handles_views():
    """Chunking does not change the math beyond the noise; a non-contiguous parameter takes the reference path."""
    g = torch.Generator().manual_seed(3)
    p0, grad = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    outs = []
    for chunk in (64, 1000, 333):
        p, m, v = p0.clone(), torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000, dtype=torch.bfloat16)
        adamw_bf16_states_(p, grad, m, v, torch.tensor(1.0), 1e-2, 0.9, 0.95, 1e-8, 0.1, RoundingNoise(0, 4096),
                           chunk=chunk)
        outs.append(p)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # master update: no rounding involved
    w = torch.randn(8, 6, generator=g).t()  # a transposed (non-contiguous) parameter
    m, v = torch.zeros(6, 8, dtype=torch.bfloat16), torch.zeros(6, 8, dtype=torch.bfloat16)
    before = w.clone()
    adamw_bf16_states_(w, torch.ones(6, 8), m, v, torch.tensor(1.0), 1e-2, 0.9, 0.95, 1e-8, 0.0,
                       RoundingNoise(0, 4096))
    torch.testing.assert_close(w, before - 1e-2, rtol=0, atol=1e-4)  # first AdamW step: -lr * sign(g)


def test_table_noise_rounding_is_unbiased():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    ulp = 2.0**-7
    x = torch.full((4096,), 1.0 + 0.3 * ulp)  # 30% of the way from 1 to the next bf16 value
    noise = RoundingNoise(5, 1 << 14, 4096)
    ups = 0.0
    for _ in range(50):
        out = torch.empty(4096, dtype=torch.bfloat16)
        _round_into(out, x.clone(), noise.take(4096))
        assert set(out.float().unique().tolist()) <= {1.0, 1.0 + ulp}
        ups += float((out.float() > lo.float()).float().mean())
    assert abs(ups / 50 - 0.3) < 0.02


def test_build_host_aware_optimizer_choices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    spec = OptimizerSpec()
    off = build_host_aware_optimizer(model, "adamw_bf16", spec, offload=True)
    assert type(off) is HostOffloadAdamW and off.state_dtype == torch.bfloat16
    assert [g["weight_decay"] for g in off.param_groups] == [spec.weight_decay, 0.0]
    assert type(build_host_aware_optimizer(model, "adamw", spec, offload=True)) is HostOffloadAdamW
    assert isinstance(build_host_aware_optimizer(model, "muon", spec), Muon)
    assert isinstance(build_host_aware_optimizer(model, "adamw", spec), torch.optim.AdamW)  # all on one device


def test_trainer_plan_optimizer_uses_host_paths():
    """`moestack train --plan` with offload builds the fast host optimizer (the generic CPU paths took minutes per
    step on the H200 host), and the plain plan keeps torch AdamW."""
    from types import SimpleNamespace

    from moestack.config.plan import make_plan
    from moestack.config.train_spec import load_train_spec
    from moestack.train.trainer import Trainer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    spec = load_train_spec(None, {})

    def built(**fields):
        plan = make_plan(model="tiny", cluster="cpu", devices=1, seq_len=16, global_batch_size=1,
                         micro_batch_size=1, **fields)
        fake = SimpleNamespace(dist=SimpleNamespace(plan=plan), model=model, spec=spec)
        return Trainer._build_parallel_optimizer(fake)

    opt = built(offload={"optimizer": True}, optimizer="adamw_bf16")
    assert type(opt) is HostOffloadAdamW and opt.state_dtype == torch.bfloat16
    assert type(built(offload={"optimizer": True})) is HostOffloadAdamW
    assert type(built()) is torch.optim.AdamW
    assert isinstance(built(optimizer="muon"), Muon)


# ------------------------------------------------------------------------------------------------------------
# expert offload host gradients


def _step(model, tokens, targets, backward_passes=1):
    set_aux_loss_scale(1.0)
    for _ in range(backward_passes):
        model(tokens, targets).backward()


def test_expert_offload_grad_buffers_steps_and_accumulation(small_spec):
    """Two optimizer steps, each with two backward passes (gradient accumulation), then a step after
    zero_grad(set_to_none=False): host-expert parameters and gradients equal the no-offload model's."""
    model = build_model(small_spec, "cpu", seed=0)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, small_spec.vocab_size, (1, 32), generator=g)
    targets = torch.randint(0, small_spec.vocab_size, (1, 32), generator=g)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    off = apply_expert_offload(b, "cpu")
    spec = OptimizerSpec(lr=1e-2)
    opts = [build_optimizer(a, spec), build_optimizer(b, spec)]
    buffers = None
    for step in range(3):
        for m in (a, b):
            _step(m, tokens, targets, backward_passes=2)
        if step == 0:
            buffers = {n: p.grad for n, p in b.named_parameters() if n.endswith(("w_gate_up", "w_down"))}
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), (step, n)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step < 1)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    for n, p in b.named_parameters():  # the first gradient of each step went into the same host buffer
        if n in buffers:
            assert p.grad is buffers[n]
    assert off._grad_buffers and not off._pending and not off._fresh


def test_expert_offload_shadows_refresh_together(small_spec):
    """bf16 transfer shadows: after the weights change, the first fetch refreshes every stale shadow at once."""
    model = build_model(small_spec, "cpu", seed=0)
    off = apply_expert_offload(model, "cpu", transfer_dtype=torch.bfloat16)
    params = [getattr(e, n) for e in off.attached for n in ("w_gate_up", "w_down")]
    for p in params:
        off._host_source(p)
    assert len(off._shadows) == len(params)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    shadow = off._host_source(params[0])
    assert torch.equal(shadow, params[0].detach().bfloat16())
    for p in params:  # the others were refreshed by the same call
        version, s = off._shadows[id(p)]
        assert version == p._version and torch.equal(s, p.detach().bfloat16())


def test_fused_steps_bump_versions_so_shadows_follow(small_spec):
    """torch's fused AdamW kernels do not bump version counters; ours do, so expert offload's bf16 transfer shadows
    (refreshed on a version change) follow every optimizer step: fp32 and bf16 HostOffloadAdamW, FusedAdamW."""
    from moestack.memory.host_adamw import FusedAdamW

    for make in (lambda ps: HostOffloadAdamW(ps, lr=1e-2),
                 lambda ps: HostOffloadAdamW(ps, lr=1e-2, state_dtype=torch.bfloat16),
                 lambda ps: FusedAdamW(ps, lr=1e-2)):
        model = build_model(small_spec, "cpu", seed=0)
        off = apply_expert_offload(model, "cpu", transfer_dtype=torch.bfloat16)
        params = [getattr(e, n) for e in off.attached for n in ("w_gate_up", "w_down")]
        opt = make(params)
        for step in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
                before = off._host_source(p).clone()
            opt.step()
            for p in params:
                shadow = off._host_source(p)
                assert torch.equal(shadow, p.detach().bfloat16()), (type(opt).__name__, step)
            assert not torch.equal(shadow, before)


def test_host_offload_adamw_dtensor_single_rank(cpu_mesh):
    """Sharded (DTensor) parameters: the same result as plain ones, m / v DTensors on the host."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    g = torch.Generator().manual_seed(4)
    w, grad = torch.randn(12, 20, generator=g), torch.randn(12, 20, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        plain = torch.nn.Parameter(w.clone())
        sharded = torch.nn.Parameter(distribute_tensor(w.clone(), cpu_mesh, [Shard(0)]))
        for p in (plain, sharded):
            opt = HostOffloadAdamW([p], lr=0.1, state_dtype=dtype)
            for _ in range(2):
                p.grad = grad.clone() if p is plain else distribute_tensor(grad.clone(), cpu_mesh, [Shard(0)])
                opt.step()
        assert isinstance(opt.state[sharded]["exp_avg"], DTensor)
        assert opt.state[sharded]["exp_avg"].to_local().dtype == dtype
        assert torch.equal(sharded.full_tensor(), plain.detach()), dtype
