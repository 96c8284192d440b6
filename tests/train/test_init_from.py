"""--init-from: model weights from a moestack checkpoint or an HF directory, everything else fresh; names and shapes
checked with one-line errors; the field recorded in the run directory; the HF layout kept for the export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _dist import small_model_spec  # noqa: E402
from _k3_small import small_k3_config  # noqa: E402

from moestack.config.base import ConfigError, read_yaml  # noqa: E402
from moestack.config.hf import hf_config_to_spec  # noqa: E402
from moestack.config.train_spec import load_train_spec  # noqa: E402
from moestack.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from moestack.train.checkpoint import CheckpointError  # noqa: E402
from moestack.train.convert import ConvertError, export_hf  # noqa: E402
from moestack.train.trainer import Trainer  # noqa: E402

OPTS = {"seq_len": 16, "micro_batch_size": 2, "logging.every": 1, "logging.tensorboard": False,
        "logging.progress": False, "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1,
        "optimizer.lr": 3e-3, "device": "cpu", "precision": "fp32"}


def _spec(out: Path, steps: int = 2, **over):
    return load_train_spec(None, {**OPTS, "out_dir": str(out), "steps": steps, **over})


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init_from")
    spec = small_model_spec()
    src = Trainer(_spec(tmp / "src", steps=3), spec, log=lambda *a: None)
    src.fit()
    return {"tmp": tmp, "model_spec": spec, "weights": _state(src.model), "run": tmp / "src"}


def test_init_from_moestack_checkpoint(source):
    tmp, lines = source["tmp"], []
    for path in (source["run"], source["run"] / "checkpoints", source["run"] / "checkpoints" / "step_00000003"):
        tr = Trainer(_spec(tmp / "new", init_from=str(path)), source["model_spec"], log=lines.append)
        got = _state(tr.model)
        assert got.keys() == source["weights"].keys()
        for k, v in source["weights"].items():
            assert torch.equal(got[k], v), k
        assert tr.step == 0 and not tr.optimizer.state  # fresh optimizer
        assert tr.scheduler.last_epoch == 0 and tr.sampler.state_dict()["position"] == 0
        assert tr.optimizer.param_groups[0]["lr"] == tr.scheduler.get_last_lr()[0] < OPTS["optimizer.lr"]  # warm-up
    assert any(line.startswith("initialised from ") and "step 3" in line for line in lines), lines
    fresh = Trainer(_spec(tmp / "new2"), source["model_spec"], log=lambda *a: None)  # the seed's init differs
    assert not torch.equal(_state(fresh.model)["embed.weight"], source["weights"]["embed.weight"])
    tr = Trainer(_spec(tmp / "rec", steps=1, init_from=str(source["run"])), source["model_spec"], log=lambda *a: None)
    tr.fit()
    assert read_yaml(tmp / "rec" / "train.yaml")["init_from"] == str(source["run"])


def test_init_from_refuses_another_model(source, tmp_path):
    other = small_model_spec().model_copy(update={"hidden_size": 32})
    with pytest.raises(CheckpointError, match=r"has shape \[.*\] in the checkpoint but \[.*\] in the model"):
        Trainer(_spec(tmp_path / "x", init_from=str(source["run"])), other, log=lambda *a: None)
    with pytest.raises(ConfigError, match="is neither a moestack checkpoint"):
        Trainer(_spec(tmp_path / "y", init_from=str(tmp_path)), source["model_spec"], log=lambda *a: None)


def _k3(tmp: Path):
    cfg = small_k3_config()
    path = tmp / "k3-small.config.json"
    path.write_text(json.dumps(cfg))
    return hf_config_to_spec(cfg, "k3-small").spec, path


def test_init_from_hf_release_layout(tmp_path):
    """An HF directory in the released K3 layout (MXFP4 experts, padded A_log): the run starts from exactly the
    dequantised values; its checkpoints keep the HF layout, so the export writes the release layout back."""
    spec, cfg_path = _k3(tmp_path)
    src = Trainer(_spec(tmp_path / "src", steps=1), spec, log=lambda *a: None)
    weights = _state(src.model)
    export_hf(weights, spec, tmp_path / "hf", config=cfg_path.read_text(), max_shard_bytes=50_000)
    lines = []
    tr = Trainer(_spec(tmp_path / "run", steps=1, init_from=str(tmp_path / "hf")), spec, log=lines.append)
    got = _state(tr.model)
    for name, t in weights.items():
        if ".experts." in name:
            want = dequantize_mxfp4(*quantize_mxfp4(t), torch.float32)
        elif name.endswith(("A_log", "dt_bias", "selection_bias")) or "conv" in name or "o_norm" in name:
            want = t
        else:
            want = t.to(torch.bfloat16).float()
        assert torch.equal(got[name], want), name
    assert any("initialised from HF checkpoint" in line and "72 MXFP4 tensors dequantised" in line for line in lines)
    tr.fit()
    from moestack.train.convert import CheckpointSource, read_hf_layout

    ckpt = CheckpointSource(tr.ckpt_dir / "step_00000001")
    assert ckpt.extra["family"] == "kimi_k3"
    export_hf(ckpt, spec, tmp_path / "back")
    assert read_hf_layout(tmp_path / "back").files == read_hf_layout(tmp_path / "hf").files


def test_init_from_hf_mismatch_is_named(tmp_path):
    spec, cfg_path = _k3(tmp_path)
    export_hf(_state(Trainer(_spec(tmp_path / "s", steps=1), spec, log=lambda *a: None).model), spec,
              tmp_path / "hf", config=cfg_path.read_text())
    other = spec.model_copy(update={"vocab_size": 320})
    with pytest.raises(ConvertError, match=r"shape mismatch: language_model\.model\.embed_tokens\.weight: checkpoint "
                                           r"\[288, 64\] vs model \[320, 64\]"):
        Trainer(_spec(tmp_path / "x", init_from=str(tmp_path / "hf")), other, log=lambda *a: None)


def test_cli_init_from(source, tmp_path, capsys):
    from moestack.cli.app import main

    model = tmp_path / "model.yaml"
    from moestack.config.base import dump_yaml

    dump_yaml(source["model_spec"], model)
    args = ["train", "--model", str(model), "--steps", "1", "--device", "cpu", "--precision", "fp32", "-q",
            *[f"--set={k}={v}" for k, v in OPTS.items() if k not in ("device", "precision")]]
    assert main([*args, "--out", str(tmp_path / "ok"), "--init-from", str(source["run"])]) == 0
    assert "initialised from" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "bad"), "--init-from", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "init_from:" in err and "no such file or directory" in err and err.count("\n") == 1
