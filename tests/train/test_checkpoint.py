"""Checkpoints: exact round trip, atomicity (crash mid-save), refusal of corrupted / partial / mismatched ones."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moestack.config.train_spec import OptimizerSpec, ScheduleSpec
from moestack.model.norm import RMSNorm
from moestack.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from moestack.train.optim import build_optimizer, build_scheduler


class _Net(nn.Module):
    def __init__(self, d_in: int = 6, d_hidden: int = 5, extra_layer: bool = False):
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden)
        self.norm = RMSNorm(d_hidden)
        self.down = nn.Linear(d_hidden, 3, bias=False)
        self.register_buffer("bias_state", torch.randn(3))  # like the router's selection bias
        if extra_layer:
            self.head = nn.Linear(3, 3)

    def forward(self, x):
        y = self.down(self.norm(self.up(x))) + self.bias_state
        return self.head(y) if hasattr(self, "head") else y


def _train(model, opt, sched, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _setup(seed: int, **net_kwargs):
    torch.manual_seed(seed)
    model = _Net(**net_kwargs)
    opt = build_optimizer(model, OptimizerSpec(lr=1e-2, weight_decay=0.1))
    sched = build_scheduler(opt, ScheduleSpec(warmup_steps=2), total_steps=20, base_lr=1e-2)
    return model, opt, sched


def _saved(tmp_path: Path, steps: int = 3, keep: int = 3):
    model, opt, sched = _setup(0)
    _train(model, opt, sched, steps, seed=1)
    extra = {"step": steps, "scheduler": sched.state_dict(), "rng": capture_rng_state(),
             "sampler": {"epoch": 1, "position": 7}, "spec": {"lr": 1e-2, "betas": [0.9, 0.95], "name": "tiny"},
             "array": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32),
             "bf16": torch.randn(3, 2).to(torch.bfloat16), "pair": (1, "a", None), "nan": float("nan")}
    path = save_checkpoint(tmp_path / "ckpt", steps, model, opt, extra, keep=keep)
    return path, model, opt, sched, extra


def test_round_trip_restores_everything_exactly(tmp_path):
    path, model, opt, sched, extra = _saved(tmp_path)
    assert path == tmp_path / "ckpt" / "step_00000003" and (path / "COMPLETE").is_file()
    assert latest_checkpoint(tmp_path / "ckpt") == path

    model2, opt2, sched2 = _setup(seed=123)  # different weights, fresh optimizer without state
    assert not torch.equal(model2.up.weight, model.up.weight)
    got = load_checkpoint(path, model2, opt2)
    sched2.load_state_dict(got["scheduler"])

    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys() and len(s1["state"]) == 4
    for k in s1["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name]), (k, name)

    assert got["step"] == 3 and got["sampler"] == extra["sampler"] and got["spec"] == extra["spec"]
    assert got["scheduler"] == extra["scheduler"] and got["pair"] == (1, "a", None)
    assert np.array_equal(got["array"], extra["array"]) and got["array"].dtype == np.float32
    assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"], extra["bf16"])
    assert got["nan"] != got["nan"]

    # the continuation is bit-identical: same weights, optimizer moments, lr
    _train(model, opt, sched, 2, seed=9)
    _train(model2, opt2, sched2, 2, seed=9)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_model_only_load_and_missing_optimizer_state(tmp_path):
    path, model, *_ = _saved(tmp_path)
    model2, _, _ = _setup(seed=5)
    load_checkpoint(path, model2)  # e.g. for evaluation
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    bare = save_checkpoint(tmp_path / "bare", 1, model, None, {}, keep=1)
    model3, opt3, _ = _setup(seed=6)
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        load_checkpoint(bare, model3, opt3)


def test_rng_state_round_trip(tmp_path):
    model, opt, _ = _setup(0)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng_state()
    want = (random.random(), np.random.standard_normal(4), torch.randn(4))
    path = save_checkpoint(tmp_path, 1, model, opt, {"rng": state}, keep=1)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # disturb all generators
    restore_rng_state(load_checkpoint(path, model, opt)["rng"])
    got = (random.random(), np.random.standard_normal(4), torch.randn(4))
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_keep_prunes_oldest_and_resave_replaces(tmp_path):
    model, opt, sched = _setup(0)
    root = tmp_path / "ckpt"
    for step in (10, 20, 30, 40):
        save_checkpoint(root, step, model, opt, {"step": step}, keep=2)
    assert sorted(p.name for p in root.iterdir() if p.name != ".lock") == ["step_00000030", "step_00000040"]
    _train(model, opt, sched, 1, seed=0)
    save_checkpoint(root, 40, model, opt, {"step": 41}, keep=2)  # same step again: replaced in place
    assert sorted(p.name for p in root.iterdir() if p.name != ".lock") == ["step_00000030", "step_00000040"]
    model2, opt2, _ = _setup(7)
    assert load_checkpoint(root / "step_00000040", model2, opt2) == {"step": 41}
    assert torch.equal(model2.up.weight, model.up.weight)


def test_tmp_and_incomplete_dirs_are_ignored(tmp_path):
    path, *_ = _saved(tmp_path, steps=2)
    root = path.parent
    (root / ".tmp_step_00000009").mkdir()
    (root / ".tmp_step_00000009" / "junk").write_text("half written")
    (root / "step_00000008").mkdir()  # no COMPLETE marker (e.g. copied by hand, interrupted)
    assert latest_checkpoint(root) == path
    assert latest_checkpoint(tmp_path / "nothing_here") is None


class _Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so no handler in the save path can catch and tidy up."""


