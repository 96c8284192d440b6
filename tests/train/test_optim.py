"""Optimizer parameter groups, the learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moestack.config.train_spec import OptimizerSpec, ScheduleSpec
from moestack.model.norm import RMSNorm
from moestack.train.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_factor


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 5)  # weight decays, bias does not
        self.norm = RMSNorm(5)
        self.A_log = nn.Parameter(torch.randn(3))
        self.A_log._no_weight_decay = True
        self.gate_table = nn.Parameter(torch.randn(3, 5))  # 2-D but marked: no decay
        self.gate_table._no_weight_decay = True
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, ids):
        h = self.norm(self.proj(self.embed(ids)))
        return (h @ self.gate_table.T).sum() + self.A_log.exp().sum()


def _ids(groups) -> list[set[int]]:
    return [{id(p) for p in g["params"]} for g in groups]


def test_param_groups():
    torch.manual_seed(0)
    m = _Toy()
    opt = build_optimizer(m, OptimizerSpec(lr=1e-3, weight_decay=0.25))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.25 and no_decay["weight_decay"] == 0.0
    assert _ids([decay])[0] == {id(m.embed.weight), id(m.proj.weight)}
    assert _ids([no_decay])[0] == {id(m.proj.bias), id(m.norm.weight), id(m.A_log), id(m.gate_table)}
    assert not opt.defaults["fused"]  # CPU params: no fused kernel


def test_adamw_step_matches_reference():
    """One AdamW step against the textbook update, in fp64: weight decay only on the decay group."""
    torch.manual_seed(1)
    m = _Toy().double()
    spec = OptimizerSpec(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    opt = build_optimizer(m, spec)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m(torch.randint(0, 11, (2, 7))).backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    opt.step()
    b1, b2 = spec.betas
    no_decay = {"proj.bias", "norm.weight", "A_log", "gate_table"}
    for name, p in m.named_parameters():
        if name == "frozen":
            assert torch.equal(p, before[name])
            continue
        g, p0 = grads[name], before[name]
        wd = 0.0 if name in no_decay else spec.weight_decay
        m_hat = (1 - b1) * g / (1 - b1)
        v_hat = (1 - b2) * g * g / (1 - b2)
        want = p0 * (1 - spec.lr * wd) - spec.lr * m_hat / (v_hat.sqrt() + spec.eps)
        torch.testing.assert_close(p.detach(), want, rtol=1e-12, atol=1e-12, msg=name)


def _lrs(spec: ScheduleSpec, total: int, base: float) -> list[float]:
    p = nn.Parameter(torch.randn(2, 2))
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [nn.Parameter(torch.randn(3))]}], lr=123.0)
    sched = build_scheduler(opt, spec, total, base)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == out[-1]
        opt.step()
        sched.step()
    return out


def test_cosine_schedule_values():
    spec = ScheduleSpec(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    base, total = 3e-3, 51
    lrs = _lrs(spec, total, base)
    assert lrs[0] == pytest.approx(base / 11)
    assert lrs[9] == pytest.approx(base * 10 / 11)
    assert lrs[10] == pytest.approx(base)  # warm-up end: the peak
    assert lrs[30] == pytest.approx(base * (0.1 + 0.9 * 0.5))  # half way through the decay
    assert lrs[-1] == pytest.approx(0.1 * base)  # last step: min_lr_ratio * lr
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a > b for a, b in zip(lrs[10:-1], lrs[11:]))
    for step in range(10, total):  # matches the closed form
        progress = (step - 10) / (total - 1 - 10)
        assert lrs[step] == pytest.approx(base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))))
    assert lr_factor(total + 5, spec, total) == pytest.approx(0.1)  # held at the floor past the end


def test_constant_and_no_warmup_schedules():
    lrs = _lrs(ScheduleSpec(warmup_steps=4, decay="constant"), 12, 1e-3)
    assert lrs[:5] == pytest.approx([1e-3 * k / 5 for k in range(1, 6)])
    assert lrs[4:] == pytest.approx([1e-3] * 8)
    lrs = _lrs(ScheduleSpec(warmup_steps=0, decay="cosine", min_lr_ratio=0.0), 5, 2e-3)
    assert lrs[0] == pytest.approx(2e-3) and lrs[-1] == pytest.approx(0.0, abs=1e-15)


def _with_grads(seed: int, scale: float) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (5,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    params.append(nn.Parameter(torch.randn(3)))  # no grad: ignored
    return params


def _ref_norm(params) -> float:
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))


def test_clip_grad_norm():
    params = _with_grads(0, scale=3.0)
    before = [p.grad.clone() for p in params[:3]]
    ref = _ref_norm(params)
    norm = clip_grad_norm(params, max_norm=1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(ref, rel=1e-6)  # the pre-clip norm
    assert _ref_norm(params) == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params, before):  # same direction
        torch.testing.assert_close(p.grad, g / ref, rtol=1e-5, atol=1e-6)

    small = _with_grads(1, scale=0.01)
    kept = [p.grad.clone() for p in small[:3]]
    assert clip_grad_norm(small, max_norm=1.0).item() == pytest.approx(_ref_norm(small), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(small, kept))

    off = _with_grads(2, scale=5.0)
    kept = [p.grad.clone() for p in off[:3]]
    assert clip_grad_norm(iter(off), max_norm=0).item() == pytest.approx(_ref_norm(off), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(off, kept))

    assert clip_grad_norm([nn.Parameter(torch.randn(2))], max_norm=1.0).item() == 0.0
