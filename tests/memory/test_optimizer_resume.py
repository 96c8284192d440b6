"""Resume reproduces the uninterrupted run bitwise for the optimizers whose stochastic rounding draws noise.

Each test: 3 steps, state_dict, 3 more steps -> params A; a fresh model + optimizer loads the params after step 3
and that state dict, 3 steps -> params B; A == B bitwise. The controls drop the rounding-noise entry (an old
checkpoint): it loads with a warning and the params differ, so the equality checks can fail. Through the trainer's
checkpoints (DCP, strict): the entry comes back, and a checkpoint saved without it still loads (one warning).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from moestack.memory.adamw import AdamWBF16, CPUOffloadAdamW
from moestack.memory.host_adamw import HostOffloadAdamW
from moestack.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moestack.train.optim import param_groups

KEY = "rounding_rng"  # moestack.memory.adamw.ROUNDING_RNG_KEY


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


BF16 = [_host_bf16, _bf16, _offload_bf16]
BF16_IDS = ["host_bf16", "AdamWBF16", "CPUOffloadAdamW_bf16"]


@pytest.mark.parametrize("make_opt", [*BF16, _host_fp32], ids=[*BF16_IDS, "host_fp32"])
def test_resume_bitwise(make_opt):
    a, b = _resume_pair(make_opt)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


@pytest.mark.parametrize("make_opt", BF16, ids=BF16_IDS)
def test_state_dict_carries_rounding_rng(make_opt):
    model = _model()
    opt = make_opt(model)
    _steps(model, opt, 0, 1)
    sd = opt.state_dict()
    assert KEY in sd["param_groups"][0] and len(sd["param_groups"][0][KEY]["per_rank"]) == 1
    opt.load_state_dict(sd)
    assert all(KEY not in g for g in opt.param_groups)  # not left behind as a hyper-parameter


@pytest.mark.parametrize("make_opt", [_host_fp32, lambda m: CPUOffloadAdamW(param_groups(m, 0.1), lr=1e-2)],
                         ids=["host_fp32", "CPUOffloadAdamW_fp32"])
def test_no_rounding_rng_for_fp32_states(make_opt):
    model = _model()
    opt = make_opt(model)
    _steps(model, opt, 0, 1)
    assert all(KEY not in g for g in opt.state_dict()["param_groups"])


def test_loaded_generator_state_waits_for_its_device():
    """AdamWBF16 creates a generator per device on first use: a state loaded before the first step is applied then,
    and a state dict taken in between still carries it."""
    model = _model()
    opt = _bf16(model)
    _steps(model, opt, 0, 2)
    sd = copy.deepcopy(opt.state_dict())
    model2 = _model()
    opt2 = _bf16(model2)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["param_groups"][0][KEY] == sd["param_groups"][0][KEY]


@pytest.mark.parametrize("make_opt", BF16, ids=BF16_IDS)
def test_without_rng_entry_warns_and_diverges(make_opt):
    """An old state dict (no rounding-noise entry) loads with one warning; the noise restarts, so the resumed
    params differ: the bitwise tests above can fail."""
    with pytest.warns(UserWarning, match="rounding-noise") as rec:
        a, b = _resume_pair(make_opt, _drop_rng)
    assert len([w for w in rec if "rounding-noise" in str(w.message)]) == 1
    assert not _bitwise(a, b)


@pytest.mark.parametrize("make_opt", BF16, ids=BF16_IDS)
def test_resume_through_trainer_checkpoint(tmp_path, make_opt):
    """moestack.train.checkpoint (DCP get_state_dict / set_state_dict) writes and reads the entry back."""
    model = _model()
    opt = make_opt(model)
    _steps(model, opt, 0, 3)
    save_checkpoint(tmp_path, 3, model, opt, extra={}, keep=1)
    _steps(model, opt, 3, 3)
    a = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = _model()
    opt2 = make_opt(model2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "noise restarts" warning: the entry came back
        load_checkpoint(tmp_path / "step_00000003", model2, opt2)
    _steps(model2, opt2, 3, 3)
    b = model2.state_dict()
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def _save_old(tmp_path, model, opt, monkeypatch) -> None:
    """Save as before the fix: the optimizer's state dict has no rounding-noise entry."""
    monkeypatch.setattr(type(opt), "_rounding_state", lambda self: None)
    assert all(KEY not in g for g in opt.state_dict()["param_groups"])
    save_checkpoint(tmp_path, 3, model, opt, extra={}, keep=1)
    monkeypatch.undo()


@pytest.mark.parametrize("make_opt", BF16, ids=BF16_IDS)
def test_old_checkpoint_through_trainer_checkpoint(tmp_path, monkeypatch, make_opt):
    """A checkpoint saved before the entry existed still loads into an optimizer that keeps it (dcp.load is strict):
    one warning, the states come back, the noise restarts (so the continuation differs from the uninterrupted one)."""
    model = _model()
    opt = make_opt(model)
    _steps(model, opt, 0, 3)
    _save_old(tmp_path, model, opt, monkeypatch)
    states = copy.deepcopy(opt.state_dict()["state"])
    _steps(model, opt, 3, 3)
    a = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = _model()
    opt2 = make_opt(model2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        load_checkpoint(tmp_path / "step_00000003", model2, opt2)
    noise = [str(w.message) for w in rec if "rounding" in str(w.message)]
    assert len(noise) == 1 and "rounding noise restarts: checkpoint predates" in noise[0], noise
    got = opt2.state_dict()
    assert KEY in got["param_groups"][0]  # the optimizer keeps (and will save) its fresh noise state
    for pid, st in states.items():
        for k, v in st.items():
            g = got["state"][pid][k]
            assert torch.equal(g, v) if isinstance(v, torch.Tensor) else g == v, (pid, k)
    _steps(model2, opt2, 3, 3)
    assert not _bitwise(a, model2.state_dict())


def test_old_checkpoint_other_missing_entry_still_fails(tmp_path, monkeypatch):
    """Only the rounding-noise entry may be missing: a checkpoint without another param-group entry is refused."""
    model = _model()
    opt = _bf16(model)
    _steps(model, opt, 0, 1)

    def drop_eps(_opt, sd):
        for group in sd["param_groups"]:
            group.pop("eps")

    handle = opt.register_state_dict_post_hook(drop_eps)
    _save_old(tmp_path, model, opt, monkeypatch)
    handle.remove()
    model2 = _model()
    with pytest.raises(CheckpointError, match=r"missing entry 'optim\.param_groups\.0\.eps'") as err:
        load_checkpoint(tmp_path / "step_00000003", model2, _bf16(model2))
    assert "\n" not in str(err.value)
