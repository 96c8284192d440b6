"""MXFP4 quantisation-aware training of the routed experts (TrainSpec.qat = mxfp4_experts): the forward runs on the
experts' MXFP4 values, the gradient passes straight through to the fp32 weights, and an MXFP4 export stores exactly
the model the run trained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _k3_small import small_k3_config  # noqa: E402

from moestack.config.base import ConfigError  # noqa: E402
from moestack.config.hf import hf_config_to_spec  # noqa: E402
from moestack.config.train_spec import load_train_spec  # noqa: E402
from moestack.model.moe import Experts  # noqa: E402
from moestack.model.transformer import build_model  # noqa: E402
from moestack.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from moestack.train.convert import export_hf, hf_to_state_dict  # noqa: E402
from moestack.train.trainer import Trainer  # noqa: E402

OPTS = {"seq_len": 16, "micro_batch_size": 2, "logging.every": 1, "logging.tensorboard": False,
        "logging.progress": False, "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1,
        "device": "cpu", "precision": "fp32", "checkpoint.every": 0, "checkpoint.save_final": False}


def _q(w: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)


def test_experts_forward_is_mxfp4_and_gradient_straight_through():
    torch.manual_seed(0)
    qat, plain = Experts(4, 64, 32, "swiglu"), Experts(4, 64, 32, "swiglu")
    for m in (qat, plain):
        m.routing_backend = "reference"
    with torch.no_grad():
        qat.w_gate_up.normal_()
        qat.w_down.normal_()
        plain.w_gate_up.copy_(_q(qat.w_gate_up))
        plain.w_down.copy_(_q(qat.w_down))
    qat.fake_quant = "mxfp4"
    x = torch.randn(10, 64)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    y_q, y_p = qat(x, offs), plain(x, offs)
    assert torch.equal(y_q, y_p)
    g = torch.randn_like(y_q)
    y_q.backward(g)
    y_p.backward(g)
    assert torch.equal(qat.w_gate_up.grad, plain.w_gate_up.grad)  # d/dw = d/dq at q (straight through)
    assert torch.equal(qat.w_down.grad, plain.w_down.grad)


def test_qat_run_exports_the_model_it_trained(tmp_path):
    cfg = small_k3_config()
    spec = hf_config_to_spec(cfg, "k3-small").spec
    lines = []
    tr = Trainer(load_train_spec(None, {**OPTS, "out_dir": str(tmp_path / "run"), "steps": 2, "qat": "mxfp4_experts"}),
                 spec, log=lines.append)
    assert any(line.startswith("qat: routed experts of 3 MoE layers") for line in lines)
    tr.fit()
    sd = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    export_hf(sd, spec, tmp_path / "hf", dtype=torch.float32, config=json.dumps(cfg))  # experts MXFP4, rest fp32
    back = build_model(spec, "cpu", seed=1)
    back.load_state_dict(hf_to_state_dict(tmp_path / "hf", spec, mxfp4_dtype=torch.float32))
    inputs, targets = tr.sampler.next_batch()
    tr.model.eval()
    back.eval()
    with torch.no_grad():
        assert torch.equal(tr.model(inputs, targets), back(inputs, targets))  # the exported model is the trained one
        for m in tr.model.moe_layers().values():
            m.experts.fake_quant = None
        assert not torch.equal(tr.model(inputs, targets), back(inputs, targets))  # without QAT it would not be


def test_qat_refuses_widths_off_the_group(tmp_path):
    cfg = small_k3_config()
    cfg["text_config"]["moe_intermediate_size"] = 48
    spec = hf_config_to_spec(cfg, "k3-odd").spec
    with pytest.raises(ConfigError, match="qat: mxfp4_experts needs expert widths .* multiples of 32; .* 48"):
        Trainer(load_train_spec(None, {**OPTS, "out_dir": str(tmp_path), "steps": 1, "qat": "mxfp4_experts"}), spec,
                log=lambda *a: None)
