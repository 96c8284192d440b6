"""Resume reproduces the uninterrupted run bitwise for the optimizers whose stochastic rounding draws noise.

Each test: 3 steps, state_dict, 3 more steps -> params A; a fresh model + optimizer loads the params after step 3
and that state dict, 3 steps -> params B; A == B bitwise. The controls drop the rounding-noise entry (an old
checkpoint): it loads with a warning and the params differ, so the equality checks can fail.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from moestack.memory.host_adamw import HostOffloadAdamW
from moestack.train.checkpoint import load_checkpoint, save_checkpoint
from moestack.train.optim import param_groups
from moestack.train.optimizers import AdamWBF16, CPUOffloadAdamW

KEY = "rounding_rng"  # HostOffloadAdamW.RNG_KEY


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 8))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> None:
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _host_bf16(model):
    return HostOffloadAdamW(param_groups(model, 0.1), lr=1e-2, state_dtype=torch.bfloat16, seed=7)


def _host_fp32(model):
    return HostOffloadAdamW(param_groups(model, 0.1), lr=1e-2, state_dtype=torch.float32, seed=7)


def _bf16(model):
    return AdamWBF16(param_groups(model, 0.1), lr=1e-2, seed=7)


def _offload_bf16(model):
    return CPUOffloadAdamW(param_groups(model, 0.1), lr=1e-2, state_dtype=torch.bfloat16, seed=7)


def _resume_pair(make_opt, edit_sd=lambda sd: sd):
    """(params A of the uninterrupted run, params B of the resumed one) after 6 steps."""
    model = _model()
    opt = make_opt(model)
    _steps(model, opt, 0, 3)
    sd = copy.deepcopy(opt.state_dict())
    params3 = copy.deepcopy(model.state_dict())
    _steps(model, opt, 3, 3)
    a = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = _model()
    opt2 = make_opt(model2)
    model2.load_state_dict(params3)
    opt2.load_state_dict(edit_sd(sd))
    _steps(model2, opt2, 3, 3)
    return a, model2.state_dict()


def _bitwise(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _drop_rng(sd: dict) -> dict:
    for group in sd["param_groups"]:
        group.pop(KEY, None)
    return sd


@pytest.mark.parametrize("make_opt", [_host_bf16, _host_fp32], ids=["host_bf16", "host_fp32"])
def test_resume_bitwise(make_opt):
    a, b = _resume_pair(make_opt)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_state_dict_carries_rounding_rng_and_not_for_fp32():
    model = _model()
    opt = _host_bf16(model)
    _steps(model, opt, 0, 1)
    sd = opt.state_dict()
    assert KEY in sd["param_groups"][0] and len(sd["param_groups"][0][KEY]["per_rank"]) == 1
    opt.load_state_dict(sd)
    assert all(KEY not in g for g in opt.param_groups)  # not left behind as a hyper-parameter
    fp32 = _host_fp32(model)
    _steps(model, fp32, 0, 1)
    assert all(KEY not in g for g in fp32.state_dict()["param_groups"])


def test_without_rng_entry_warns_and_diverges():
    """An old state dict (no rounding-noise entry) loads with one warning; the noise restarts, so the resumed
    params differ: the bitwise test above can fail."""
    with pytest.warns(UserWarning, match="rounding-noise") as rec:
        a, b = _resume_pair(_host_bf16, _drop_rng)
    assert len([w for w in rec if "rounding-noise" in str(w.message)]) == 1
    assert not _bitwise(a, b)


def test_resume_through_trainer_checkpoint(tmp_path):
    """moestack.train.checkpoint (DCP get_state_dict / set_state_dict) writes and reads the entry back."""
    model = _model()
    opt = _host_bf16(model)
    _steps(model, opt, 0, 3)
    save_checkpoint(tmp_path, 3, model, opt, extra={}, keep=1)
    _steps(model, opt, 3, 3)
    a = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = _model()
    opt2 = _host_bf16(model2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "noise restarts" warning: the entry came back
        load_checkpoint(tmp_path / "step_00000003", model2, opt2)
    _steps(model2, opt2, 3, 3)
    b = model2.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.xfail(strict=True, reason="checkpoint.py: dcp.load is strict, so a checkpoint saved before the "
                   "rounding-noise entry fails on the missing key (fix belongs in moestack/train/checkpoint.py)")
def test_old_checkpoint_through_trainer_checkpoint(tmp_path, monkeypatch):
    model = _model()
    opt = _host_bf16(model)
    _steps(model, opt, 0, 3)
    monkeypatch.setattr(HostOffloadAdamW, "state_dict", CPUOffloadAdamW.state_dict)  # as saved before the fix
    save_checkpoint(tmp_path, 3, model, opt, extra={}, keep=1)
    monkeypatch.undo()
    model2 = _model()
    with pytest.warns(UserWarning, match="rounding-noise"):
        load_checkpoint(tmp_path / "step_00000003", model2, _host_bf16(model2))


@pytest.mark.xfail(strict=True, reason="AdamWBF16 / CPUOffloadAdamW (moestack/train/optimizers.py, outside this "
                   "change) do not save their rounding torch.Generator state")
@pytest.mark.parametrize("make_opt", [_bf16, _offload_bf16], ids=["AdamWBF16", "CPUOffloadAdamW_bf16"])
def test_resume_bitwise_train_optimizers(make_opt):
    a, b = _resume_pair(make_opt)
    assert _bitwise(a, b)
