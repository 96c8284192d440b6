"""Memory report: exact state bytes, activations by layer type, training state left untouched, the planner's
prediction alongside."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moestack.config.plan import RecomputePolicy
from moestack.config.train_spec import OptimizerSpec
from moestack.memory.recompute import apply_recompute
from moestack.memory.report import (
    CATEGORIES,
    format_report,
    measure_memory,
    predicted_memory,
    single_device_plan,
    state_breakdown,
)
from moestack.model.transformer import build_model
from moestack.train.optim import build_optimizer

B, T = 1, 32


@pytest.fixture(scope="module")
def trained(small_spec):
    """A small model after one AdamW step (optimizer state exists, grads cleared as the trainer leaves them)."""
    spec = small_spec
    model = build_model(spec, "cpu", seed=0)
    opt = build_optimizer(model, OptimizerSpec())
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    model(tokens, targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, tokens, targets


def test_state_breakdown_counts_distinct_storages():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.mid = nn.Linear(6, 6)
            self.lm_head = nn.Linear(6, 10, bias=False)
            self.lm_head.weight = self.embed.weight

    m = Tied()
    n = 10 * 6 + 6 * 6 + 6  # the tied weight once
    on_dev, host = state_breakdown(m, None, torch.device("cpu"))
    assert on_dev == {"weights": 4 * n, "gradients": 0, "optimizer": 0} and not any(host.values())
    opt = torch.optim.AdamW(m.parameters())
    (m.lm_head(m.mid(m.embed(torch.arange(4)))) ** 2).sum().backward()
    opt.step()
    on_dev, _ = state_breakdown(m, opt, torch.device("cpu"))
    assert on_dev == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}  # step counters are scalars


def test_measure_memory_cpu(trained):
    model, opt, tokens, targets = trained
    routers = {n: m.router.tokens_per_expert.clone() for n, m in model.moe_layers().items()}
    aux = {n: m.last_aux_loss for n, m in model.moe_layers().items()}
    plan = single_device_plan("tiny", T, B)
    report = measure_memory(model, opt, tokens, targets, plan=plan)
    # training state untouched
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(m.router.tokens_per_expert, routers[n]) for n, m in model.moe_layers().items())
    assert all(m.last_aux_loss is aux[n] for n, m in model.moe_layers().items())
    # state bytes are exact; gradients were measured after the backward
    n = sum(p.numel() for p in model.parameters())
    assert report.measured["weights"] == 4 * n and report.measured["gradients"] == 4 * n
    assert report.measured["optimizer"] == 8 * n
    assert set(report.activations_by_kind) == {"kda", "dense", "mla", "moe", "other"}
    assert all(v > 0 for v in report.activations_by_kind.values())
    assert report.measured["activations"] == sum(report.activations_by_kind.values())
    assert report.peak is None and report.measured["buffers"] is None
    # the planner's numbers for the same plan, and its parameter count agrees with the tensors
    assert set(report.predicted) == set(CATEGORIES)
    assert report.predicted == predicted_memory(model.spec, plan)
    assert abs(report.predicted["weights"] / report.measured["weights"] - 1) < 1e-3
    assert report.predicted_forward_activations > 0
    assert report.predicted_forward_activations >= report.predicted["activations"]  # the peak may hold fewer
    text = "\n".join(format_report(report))
    assert "allocator stats need CUDA" in text and "planner GiB" in text and "moe" in text
    assert "at end of forward" in text


def test_measured_activations_follow_recompute(trained):
    """Saved-tensor accounting sees what recompute removes: full recompute of every block leaves only the parts
    outside the blocks."""
    model, opt, tokens, targets = trained
    none = measure_memory(model, opt, tokens, targets)
    m = copy.deepcopy(model)
    apply_recompute(m, RecomputePolicy.uniform("full"))
    full = measure_memory(m, None, tokens, targets)
    assert full.measured["activations"] < 0.2 * none.measured["activations"]
    assert set(full.activations_by_kind) <= {"other"}


@pytest.mark.gpu
def test_measure_memory_cuda(trained, monkeypatch):
    from moestack.config.kernel_spec import KernelSpec
    from moestack.model.kernels import apply_kernels

    model, _, tokens, targets = trained
    m = copy.deepcopy(model).cuda()
    apply_kernels(m, KernelSpec(kda={"backend": "reference"}))
    opt = build_optimizer(m, OptimizerSpec())
    tokens, targets = tokens.repeat(2, 16).cuda(), targets.repeat(2, 16).cuda()
    m(tokens, targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    report = measure_memory(m, opt, tokens, targets, autocast=lambda: torch.autocast("cuda", torch.bfloat16),
                            plan=single_device_plan("tiny", tokens.shape[1], tokens.shape[0]))
    meas = report.measured
    assert all(meas[c] is not None and meas[c] >= 0 for c in CATEGORIES)
    assert report.peak >= meas["weights"] + meas["optimizer"]
    assert abs(sum(report.activations_by_kind.values()) - meas["activations"]) < 1
    assert "planner vs measured total" in "\n".join(format_report(report))


def test_trainer_memory_report(tmp_path):
    """`moestack train --memory-report`: the trainer's model measured on its next batch, next to the planner's
    one-device plan; training state is untouched."""
    from moestack.config.model_spec import load_model_spec
    from moestack.config.train_spec import load_train_spec
    from moestack.memory.report import trainer_memory_report
    from moestack.train.trainer import Trainer

    spec = load_train_spec(None, {"micro_batch_size": 2, "seq_len": 32, "steps": 1, "eval_every": 0,
                                  "logging.tensorboard": False, "logging.progress": False,
                                  "out_dir": str(tmp_path / "run")})
    trainer = Trainer(spec, load_model_spec("tiny"), log=lambda *_: None)
    trainer.train_step()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    lines = trainer_memory_report(trainer)
    text = "\n".join(lines)
    assert lines[0].startswith("memory report (cpu")
    for cat in CATEGORIES:
        assert f"  {cat}" in text
    assert "planner plan: one device (cpu), seq 32 x micro-batch 2" in text
    planner_weights = float(next(x for x in lines if x.strip().startswith("weights")).split()[-1])
    assert planner_weights > 0
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n


def test_cli_train_memory_report(tmp_path):
    """`moestack train --memory-report` prints the report after training."""
    from typer.testing import CliRunner

    from moestack.cli.app import app

    r = CliRunner().invoke(app, ["train", "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--quiet",
                                 "--out", str(tmp_path / "run"), "--set", "eval_every=0",
                                 "--set", "logging.tensorboard=false", "--memory-report"])
    assert r.exit_code == 0, r.output
    assert "memory report (cpu" in r.output and "planner GiB" in r.output and "at end of forward" in r.output
