"""The step's end without host syncs (moestack/train/step_update.py): the on-device skip of torch's fused AdamW, the
clip folded into it, the device-side clip coefficient, and how often the trainer reads the device per step."""

from __future__ import annotations

import sys

import pytest
import torch

from moestack.config.model_spec import ModelSpec, load_model_spec
from moestack.config.train_spec import TrainSpec
from moestack.train.optim import build_scheduler, param_groups
from moestack.train.step_update import clip_coefficient, fused_skip_supported, read_stats, step_optimizer
from moestack.train.trainer import Trainer


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    data = load_model_spec("tiny").model_dump()
    data.update(num_layers=2, full_attention_layers=[2], dense_layers=[1])
    return ModelSpec.model_validate(data)


def _trainer(spec, tmp_path, fused: bool, clip: float = 1.0, steps: int = 4) -> Trainer:
    train = TrainSpec(out_dir=str(tmp_path), steps=steps, micro_batch_size=1, grad_accum_steps=2, seq_len=16,
                      device="cpu", precision="fp32", optimizer={"grad_clip": clip},
                      logging={"tensorboard": False, "progress": False})
    tr = Trainer(train, spec, log=lambda *a, **k: None)
    if fused:  # torch's fused CPU kernel: the path CUDA runs take (build_optimizer fuses on CUDA only)
        o = train.optimizer
        tr.optimizer = torch.optim.AdamW(param_groups(tr.model, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps,
                                         fused=True)
        tr.scheduler = build_scheduler(tr.optimizer, train.schedule, train.steps, o.lr)
    return tr


def test_fused_skip_leaves_everything(spec, tmp_path):
    """A non-finite loss under the fused optimizer: the update is skipped inside the kernel (weights, moments, step
    counts bitwise unchanged), the scheduler does not advance, train_step returns None; the next step runs."""
    tr = _trainer(spec, tmp_path, fused=True)
    assert fused_skip_supported(tr.optimizer)
    assert tr.train_step() is not None
    weights = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    moments = {id(p): s["exp_avg"].clone() for p, s in tr.optimizer.state.items()}
    steps = {id(p): s["step"].clone() for p, s in tr.optimizer.state.items()}
    lr = tr.scheduler.get_last_lr()
    real = tr.model.forward
    tr.model.forward = lambda *a, **k: real(*a, **k) * float("nan")
    assert tr.train_step() is None
    for n, p in tr.model.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n
    for p, s in tr.optimizer.state.items():
        assert torch.equal(s["exp_avg"], moments[id(p)]) and torch.equal(s["step"], steps[id(p)])
    assert tr.scheduler.get_last_lr() == lr
    tr.model.forward = real
    stats = tr.train_step()
    assert stats is not None and all(float(s["step"]) == 2 for s in tr.optimizer.state.values())


def test_fold_matches_clip_then_step(spec, tmp_path):
    """The clip folded into the fused kernel (grad_scale = 1 / coefficient) against an explicit clip before the same
    kernel: the same trajectory to fp32 rounding (the quotient may differ from the product in the last bit)."""
    runs = {}
    for fold in (True, False):
        tr = _trainer(spec, tmp_path / str(fold), fused=True, clip=0.05)  # small: every step clips
        if not fold:
            tr._grad_norm = lambda params, tr=tr: (torch.nn.utils.clip_grad_norm_(params, 0.05).float(), True)
        runs[fold] = ([tr.train_step() for _ in range(3)], {n: p.detach() for n, p in tr.model.named_parameters()})
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert a.grad_norm > 0.05 and a.loss == pytest.approx(b.loss, rel=1e-6)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for name, p in runs[True][1].items():
        torch.testing.assert_close(p, runs[False][1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_clip_coefficient_and_unfused_step():
    """The device coefficient is the host formula in float64 (1 where the norm is not finite); an unfused optimizer
    clips on the device and skips on the host flag."""
    norm = torch.tensor(4.0)
    assert clip_coefficient(norm, 1.0).item() == 1.0 / (4.0 + 1e-6)
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(float("inf")), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(float("nan")), 1.0).item() == 1.0
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.full((3,), 2.0, dtype=torch.float64)
    norm = p.grad.norm().float()
    assert step_optimizer(opt, [p], norm, torch.isfinite(norm), max_norm=1.0, clipped=False) is True
    coef = 1.0 / (float(norm) + 1e-6)
    assert torch.equal(p.detach(), torch.ones(3, dtype=torch.float64) - 2.0 * coef)
    before = p.detach().clone()
    assert step_optimizer(opt, [p], norm, torch.tensor(False), max_norm=1.0, clipped=False) is False
    assert torch.equal(p.detach(), before)
    assert read_stats({"a": torch.tensor(1.5), "b": torch.tensor(True), "c": torch.tensor(3, dtype=torch.int64)}) \
        == {"a": 1.5, "b": 1.0, "c": 3.0}


@pytest.mark.parametrize("fused, reads", [(True, 1), (False, 2)])
def test_host_reads_per_step(spec, tmp_path, monkeypatch, fused, reads):
    """The trainer's own code reads the device once per step with the fused optimizer (the stats at the end) and twice
    without (plus the skip flag before stepping). Counted: Tensor.item / tolist / __bool__ / __float__ / __int__
    called from moestack/train (the CPU op fallbacks below the model read the host too; the GPU test below checks
    the whole step)."""
    tr = _trainer(spec, tmp_path, fused=fused)
    tr.train_step()  # first step: lazy state, imports
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "moestack/train/" in caller.replace("\\", "/"):
                calls.append((_name, caller.rsplit("/", 1)[-1], sys._getframe(1).f_lineno))
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    assert tr.train_step() is not None
    assert len(calls) == reads, calls


@pytest.mark.gpu
def test_no_host_sync_in_cuda_step(spec, tmp_path, monkeypatch):
    """On CUDA (bf16, fused AdamW, Triton routing, static-capacity MoE): no device-to-host sync from the first
    micro-batch to the stats read at the end of the step (torch.cuda.set_sync_debug_mode('error') raises on one)."""
    import moestack.train.trainer as trainer_mod

    data = spec.model_dump()
    data["moe"]["capacity_factor"] = 2.0
    model_spec = ModelSpec.model_validate(data)
    train = TrainSpec(out_dir=str(tmp_path), steps=3, micro_batch_size=2, grad_accum_steps=2, seq_len=128,
                      device="cuda", precision="bf16", logging={"tensorboard": False, "progress": False})
    tr = Trainer(train, model_spec, log=lambda *a, **k: None)
    assert fused_skip_supported(tr.optimizer)
    tr.train_step()  # warm-up: autotuning, lazy state
    real_read = trainer_mod.read_stats

    def read_outside_debug(values):
        torch.cuda.set_sync_debug_mode(0)
        return real_read(values)

    monkeypatch.setattr(trainer_mod, "read_stats", read_outside_debug)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = tr.train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stats is not None


def test_step_leaves_the_aux_loss_scale_as_it_found_it(spec, tmp_path):
    """The aux-loss scale is process-wide (moestack/model/aux_loss.py): a step at grad_accum_steps 2 uses 1/2 for its
    own forwards and puts the caller's back, so a later model in the process gets its aux gradients unscaled."""
    from moestack.model import aux_loss

    tr = _trainer(spec, tmp_path, fused=False)
    seen = []
    real = aux_loss._AttachAuxLoss.apply
    aux_loss._AttachAuxLoss.apply = lambda x, loss, scale: (seen.append(scale), real(x, loss, scale))[1]
    try:
        assert tr.train_step() is not None
    finally:
        aux_loss._AttachAuxLoss.apply = real
    assert seen and set(seen) == {0.5}
    assert aux_loss._SCALE[0] == 1.0
