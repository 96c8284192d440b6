"""Checkpoints cannot run code: a crafted `.metadata` or non-tensor entry whose pickle would create a file is refused
with one line (by the API, `train --resume` and `convert`) and the file never appears; with a trust key, an
unsigned, re-keyed or re-hashed checkpoint is refused."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from moestack.cli.app import main
from moestack.config.base import ConfigError
from moestack.train import checkpoint as ck
from moestack.train.checkpoint import CheckpointError, find_resumable, load_checkpoint, save_checkpoint
from moestack.train.safe_load import (
    UnsafeCheckpointError,
    UntrustedCheckpointError,
    read_dcp_metadata,
    read_trust_key,
)

TRAIN = ["-q", "--batch-size", "2", "--seq-len", "16", "--set", "logging.tensorboard=false", "--set", "eval_every=0",
         "--set", "data.eval_fraction=0"]


class _CreatesFile:
    """Unpickling this calls open(path, "w"): the file appears iff the payload ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class _RunsShell:
    def __init__(self, path: Path):
        self.cmd = f"touch {path}"

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _rehash(ckpt: Path) -> None:
    """What an attacker can do: recompute COMPLETE's digests after editing files (no key needed)."""
    complete = json.loads((ckpt / ck.COMPLETE).read_text())
    complete["files"] = {f: ck._digest(ckpt / f) for f in complete["files"]}
    (ckpt / ck.COMPLETE).write_text(json.dumps(complete))


def _plant_metadata(ckpt: Path, payload) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload, protocol=4))
    _rehash(ckpt)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)