def test_kill_during_save_leaves_only_tmp(tmp_path, monkeypatch):
    import moestack.train.checkpoint as ck

    root = tmp_path / "ckpt"
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 1, seed=0)
    save_checkpoint(root, 1, model, opt, {"step": 1}, keep=2)
    real = ck._write_synced

    def die_before_complete(path, text):
        if path.name == ck.COMPLETE:  # the tensors and meta.json are on disk, the marker is not
            raise _Killed
        real(path, text)

    monkeypatch.setattr(ck, "_write_synced", die_before_complete)
    with pytest.raises(_Killed):
        save_checkpoint(root, 2, model, opt, {"step": 2}, keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir() if p.name != ".lock") == [".tmp_step_00000002", "step_00000001"]
    assert (root / ".tmp_step_00000002" / ".metadata").is_file()  # it really died mid-save
    assert latest_checkpoint(root) == root / "step_00000001"
    assert load_checkpoint(root / "step_00000001", *_fresh()) == {"step": 1}
    save_checkpoint(root, 3, model, opt, {"step": 3}, keep=2)  # the next save cleans the leftovers up
    assert sorted(p.name for p in root.iterdir() if p.name != ".lock") == ["step_00000001", "step_00000003"]


def _fresh():
    model, opt, _ = _setup(11)
    return model, opt


def _one_line(err: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {path}: ")
    return msg


def test_corrupted_file_is_refused(tmp_path):
    path, *_ = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x5A  # same size, one byte flipped
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, *_fresh())
    assert f"checksum mismatch in '{shard.name}'" in _one_line(err, path)


def test_edited_meta_is_refused(tmp_path):
    path, *_ = _saved(tmp_path)
    meta = path / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 3', '"step": 4'))
    with pytest.raises(CheckpointError, match="checksum mismatch in 'meta.json'"):
        load_checkpoint(path, *_fresh())


def test_missing_complete_is_refused(tmp_path):
    path, *_ = _saved(tmp_path)
    (path / "COMPLETE").unlink()
    assert latest_checkpoint(path.parent) is None
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, *_fresh())
    assert "no COMPLETE marker" in _one_line(err, path)


def test_deleted_and_truncated_files_are_refused(tmp_path):
    path, *_ = _saved(tmp_path)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, *_fresh())
    assert "missing file '.metadata'" in _one_line(err, path)

    path2, *_ = _saved(tmp_path / "b")
    shard = next(path2.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"file '{shard.name}' is \d+ bytes, expected \d+ \(truncated\?\)"):
        load_checkpoint(path2, *_fresh())


def test_shape_and_name_mismatch_are_refused(tmp_path):
    path, *_ = _saved(tmp_path)
    torch.manual_seed(0)
    wide = _Net(d_hidden=7)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, wide, build_optimizer(wide, OptimizerSpec()))
    assert "tensor 'up.weight' has shape [5, 6] in the checkpoint but [7, 6] in the model" in _one_line(err, path)

    bigger = _Net(extra_layer=True)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, bigger, build_optimizer(bigger, OptimizerSpec()))
    assert ("missing tensor 'head.weight' (model has it, checkpoint does not); was it saved from a different "
            "--model?") in _one_line(err, path)

    class _Smaller(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(6, 5)
            self.norm = RMSNorm(5)
            self.register_buffer("bias_state", torch.randn(3))

    with pytest.raises(CheckpointError, match="unexpected tensor 'down.weight' \\(checkpoint has it, model does not"):
        load_checkpoint(path, _Smaller())


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "missing", *_fresh())
    with pytest.raises(TypeError, match=r"extra\['bad'\]: cannot store a object"):
        model, opt = _fresh()
        save_checkpoint(tmp_path, 1, model, opt, {"bad": object()}, keep=1)
    assert not any(tmp_path.iterdir())  # refused before touching the disk
