"""KernelSpec: typed kernel choices in TrainSpec and Plan, the build-time resolution (ops/backends.py), the modules
receiving the choices (model/kernels.py) and kernels.json; no environment variable changes a kernel choice."""

from __future__ import annotations

import json

import pytest
import torch

from moestack.config import load_model_spec, load_train_spec
from moestack.config.base import ConfigError
from moestack.config.kernel_spec import KernelSpec, kernel_fields, merge, with_fields
from moestack.config.plan import make_plan
from moestack.model.kernels import apply_kernels
from moestack.model.transformer import build_model
from moestack.ops.backends import resolve_kernels


def test_defaults_are_auto_and_fields_validate():
    spec = KernelSpec()
    fields = kernel_fields(spec)
    assert fields["kda.backend"] == fields["dsa.backend"] == fields["moe.gemm"] == fields["moe.routing"] == "auto"
    assert with_fields(spec, {"kda.backend": "reference"}).kda.backend == "reference"
    with pytest.raises(ValueError, match=r"kernels: kda.backend: Input should be .*'reference'.* \(got 'cutlass'\)"):
        with_fields(spec, {"kda.backend": "cutlass"})
    with pytest.raises(ValueError, match="kernels.kda.speed: unknown field; fields are kda.backend"):
        with_fields(spec, {"kda.speed": 1})
    with pytest.raises(ValueError, match="cublas_min_rows"):
        with_fields(spec, {"fp8.cublas_min_rows": -1})


def test_train_spec_and_plan_carry_kernels(tmp_path):
    spec = load_train_spec(None, {"kernels.dsa.backend": "reference"})
    assert spec.kernels.dsa.backend == "reference"
    with pytest.raises(ConfigError, match="train options: kernels.moe.gemm: Input should be"):
        load_train_spec(None, {"kernels.moe.gemm": "fast"})
    plan = make_plan(model="tiny", cluster="cpu", devices=1, seq_len=16, global_batch_size=2,
                     kernels={"kda": {"backend": "reference"}, "moe": {"gemm": "torch"}})
    # the train spec's explicit choice wins over the plan's; the plan's over the default
    merged = merge(with_fields(KernelSpec(), {"moe.gemm": "reference"}), plan.kernels)
    assert (merged.kda.backend, merged.moe.gemm, merged.dsa.backend) == ("reference", "reference", "auto")


def test_plan_ep_domain_size_must_divide_ep():
    from moestack.train.trainer import _ep_domain_size

    layout = dict(model="tiny", cluster="cpu", devices=4, seq_len=16, global_batch_size=4, dp_shard=4, zero_stage=2,
                  ep=4, dispatcher="hierarchical")
    assert _ep_domain_size(make_plan(**layout, ep_domain_size=2)) == 2
    with pytest.raises(ConfigError, match=r"ep_domain_size \(3\) must divide ep \(4\)"):
        make_plan(**layout, ep_domain_size=3)


def test_resolution_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = resolve_kernels(KernelSpec(), "cpu")
    assert {k: r.choices[k].runs for k in ("kda.backend", "kda.layer_ops", "dsa.backend", "moe.routing",
                                          "moe.gemm")} == \
        {"kda.backend": "reference", "kda.layer_ops": "torch", "dsa.backend": "reference", "moe.routing": "reference",
         "moe.gemm": "torch"}
    assert r.choices["kda.backend"].source == "default"
    with pytest.raises(ConfigError, match="kernels.kda.backend: 'triton' cannot run on cpu: the Triton kernels need"):
        resolve_kernels(with_fields(KernelSpec(), {"kda.backend": "triton"}), "cpu")
    with pytest.raises(ConfigError, match="kernels.moe.crossover: .*nope.json: file not found"):
        resolve_kernels(with_fields(KernelSpec(), {"moe.crossover": "nope.json"}), "cpu")
    monkeypatch.setenv("MOESTACK_MOE_BACKEND", "reference")  # the variable of earlier versions changes nothing now
    r = resolve_kernels(KernelSpec(), "cpu")
    assert (r.choices["moe.gemm"].runs, r.choices["moe.gemm"].source) == ("torch", "default")


def test_modules_receive_the_choices():
    model = build_model(load_model_spec("tiny"), "cpu", seed=0)
    apply_kernels(model, KernelSpec(kda={"backend": "reference", "layer_ops": "torch"}, dsa={"backend": "reference"},
                                    moe={"routing": "reference", "gemm": "reference"}))
    kda = [m for m in model.modules() if type(m).__name__ == "KDAAttention"]
    mla = [m for m in model.modules() if type(m).__name__ == "GatedMLA"]
    moe = list(model.moe_layers().values())
    assert kda and mla and moe
    assert all((m.kda_backend, m.layer_ops) == ("reference", "torch") for m in kda)
    assert all(m.dsa_backend == "reference" for m in mla)
    assert all(m.routing_backend == "reference" and m.experts.gemm.backend == "reference" for m in moe)
    tokens = torch.randint(0, 64, (1, 16))
    assert torch.isfinite(model(tokens, tokens)).all()


def test_trainer_writes_kernels_json(tmp_path):
    from moestack.train.trainer import Trainer

    spec = load_train_spec(None, {"out_dir": str(tmp_path), "steps": 1, "micro_batch_size": 2, "seq_len": 16,
                                  "device": "cpu", "eval_every": 0, "logging.tensorboard": False,
                                  "logging.progress": False, "checkpoint.save_final": False,
                                  "kernels.kda.backend": "reference"})
    Trainer(spec, load_model_spec("tiny"), log=lambda *a, **k: None).fit()
    record = json.loads((tmp_path / "kernels.json").read_text())
    assert record["device"] == "cpu"
    assert record["kernels"]["kda.backend"] == {"requested": "reference", "runs": "reference", "source": "spec"}
    assert record["kernels"]["dsa.backend"] == {"requested": "auto", "runs": "reference", "source": "default"}
    assert isinstance(record["tuned_hits"], dict)