def _model_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = _Tiny()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("payload", [_CreatesFile, _RunsShell])
def test_crafted_metadata_is_refused_and_never_runs(tmp_path, payload):
    marker = tmp_path / "pwned"
    model, opt = _model_opt()
    path = save_checkpoint(tmp_path / "ckpt", 1, model, opt, {"step": 1}, keep=1)
    _plant_metadata(path, {"state_dict_metadata": payload(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refers to '(io\.open|posix\.system)'") as err:
        load_checkpoint(path, *_model_opt(1))
    assert "\n" not in str(err.value) and "nothing from it was run" in str(err.value)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError):  # resume does not fall back past it: it is refused
        find_resumable(tmp_path / "ckpt")
    assert not marker.exists()


def test_crafted_non_tensor_entry_is_refused_and_never_runs(tmp_path):
    """A non-tensor entry (an optimizer hyper-parameter; DCP stores it with torch.save) whose pickle would run code:
    the metadata is genuine, the entry is read weights-only."""
    marker = tmp_path / "pwned"
    model, opt = _model_opt()
    opt.param_groups[0]["evil"] = _CreatesFile(marker)
    path = save_checkpoint(tmp_path / "ckpt", 1, model, opt, {"step": 1}, keep=1)
    assert not marker.exists()
    model2, opt2 = _model_opt(1)
    opt2.param_groups[0]["evil"] = "placeholder"  # so that the load asks for the entry
    with pytest.raises(UnsafeCheckpointError, match="evil") as err:
        load_checkpoint(path, model2, opt2)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_genuine_metadata_reads_the_same_as_pickle(tmp_path):
    model, opt = _model_opt()
    path = save_checkpoint(tmp_path / "ckpt", 1, model, opt, {"step": 1}, keep=1)
    want = pickle.loads((path / ".metadata").read_bytes())
    got = read_dcp_metadata(path)
    assert got.state_dict_metadata == want.state_dict_metadata and got.storage_data == want.storage_data


def test_garbage_metadata_and_meta_json_are_one_line_errors(tmp_path):
    model, opt = _model_opt()
    path = save_checkpoint(tmp_path / "ckpt", 1, model, opt, {"step": 1}, keep=1)
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    _rehash(path)
    with pytest.raises(CheckpointError, match="not a readable DCP metadata file"):
        load_checkpoint(path, *_model_opt())
    path = save_checkpoint(tmp_path / "ckpt2", 1, model, opt, {"t": torch.ones(2)}, keep=1)
    meta = json.loads((path / ck.META).read_text())
    meta["extra"]["t"]["dtype"] = "load"  # getattr(torch, "load") is a function, not a dtype
    (path / ck.META).write_text(json.dumps(meta))
    _rehash(path)
    with pytest.raises(CheckpointError, match=r"meta\.json 'extra' is unreadable"):
        load_checkpoint(path, *_model_opt())


def test_trust_key_signs_and_refuses(tmp_path):
    key_file, other = tmp_path / "key", tmp_path / "other"
    key_file.write_text("k" * 32)
    other.write_text("o" * 32)
    key, wrong = read_trust_key(key_file), read_trust_key(other)
    model, opt = _model_opt()
    signed = save_checkpoint(tmp_path / "signed", 1, model, opt, {"step": 1}, keep=1, trust_key=key)
    assert load_checkpoint(signed, *_model_opt(1), trust_key=key) == {"step": 1}
    with pytest.raises(UntrustedCheckpointError, match="signature does not match"):
        load_checkpoint(signed, *_model_opt(1), trust_key=wrong)
    unsigned = save_checkpoint(tmp_path / "unsigned", 1, model, opt, {"step": 1}, keep=1)
    with pytest.raises(UntrustedCheckpointError, match="not signed"):
        load_checkpoint(unsigned, *_model_opt(1), trust_key=key)
    assert load_checkpoint(unsigned, *_model_opt(1)) == {"step": 1}  # no key configured: digests only
    # an edit with re-hashed digests keeps the old signature: refused
    meta = json.loads((signed / ck.META).read_text())
    meta["extra"]["step"] = 99
    (signed / ck.META).write_text(json.dumps(meta))
    complete = json.loads((signed / ck.COMPLETE).read_text())
    _rehash(signed)
    assert json.loads((signed / ck.COMPLETE).read_text())["hmac"] == complete["hmac"]
    with pytest.raises(UntrustedCheckpointError, match="signature does not match"):
        load_checkpoint(signed, *_model_opt(1), trust_key=key)
    with pytest.raises(UntrustedCheckpointError):  # resume refuses instead of falling back
        find_resumable(tmp_path / "signed", key)


def test_trust_key_file_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.trust_key_file: cannot read"):
        read_trust_key(tmp_path / "absent")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError, match="holds 3 bytes; a key needs at least 16"):
        read_trust_key(tmp_path / "short")


@pytest.fixture(scope="module")
def _template_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("safe_load") / "run"
    assert main(["train", "--steps", "2", "--out", str(out), *TRAIN]) == 0
    return out


@pytest.fixture
def trained_run(_template_run, tmp_path):
    """A copy of a 2-step CLI run (checkpoint step_00000002) that the test may tamper with."""
    out = tmp_path / "run"
    shutil.copytree(_template_run, out)
    return out


@pytest.mark.slow
def test_train_resume_refuses_a_crafted_checkpoint(trained_run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    ckpt = trained_run / "checkpoints" / "step_00000002"
    _plant_metadata(ckpt, _CreatesFile(marker))
    capsys.readouterr()
    assert main(["train", "--steps", "4", "--out", str(trained_run), "--resume", *TRAIN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "refers to 'io.open'" in err and "step_00000002" in err
    assert not marker.exists()


@pytest.mark.slow
def test_convert_refuses_a_crafted_checkpoint(trained_run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    ckpt = trained_run / "checkpoints" / "step_00000002"
    _plant_metadata(ckpt, _RunsShell(marker))
    capsys.readouterr()
    hf = tmp_path / "hf"
    assert main(["convert", str(trained_run / "checkpoints"), str(hf), "--model", "tiny", "--family", "kimi_k3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "posix.system" in err
    assert not marker.exists() and not hf.exists()


@pytest.mark.slow
def test_train_with_trust_key_signs_and_resume_checks(trained_run, tmp_path, capsys):
    key = tmp_path / "key"
    key.write_text("s" * 24)
    keyed = [*TRAIN, "--set", f"checkpoint.trust_key_file={key}"]
    capsys.readouterr()
    # the run's step-2 checkpoint was written without the key: resuming with the key refuses it
    assert main(["train", "--steps", "4", "--out", str(trained_run), "--resume", *keyed]) == 2
    assert "not signed" in capsys.readouterr().err
    out = tmp_path / "keyed"
    assert main(["train", "--steps", "1", "--out", str(out), *keyed]) == 0
    assert "hmac" in json.loads((out / "checkpoints" / "step_00000001" / ck.COMPLETE).read_text())
    assert main(["train", "--steps", "2", "--out", str(out), "--resume", *keyed]) == 0
